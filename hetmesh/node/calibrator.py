"""This node's weight format and calibration: measured, and returned to announce.

:meth:`Calibrator.measure` settles the weight format (``auto``: the fastest
that fits, :func:`~hetmesh.node.weights.choose_weights`), times one real
decoder block in it (:mod:`hetmesh.node.calibration`), or takes the
configured figure, and returns both as a :class:`Measured`; it announces
nothing (the node's root does). The coordinator's cost model scales this
node's predicted step times to the figure and charges this node the format's
bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery.wire import Announcement
from hetmesh.errors import MeshError
from hetmesh.node.config import ServingConfig
from hetmesh.resources import ModelProfile
from hetmesh.scheduler.announcement import (
    MAX_BLOCK_STEP_S,
    MAX_CHUNK_COST,
    MIN_BLOCK_STEP_S,
    Calibration,
    Host,
)
from hetmesh.scheduler.records import PlanConstraints, WeightBytes

if TYPE_CHECKING:
    from hetmesh.shards.fetch import Shards

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Measured:
    """What calibration found: the weight format, and one block's figures (None:
    not calibrated, the planner uses the roofline alone)."""

    weights: str
    calibration: Calibration | None = None


class Calibrator:
    """Settles and times this node's weight format; see the module docstring.

    ``local``: this node's record now (its devices).
    """

    def __init__(
        self,
        *,
        model_dir: Path,
        model_config: Any,
        profile: ModelProfile,
        constraints: PlanConstraints,
        config: ServingConfig,
        device: str,
        device_limiter: trio.CapacityLimiter,
        local: Callable[[], Announcement],
    ) -> None:
        self.model_dir = model_dir
        self.model_config = model_config
        self.profile = profile
        self.model_key = profile.name
        self.constraints = constraints
        self.config = config
        self.device = device
        self._limiter = device_limiter
        self._local = local
        self._weight_bytes: dict[str, WeightBytes | None] = {}

    def settle(self) -> str:
        """The configured format ("native": the checkpoint's own; "auto": float32 until
        :meth:`measure` decides)."""
        from hetmesh.partition.checkpoint import settle_weights

        fmt = settle_weights(self.config.weights, self.model_dir, self.device)
        return "float32" if fmt is None else fmt.value

    def bytes_of(self, weights: str) -> WeightBytes | None:
        """What ``weights`` costs per unit of this model (None: not a format we know)."""
        from hetmesh.node.weights import weight_bytes

        if weights not in self._weight_bytes:
            try:
                found: WeightBytes | None = weight_bytes(
                    self.model_config, weights, name=self.model_key
                )
            except (ValueError, MeshError):
                found = None
            self._weight_bytes[weights] = found
        return self._weight_bytes[weights]

    def host(self) -> Host | None:
        """The CPU cores this node's stages compute on (None on an accelerator: a CPU
        shared with other nodes does not slow its forwards)."""
        from hetmesh.node.calibration import host_share

        if self.device != "cpu":
            return None
        key, cores, share = host_share(self.config.threads)
        return Host(key=key, cores=cores, share=share)

    async def measure_here(self, shards: Shards | None, weights: str) -> Measured:
        """:meth:`measure`; a node without the model times a block fetched for the
        purpose into a scratch folder (its cache keeps only the units it serves)."""
        if shards is None or not shards.partial or self.config.block_step_s is not None:
            return await self.measure(weights)
        root = self.model_dir.parent.parent / "calibration"
        try:
            async with shards.open_scratch(1, 2, root) as scratch:
                return await self.measure(weights, scratch)
        except MeshError as exc:
            log.warning("cannot fetch a block to calibrate on: %s", exc)
            return await self.measure(weights)

    async def measure(self, weights: str, model_dir: Path | None = None) -> Measured:
        """Settle the format (``weights``: the one settled so far) and time one block in
        it here, or take the configured figure."""
        from hetmesh.node.calibration import CALIBRATION_CONTEXT_TOKENS
        from hetmesh.node.calibration import measure_block_step_s as measure
        from hetmesh.node.weights import choose_weights, supported_formats

        device = self.device
        key = device if ":" in device or device == "cpu" else f"{device}:0"
        given = self.config.block_step_s
        source = model_dir or self.model_dir
        timed: dict[str, float | None] = {}

        def timing(w: str) -> float | None:
            if w not in timed:
                try:
                    timed[w] = measure(
                        source, device=device, weights=w, threads=self.config.threads
                    )
                except MeshError as exc:
                    log.warning("calibration in %s failed: %s", w, exc)
                    timed[w] = None
            return timed[w]

        if self.config.weights == "auto":
            fitting = self._fits_here(key)
            measure_one = timing if given is None else (lambda _w: None)

            def decide() -> tuple[str, float | None]:
                return choose_weights(supported_formats(device), fitting, measure_one)

            weights, step = await trio.to_thread.run_sync(decide, limiter=self._limiter)
            measured = ", ".join(f"{w} {t * 1e3:.2f} ms" for w, t in timed.items() if t is not None)
            log.info("weights auto: %s (block steps: %s)", weights, measured or "not timed")
        elif given is None:
            step = await trio.to_thread.run_sync(timing, weights, limiter=self._limiter)
        else:
            step = None
        if given is not None:
            step = given
            log.info("calibration skipped: announcing %.2f ms per block as given", step * 1e3)
        elif step is None:
            log.warning("no calibration (planning on the roofline alone)")
            return Measured(weights)
        else:
            log.info(
                "calibrated: one block's decode step takes %.2f ms here in %s", step * 1e3, weights
            )
        chunk_cost, row_cost = 0.0, 1.0
        if given is None:
            chunk_cost = await trio.to_thread.run_sync(
                self._chunk_cost, source, weights, limiter=self._limiter
            )
            row_cost = await trio.to_thread.run_sync(
                self._row_cost, source, weights, limiter=self._limiter
            )
        calibration = Calibration(
            model=self.model_key,
            device=key,
            block_step_s=min(max(step, MIN_BLOCK_STEP_S), MAX_BLOCK_STEP_S),  # what peers accept
            context_tokens=CALIBRATION_CONTEXT_TOKENS,
            weights=weights,
            prefill_chunk_cost=chunk_cost,
            row_cost=row_cost,
        )
        return Measured(weights, calibration)

    def _fits_here(self, device: str) -> Callable[[str], bool]:
        """Whether this node's device holds at least one unit in a format."""
        from hetmesh.node.weights import fits

        mine = next((d for d in self._local().devices if d.device == device), None)

        def check(weights: str) -> bool:
            found = self.bytes_of(weights)
            if mine is None or found is None:
                return found is not None
            return fits(self.profile, found, mine, self.constraints)

        return check

    def _chunk_cost(self, model_dir: Path, weights: str) -> float:
        """What prefill chunks cost here (the calibration's block, in this node's format);
        0 where it cannot be measured (gateways then keep chunking on)."""
        from hetmesh.node.calibration import measure_chunk_cost

        try:
            cost = measure_chunk_cost(
                model_dir,
                device=self.device,
                weights=weights,
                threads=self.config.threads,
                repeats=2,
            )
        except MeshError as exc:
            log.warning("timing prefill chunks failed: %s", exc)
            return 0.0
        log.info("prefill chunks cost %.2fx the whole prefill here in %s", cost, weights)
        return min(max(cost, 0.0), MAX_CHUNK_COST)

    def _row_cost(self, model_dir: Path, weights: str) -> float:
        """What a further session of a decode round costs here (the calibration's block);
        1 (as dear as a step of its own) where it cannot be measured."""
        from hetmesh.node.calibration import measure_row_cost

        try:
            cost = measure_row_cost(
                model_dir, device=self.device, weights=weights, threads=self.config.threads
            )
        except MeshError as exc:
            log.warning("timing batched decode steps failed: %s", exc)
            return 1.0
        log.info("a further session of a decode round costs %.2f of a step here", cost)
        return cost


__all__ = ["Calibrator", "Measured"]
