"""Serving a model on the mesh: plans, stages, links, sessions and the generate RPC.

```
serve_model(node, config)
├── data plane          listeners for shm / tcp / torchdist, negotiated over libp2p
├── _plan_loop          coordinator: replan on membership change or drift; everyone:
│                       adopt the newest plan, load the assigned stage, announce ready
├── stage servers       one per assigned unit range (continuous batching)
├── _expiry_loop        idle sessions' KV caches are freed
└── handlers            /hetmesh/dataplane (links), /hetmesh/session (stage control),
                        /hetmesh/generate (requests entering at this node: gateway)
```

Every node runs the same code; the coordinator (lowest live peer id) is the
only one that plans, and signs what it publishes with its libp2p identity key;
a node follows only plans its own coordinator signed, within an epoch window,
that are sane on its view (:mod:`hetmesh.scheduler.plan_trust`), and ignores
(and logs, once a minute per peer) any other. The plan loop gathers a view of
the mesh, lets the pure
:func:`~hetmesh.scheduler.coordination.decide` choose (adopt a peer's plan,
publish a new one, or keep), and carries the step out. Every node announces
the plan it follows and switches to any plan that supersedes it
(:func:`~hetmesh.scheduler.replan.supersedes`), so two nodes that both
believed they coordinated (views differ while peers join) still end on one
plan. The plan, stage readiness, calibration and weight format travel in one
:class:`~hetmesh.scheduler.announcement.ServingAnnouncement`, written by
``_announce`` and read with :func:`~hetmesh.scheduler.announcement.read_serving`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import trio

from hetmesh.discovery import wire
from hetmesh.discovery.rpc import call
from hetmesh.discovery.wire import Announcement, Load
from hetmesh.error_codec import error_code
from hetmesh.errors import (
    InsufficientCapacity,
    InvalidRequest,
    MeshError,
    NoRoute,
    Rejected,
    RemoteProtocolError,
)
from hetmesh.node.config import PLANNED_SESSIONS, ServingConfig
from hetmesh.node.control import (
    MAX_CONTROL_BYTES,
    SESSION_PROTOCOL,
    CloseSession,
    MoveSession,
    Reply,
    Request,
    parse_request,
)
from hetmesh.node.gateway import Gateway, Hop
from hetmesh.node.kvcache import kv_counters, stage_kv_limits
from hetmesh.node.link_pool import DATAPLANE_PROTOCOL, LinkPool
from hetmesh.node.readiness import StageKey, ready_pipelines, unready_peers
from hetmesh.node.split import Replica, choose_helper
from hetmesh.node.stage_server import StageServer
from hetmesh.node.weights import QUANTIZED_ORDER
from hetmesh.partition.blocks import BLOCK_TOKENS
from hetmesh.protocol.generate import (
    GENERATE_PROTOCOL,
    MAX_REQUEST_BYTES,
    Delta,
    Finish,
    GenerateRequest,
    SamplingParams,
    error_reply,
    finish_reason,
)
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile, PeerId
from hetmesh.scheduler.announcement import (
    MAX_BLOCK_STEP_S,
    MAX_CHUNK_COST,
    MIN_BLOCK_STEP_S,
    Calibration,
    Host,
    ServedStage,
    ServingAnnouncement,
    read_offer,
    read_serving,
    serving_extra,
    serving_stages,
)
from hetmesh.scheduler.coordination import (
    Adopt,
    CoordinatorConfig,
    CoordinatorState,
    MeshView,
    Publish,
    decide,
)
from hetmesh.scheduler.holdings import unheld_units, unheld_verdict
from hetmesh.scheduler.plan_trust import (
    Offer,
    PlanSignature,
    epoch_floor,
    plan_message,
    plan_refusal,
)
from hetmesh.scheduler.prefix_summary import SUMMARY_BLOCKS, decode_summary, encode_summary
from hetmesh.scheduler.records import (
    MeshLoad,
    Pipeline,
    PipelineLoad,
    Plan,
    PlanConstraints,
    RouteRequest,
    Stage,
    WeightBytes,
)
from hetmesh.scheduler.replan import MeshSnapshot, coordinator
from hetmesh.scheduler.router import RouteMemory, cached_blocks, route
from hetmesh.shards.fetch import SHARDS_PROTOCOL, Shards, open_shards
from hetmesh.shards.links import SHARD_LINK_PROTOCOL, shard_plane_config
from hetmesh.transport import (
    Activations,
    DataPlane,
    DataPlaneConfig,
    Error,
    Frame,
    KVBlock,
    Link,
    Tokens,
)
from hetmesh.transport.frames import Cancel

if TYPE_CHECKING:
    from libp2p.abc import INetStream
    from trio_typing import TaskStatus

    from hetmesh.node.runtime import Node

log = logging.getLogger(__name__)


class _Member(Protocol):
    """A live peer serving our model, whose record we hold."""

    @property
    def peer_id(self) -> PeerId: ...

    @property
    def record(self) -> Announcement: ...


@dataclass(slots=True)
class _Served:
    server: StageServer
    scope: trio.CancelScope
    retiring: bool = False


@dataclass(frozen=True, slots=True)
class ServingStatistics:
    plan_epoch: int
    coordinator: str
    stages: tuple[tuple[int, int], ...]
    links: dict[str, str]
    insufficient: str


class Serving:
    """One node's share of serving a model; see the module docstring."""

    def __init__(self, node: Node, config: ServingConfig, model_dir: Path) -> None:
        from hetmesh.partition.profile import model_profile
        from hetmesh.partition.store import check_model_dir

        self.node = node
        self.config = config
        self.model_dir = model_dir
        self._model_config = check_model_dir(model_dir)
        # the planner's fallback for peers announcing no format; each device is
        # charged its own format's bytes (weights_constraints)
        self.profile: ModelProfile = model_profile(self._model_config, name=model_dir.name)
        self.model_key = self.profile.name
        # the format this node's stages are held in: "native" is the checkpoint's own,
        # "auto" is settled by calibration
        self.weights = self._settle(config.weights, node.config.device or "cpu")
        self._weight_bytes: dict[str, WeightBytes | None] = {}
        self.constraints = PlanConstraints(
            max_context_tokens=min(config.max_context_tokens, self.profile.max_context),
            max_sessions=config.max_sessions or PLANNED_SESSIONS,
            reserve_bytes=config.reserve_bytes,
        )
        self._coordinator_config = CoordinatorConfig(
            model=self.profile,
            strategy=config.plan_strategy,
            objective=config.objective,
            standby=config.standby,
            compact_formats=frozenset(QUANTIZED_ORDER),
            compact_hint=COMPACT_HINT,
        )
        self._announced = ServingAnnouncement()  # what the discovery record says of us
        # peer -> (its record, the serving state read from it): read once per announcement
        self._served_by: dict[PeerId, tuple[Announcement, ServingAnnouncement]] = {}
        self._coordination = CoordinatorState()  # the plan followed, ours, the last verdict
        # the signatures of the plans that passed plan_refusal this turn (relayed on adoption)
        self._signatures: list[tuple[Plan, PlanSignature]] = []
        self._verified: dict[tuple[str, str, bytes], bool] = {}  # (signer, sig, message)
        self._refusal_logged: dict[PeerId, float] = {}  # peer -> when we last said so
        self._corrected: frozenset[str] = frozenset()  # devices planned on measured steps
        self._applied: Plan | None = None  # the plan _apply last acted on
        self._corrected_logged = -REFUSAL_LOG_INTERVAL_S
        self._served: dict[tuple[int, int], _Served] = {}
        self._loading: set[tuple[int, int]] = set()
        self._mine: set[tuple[int, int]] = set()  # the stages the followed plan gives us
        self._draining = False  # stopping: every stage retires, its sessions move away
        self._changed = trio.Event()
        self._started_at = trio.current_time()
        self.tokenizer: Any = None
        self.eos: frozenset[int] = frozenset()
        self.pool: LinkPool | None = None
        self.plane: DataPlane | None = None
        self.gateway: Gateway | None = None
        self.shards: Shards | None = None
        self._nursery: trio.Nursery | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._routed = RouteMemory()  # prefix blocks this gateway sent where (cache routing)

    # -- wiring -------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[Serving] = trio.TASK_STATUS_IGNORED) -> None:
        from hetmesh.partition.text import eos_token_ids, load_tokenizer
        from hetmesh.transport import open_data_plane

        def load_text() -> tuple[Any, frozenset[int]]:
            tokenizer = load_tokenizer(self.model_dir)
            return tokenizer, frozenset(eos_token_ids(self.model_dir, tokenizer))

        self.tokenizer, self.eos = await trio.to_thread.run_sync(load_text)
        discovery = self.node.discovery
        plane_config = DataPlaneConfig(
            peer_id=self.node.peer_id,
            backends=self.config.backends,
            require_encryption=self.config.require_encryption,
            tcp_host=self.config.tcp_host or data_plane_host(self.node.discovery.addrs),
            gloo="torchdist" in self.config.backends,
            device=self.node.config.device,
        )
        async with (
            open_data_plane(plane_config) as plane,
            open_data_plane(shard_plane_config(plane_config)) as shard_plane,
            trio.open_nursery() as nursery,
        ):
            self.plane = plane
            self._nursery = nursery
            self._trio_token = trio.lowlevel.current_trio_token()
            self.pool = LinkPool(
                host=self.node.host, plane=plane, dispatch=self._dispatch, nursery=nursery
            )
            self.gateway = Gateway(
                peer_id=self.node.peer_id,
                control=self._control,
                send=self._send,
                choose=self._choose,
                ping=self._ping,
                eos_token_ids=self.eos,
                max_context=self.constraints.max_context_tokens,
                timeouts=self.config.timeouts,
                prefix_cache=self.config.prefix_cache,
                migrate=self.config.migrate,
                chunk_costs=self._chunk_costs,
                helper=self._helper,
            )
            discovery.set_data_plane({"backends": list(plane.config.backends)})
            # the tensors it holds, offered to peers (hetmesh.shards: issue 15)
            self.shards = await open_shards(discovery, self.model_dir, self.model_key)
            if self.shards is not None:
                discovery.add_handler(SHARDS_PROTOCOL, self.shards.handle)
                # tensors over the data plane; the protocol above is the fallback
                links = self.shards.attach_links(self.node.host, shard_plane)
                discovery.add_handler(SHARD_LINK_PROTOCOL, links.handle)
            await self._calibrate_here()  # announced with (before) the model: planned together
            self._announce(self._with_held(model=self.model_key, host=self._host()))
            discovery.add_handler(DATAPLANE_PROTOCOL, self.pool.handle_incoming)
            discovery.add_handler(SESSION_PROTOCOL, self._handle_session)
            discovery.add_handler(GENERATE_PROTOCOL, self._handle_generate)
            self._publish()
            nursery.start_soon(self._plan_loop)
            nursery.start_soon(self._expiry_loop)
            # a dead peer's link closes and its sessions recover at once (issue 13, 7 and 8)
            nursery.start_soon(self.pool.close_dead, discovery.subscribe(), self.gateway.peer_gone)
            task_status.started(self)
            await trio.sleep_forever()

    # -- the plan -----------------------------------------------------------------

    def _members(self) -> list[_Member]:
        """Live peers serving the same model (records known)."""
        found = []
        served_by: dict[PeerId, tuple[Announcement, ServingAnnouncement]] = {}
        for e in self.node.discovery.alive():
            if e.record is None:
                continue
            # routing asks this per request: parse each record once (a new one per announcement)
            seen = self._served_by.get(e.peer_id)
            if seen is None or seen[0] is not e.record:
                seen = (e.record, read_serving(e.record.extra, e.record.stages, plan_of=None))
            served_by[e.peer_id] = seen
            if seen[1].model == self.model_key:
                found.append(e)
        self._served_by = served_by  # the live peers' only
        return cast("list[_Member]", found)  # each one's record is known: checked above

    def _snapshot_now(self, members: Sequence[_Member]) -> MeshSnapshot:
        def capacity(d: DeviceProfile) -> DeviceProfile:
            # plan on the device's whole memory: what our own stages hold is ours to use
            return dataclasses.replace(d, memory_free_bytes=d.memory_total_bytes)

        records = [self.node.discovery.local_record()] + [e.record for e in members]
        ids = {r.peer_id for r in records}
        # a record speaks for its sender only: another peer's device, or a link that
        # does not start at the sender, is not the sender's to announce
        devices = tuple(capacity(d) for r in records for d in r.devices if d.peer_id == r.peer_id)
        links: dict[tuple[str, str], LinkProfile] = {}
        for r in records:
            for link in r.links:
                if link.src == r.peer_id and link.dst in ids:
                    links[(link.src, link.dst)] = link
        # the plan's candidate links nobody measured yet: ask their ends to (bounded)
        missing = [(s, d) for s in sorted(ids) for d in sorted(ids) if s != d]
        self.node.discovery.request_links([p for p in missing if p not in links])
        return MeshSnapshot(devices=devices, links=tuple(links[k] for k in sorted(links)))

    # -- calibration (hetmesh.node.calibration) --------------------------------------

    def _settle(self, setting: str, device: str) -> str:
        from hetmesh.partition.checkpoint import settle_weights

        fmt = settle_weights(setting, self.model_dir, device)
        return "float32" if fmt is None else fmt.value  # auto: until calibration decides

    def bytes_of(self, weights: str) -> WeightBytes | None:
        """What ``weights`` costs per unit of this model (None: not a format we know)."""
        from hetmesh.node.weights import weight_bytes

        if weights not in self._weight_bytes:
            try:
                found: WeightBytes | None = weight_bytes(
                    self._model_config, weights, name=self.model_key
                )
            except (ValueError, MeshError):
                found = None
            self._weight_bytes[weights] = found
        return self._weight_bytes[weights]

    def _fits_here(self, device: str) -> Callable[[str], bool]:
        """Whether this node's device holds at least one unit in a format."""
        from hetmesh.node.weights import fits

        local = self.node.discovery.local_record(advance=False)
        mine = next((d for d in local.devices if d.device == device), None)

        def check(weights: str) -> bool:
            found = self.bytes_of(weights)
            if mine is None or found is None:
                return found is not None
            return fits(self.profile, found, mine, self.constraints)

        return check

    async def _calibrate_here(self) -> None:
        """:meth:`_calibrate`; a node without the model times a block fetched for the purpose
        into a scratch folder (its cache keeps only the units it serves)."""
        shards = self.shards
        if shards is None or not shards.partial or self.config.block_step_s is not None:
            await self._calibrate()
            return
        root = self.model_dir.parent.parent / "calibration"
        try:
            async with shards.open_scratch(1, 2, root) as scratch:
                await self._calibrate(scratch)
        except MeshError as exc:
            log.warning("cannot fetch a block to calibrate on: %s", exc)
            await self._calibrate()

    async def _calibrate(self, model_dir: Path | None = None) -> None:
        """Settle the weight format, time one real decoder block in it here (or take the
        configured figure), and announce both.

        The coordinator's cost model scales this node's predicted step times to the
        figure and charges this node the format's bytes.
        """
        from hetmesh.node.calibration import CALIBRATION_CONTEXT_TOKENS
        from hetmesh.node.calibration import measure_block_step_s as measure
        from hetmesh.node.weights import choose_weights, supported_formats

        device = self.node.config.device or "cpu"
        key = device if ":" in device or device == "cpu" else f"{device}:0"
        given = self.config.block_step_s
        timed: dict[str, float | None] = {}

        def timing(weights: str) -> float | None:
            if weights not in timed:
                try:
                    timed[weights] = measure(
                        model_dir or self.model_dir,
                        device=device,
                        weights=weights,
                        threads=self.config.threads,
                    )
                except MeshError as exc:
                    log.warning("calibration in %s failed: %s", weights, exc)
                    timed[weights] = None
            return timed[weights]

        if self.config.weights == "auto":
            fitting = self._fits_here(key)
            measure_one = timing if given is None else (lambda _w: None)

            def decide() -> tuple[str, float | None]:
                return choose_weights(supported_formats(device), fitting, measure_one)

            self.weights, step = await trio.to_thread.run_sync(
                decide, limiter=self.node.device_limiter
            )
            measured = ", ".join(f"{w} {t * 1e3:.2f} ms" for w, t in timed.items() if t is not None)
            log.info("weights auto: %s (block steps: %s)", self.weights, measured or "not timed")
        elif given is None:
            step = await trio.to_thread.run_sync(
                timing, self.weights, limiter=self.node.device_limiter
            )
        else:
            step = None
        self._announce(dataclasses.replace(self._announced, weights=self.weights))
        if given is not None:
            step = given
            log.info("calibration skipped: announcing %.2f ms per block as given", step * 1e3)
        elif step is None:
            log.warning("no calibration (planning on the roofline alone)")
            return
        else:
            log.info(
                "calibrated: one block's decode step takes %.2f ms here in %s",
                step * 1e3,
                self.weights,
            )
        chunk_cost, row_cost = 0.0, 1.0
        if given is None:
            chunk_cost = await trio.to_thread.run_sync(
                self._chunk_cost,
                model_dir or self.model_dir,
                device,
                limiter=self.node.device_limiter,
            )
            row_cost = await trio.to_thread.run_sync(
                self._row_cost,
                model_dir or self.model_dir,
                device,
                limiter=self.node.device_limiter,
            )
        calibration = Calibration(
            model=self.model_key,
            device=key,
            block_step_s=min(max(step, MIN_BLOCK_STEP_S), MAX_BLOCK_STEP_S),  # what peers accept
            context_tokens=CALIBRATION_CONTEXT_TOKENS,
            weights=self.weights,
            prefill_chunk_cost=chunk_cost,
            row_cost=row_cost,
        )
        self._announce(dataclasses.replace(self._announced, calibration=calibration))

    def _chunk_cost(self, model_dir: Path, device: str) -> float:
        """What prefill chunks cost here (the calibration's block, in this node's format);
        0 where it cannot be measured (gateways then keep chunking on)."""
        from hetmesh.node.calibration import measure_chunk_cost

        try:
            cost = measure_chunk_cost(
                model_dir,
                device=device,
                weights=self.weights,
                threads=self.config.threads,
                repeats=2,
            )
        except MeshError as exc:
            log.warning("timing prefill chunks failed: %s", exc)
            return 0.0
        log.info("prefill chunks cost %.2fx the whole prefill here in %s", cost, self.weights)
        return min(max(cost, 0.0), MAX_CHUNK_COST)

    def _host(self) -> Host | None:
        """The CPU cores this node's stages compute on (None on an accelerator: a CPU
        shared with other nodes does not slow its forwards)."""
        from hetmesh.node.calibration import host_share

        if (self.node.config.device or "cpu") != "cpu":
            return None
        key, cores, share = host_share(self.config.threads)
        return Host(key=key, cores=cores, share=share)

    def _row_cost(self, model_dir: Path, device: str) -> float:
        """What a further session of a decode round costs here (the calibration's block);
        1 (as dear as a step of its own) where it cannot be measured."""
        from hetmesh.node.calibration import measure_row_cost

        try:
            cost = measure_row_cost(
                model_dir, device=device, weights=self.weights, threads=self.config.threads
            )
        except MeshError as exc:
            log.warning("timing batched decode steps failed: %s", exc)
            return 1.0
        log.info("a further session of a decode round costs %.2f of a step here", cost)
        return cost

    def _chunk_costs(self, hops: Sequence[Hop]) -> list[float | None]:
        """Each hop's announced prefill chunk cost (None: not measured or not known)."""
        costs: list[float | None] = []
        for hop in hops:
            if hop.peer_id == self.node.peer_id:
                calibration = self._announced.calibration
            else:
                seen = self._served_by.get(hop.peer_id)
                calibration = seen[1].calibration if seen else None
            cost = calibration.prefill_chunk_cost if calibration is not None else 0.0
            costs.append(cost if cost > 0 else None)
        return costs

    def _plan_constraints(
        self, members: Sequence[_Member], devices: Sequence[DeviceProfile]
    ) -> PlanConstraints:
        from hetmesh.node.calibration import calibrated_constraints, measured_constraints
        from hetmesh.node.weights import weights_constraints
        from hetmesh.scheduler.announcement import quota_constraints

        local = self.node.discovery.local_record(advance=False)
        announced = [(local.peer_id, local.extra)] + [(e.peer_id, e.record.extra) for e in members]
        constraints = calibrated_constraints(self.constraints, self.model_key, announced)
        constraints = quota_constraints(constraints, announced)
        constraints = weights_constraints(constraints, announced, devices, self.bytes_of)
        # claims against what the stages serving the plan measure: a member far slower
        # than it claimed is planned on its measurement (at the next replan)
        observed = {e.peer_id: e.record.load.recent_step_s for e in members}
        observed[local.peer_id] = local.load.recent_step_s
        constraints, corrected = measured_constraints(constraints, self.plan, observed)
        now = trio.current_time()
        if corrected - self._corrected and now - self._corrected_logged >= REFUSAL_LOG_INTERVAL_S:
            self._corrected_logged = now  # at most once a minute: the set moves with load
            log.info(
                "planning %s on measured step times: far slower than claimed",
                ", ".join(sorted(corrected - self._corrected)),
            )
        self._corrected = corrected
        return constraints

    def _view(self, members: Sequence[_Member]) -> MeshView:
        """What the coordinator decides on: the mesh now, gathered from the announcements."""
        snapshot = self._snapshot_now(members)
        constraints = self._plan_constraints(members, snapshot.devices)
        peers = tuple(e.peer_id for e in members)
        offers = [o for e in members if (o := read_offer(e.record.extra, e.peer_id)) is not None]
        boss = coordinator((self.node.peer_id, *peers))
        self._signatures = []
        for offer in offers:
            why = plan_refusal(
                offer,
                coordinator=boss,
                current=self.plan,
                current_signer=self._coordination.signer,
                devices=snapshot.devices,
                model=self.profile,
                constraints=constraints,
                verify=self._verify,
            )
            if why:
                self._refused(offer, why)
            elif offer.signature is not None:
                self._signatures.append((offer.plan, offer.signature))
        return MeshView(
            me=self.node.peer_id,
            peers=peers,
            snapshot=snapshot,
            constraints=constraints,
            plans=tuple(p for p, _ in self._signatures),
            settled=trio.current_time() - self._started_at >= self.config.settle_s,
            epoch_floor=epoch_floor(offers),
        )

    def _unheld(self, members: Sequence[_Member]) -> str:
        """Why no plan can serve the model when no live member holds some of its units."""
        if self.shards is None:
            return ""
        holdings = [(self.shards.manifest_id, self.shards.units_held())]
        for e in members:
            state = read_serving(e.record.extra, plan_of=None)
            holdings.append((state.manifest, state.units_held))
        units = unheld_units(self.profile.num_units, holdings, self.shards.manifest_id)
        return unheld_verdict(self.model_key, units)

    def _refused(self, offer: Offer, why: str) -> None:
        """Say (at most once a minute per peer) that a peer's announced plan is ignored."""
        now = trio.current_time()
        peer = offer.relayed_by
        if now - self._refusal_logged.get(peer, -REFUSAL_LOG_INTERVAL_S) >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged[peer] = now
            log.warning(
                "ignoring the plan %s announces (epoch %d): %s", peer, offer.plan.epoch, why
            )

    def _sign(self, plan: Plan) -> PlanSignature:
        """This node's signature of ``plan``, with its libp2p identity key."""
        signature = self.node.host.get_private_key().sign(plan_message(plan))
        return PlanSignature(signer=self.node.peer_id, signature=bytes(signature).hex())

    def _verify(self, signer: PeerId, message: bytes, signature: bytes) -> bool:
        """Whether ``signer``'s identity key (in its peer id) signed ``message``."""
        key = (signer, signature.hex(), message)
        if key not in self._verified:
            if len(self._verified) >= MAX_VERIFIED:
                self._verified.clear()
            self._verified[key] = verify_signature(signer, message, signature)
        return self._verified[key]

    def _step(self, members: Sequence[_Member]) -> None:
        """Gather a view, let :func:`~hetmesh.scheduler.coordination.decide` choose, act on it."""
        step = decide(self._view(members), self._coordination, self._coordinator_config)
        unheld = self._unheld(members)  # units nobody holds: no plan can serve them (issue 15)
        if unheld:
            step = dataclasses.replace(
                step,
                state=dataclasses.replace(self._coordination, insufficient=unheld),
                actions=(),
            )
        before, self._coordination = self._coordination, step.state
        verdict = step.state.insufficient
        if verdict != before.insufficient:  # announced: gateways refuse requests at once
            if verdict:
                log.warning("cannot place %s on this mesh yet: %s", self.model_key, verdict)
            self._announce(dataclasses.replace(self._announced, insufficient=verdict))
        for action in step.actions:
            if isinstance(action, Publish):
                log.info(
                    "plan epoch %d (%s): %s; predicted %.1f ms/token",
                    action.plan.epoch,
                    action.reason,
                    " | ".join(
                        " → ".join(f"{s.peer_id[-6:]}[{s.start},{s.end})" for s in p.stages)
                        for p in action.plan.pipelines
                    ),
                    action.plan.decode_latency_s * 1e3,
                )
            elif isinstance(action, Adopt):
                if action.made_here:
                    signature: PlanSignature | None = self._sign(action.plan)
                else:  # relayed as the coordinator signed it
                    signature = next((g for p, g in self._signatures if p is action.plan), None)
                self._apply(action.plan)
                self._announce(
                    dataclasses.replace(self._announced, plan=action.plan, plan_signature=signature)
                )

    @property
    def plan(self) -> Plan | None:
        """The plan this node follows."""
        return self._coordination.plan

    @property
    def _insufficient(self) -> str:
        """Why the coordinator cannot place the model ("" when it can, or we do not plan)."""
        return self._coordination.insufficient

    @property
    def _snapshot(self) -> MeshSnapshot | None:
        """The mesh the followed plan was last judged on (None: judge it afresh)."""
        return self._coordination.planned_on

    def _apply(self, plan: Plan) -> None:
        if self.gateway is not None:  # a slow peer a standby replaced keeps its stage
            moved = self.gateway.move_replaced(self._applied, plan)
            if moved:
                log.info("%d sessions move off peers a standby replaced", moved)
        self._applied = plan
        mine = {
            (s.start, s.end)
            for p in plan.pipelines
            for s in p.stages
            if s.peer_id == self.node.peer_id
        }
        self._mine = mine
        assert self._nursery is not None
        for key in sorted(mine - self._served.keys() - self._loading):
            if self._draining:
                break
            self._loading.add(key)
            self._nursery.start_soon(self._load_stage, *key)
        self._swap()

    def _swap(self) -> None:
        """Retire the stages the followed plan no longer gives us, but only once every stage
        it does give us is loaded: until then the old ones keep serving (and admitting),
        also when a new stage's fetch or load fails for good. Draining retires them all."""
        loaded = self._mine <= self._served.keys()
        for key, served in self._served.items():
            served.retiring = self._draining or (
                key not in self._mine and (loaded or served.retiring)
            )

    async def _load_stage(self, start: int, end: int) -> None:
        from hetmesh.partition.stage import load_stage

        device = self.node.config.device or "cpu"
        log.info(
            "loading units [%d, %d) of %s on %s in %s",
            start,
            end,
            self.model_key,
            device,
            self.weights,
        )
        began = time.perf_counter()
        attempt = 0
        while True:
            attempt += 1
            try:
                if self.shards is not None:  # a node without them fetches the stage's tensors
                    await self.shards.ensure(start, end)
                    self._announce(self._with_held())
                stage = await trio.to_thread.run_sync(
                    lambda: load_stage(
                        self.model_dir, start, end, device=device, weights=self.weights
                    ),
                    limiter=self.node.device_limiter,
                )
                break
            except MeshError as exc:
                # a holder may come back, a disk may be freed: retry a few times while the
                # plan still wants the stage (the old stages serve meanwhile: _swap)
                if attempt >= STAGE_LOAD_ATTEMPTS or (start, end) not in self._mine:
                    log.error(
                        "loading units [%d, %d) failed (attempt %d): %s; giving up",
                        start,
                        end,
                        attempt,
                        exc,
                    )
                    self._loading.discard((start, end))
                    return
                log.warning(
                    "loading units [%d, %d) failed (attempt %d of %d): %s; retrying",
                    start,
                    end,
                    attempt,
                    STAGE_LOAD_ATTEMPTS,
                    exc,
                )
                await trio.sleep(STAGE_LOAD_RETRY_S * attempt)
        limits = stage_kv_limits(
            max_context_tokens=self.constraints.max_context_tokens,
            max_sessions=self.config.max_sessions,
            planned_sessions=self.constraints.max_sessions,
            pool_tokens=self.config.kv_pool_tokens,
            kv_bytes_per_token=stage.kv_bytes_per_token(),
            idle_timeout_s=self.config.idle_session_s,
        )
        if self.config.kv_reserve_whole:  # the old admission, for comparisons
            limits = dataclasses.replace(limits, reserve_whole=True)
        server = StageServer(
            stage,
            limits=limits,
            send=self._send,
            device_limiter=self.node.device_limiter,
            threads=self.config.threads,
            send_now=self._send_now,
        )
        scope = trio.CancelScope()
        assert self._nursery is not None

        async def run() -> None:
            with scope:
                await server.serve()

        self._nursery.start_soon(run)
        self._served[(start, end)] = _Served(server, scope)
        self._loading.discard((start, end))
        self._swap()  # the last new stage loaded: the old ones retire now
        log.info(
            "stage [%d, %d) ready: %d parameters in %.1f s",
            start,
            end,
            stage.param_count(),
            time.perf_counter() - began,
        )
        self._publish()

    async def drain(self) -> None:
        """Stop taking sessions and give the running ones up to ``drain_s`` to move away
        (their gateways migrate them, KV and all, once they see the stages retiring);
        what is left then is cut off by the stop, and its gateways replay it."""
        if self.config.drain_s <= 0:
            return
        self._draining = True
        for served in self._served.values():
            served.retiring = True
        self._publish()

        def held() -> int:
            return sum(s.server.kv.statistics().sessions for s in self._served.values())

        def busy() -> bool:  # sessions left, or moved ones' KV still on its way out
            return bool(held()) or any(s.server.sending() for s in self._served.values())

        if held():
            log.info("draining: %d sessions to move off this node", held())
        with trio.move_on_after(self.config.drain_s):
            while busy():
                if self.gateway is not None:  # sessions entering here move too
                    self.gateway.move_unready(self.ready_stages())
                await trio.sleep(0.05)
        if held():
            log.warning(
                "drained for %.1f s: %d sessions left to replay", self.config.drain_s, held()
            )

    def _retire_idle(self) -> None:
        for key, served in list(self._served.items()):
            server = served.server  # idle, and no moved session's KV still leaving
            if served.retiring and server.kv.statistics().sessions == 0 and not server.sending():
                served.scope.cancel()
                del self._served[key]
                log.info("stage [%d, %d) retired", *key)

    def _publish(self) -> None:
        stats = [s.server.statistics() for s in self._served.values()]
        self._announce(
            self._with_held(
                stages=tuple(
                    ServedStage(model=self.model_key, start=a, end=b, ready=not s.retiring)
                    for (a, b), s in sorted(self._served.items())
                ),
                gateway=_as_dict(self.gateway.statistics()) if self.gateway else {},
                stage_servers=tuple(
                    {k: v for k, v in _as_dict(s).items() if k != "kv" and k != "recent_step_s"}
                    | kv_counters(s.kv)
                    for s in stats
                ),
                shards=self.shards.counters() if self.shards is not None else {},
                prefix_summaries=self._prefix_summaries(),
            )
        )
        self.node.discovery.set_load(
            Load(
                queue_depth=sum(s.queue_depth for s in stats),
                active_sessions=sum(s.kv.sessions for s in stats),
                kv_bytes_used=sum(s.kv.bytes_used for s in stats),
                kv_bytes_free=sum(max(0, s.kv.budget_bytes - s.kv.bytes_reserved) for s in stats),
                recent_step_s=tuple(x for s in stats for x in s.recent_step_s[-4:]),
            )
        )

    def _with_held(self, **changes: Any) -> ServingAnnouncement:
        """The announced state with the shards' manifest and units held (and ``changes``)."""
        if self.shards is not None:
            changes.update(manifest=self.shards.manifest_id, units_held=self.shards.units_held())
        return dataclasses.replace(self._announced, **changes)

    def _announce(self, state: ServingAnnouncement) -> None:
        """Announce ``state`` (the one writer of this node's serving entries)."""
        self._announced = state
        for key, value in serving_extra(state).items():
            self.node.discovery.set_extra(key, value)
        self.node.discovery.set_stages(serving_stages(state))

    async def _plan_loop(self) -> None:
        while True:
            self._step(self._members())
            if self.gateway is not None:  # sessions on stages leaving alive move, KV and all
                self.gateway.move_unready(self.ready_stages())
            self._retire_idle()
            self._publish()
            self._changed.set()
            self._changed = trio.Event()
            await trio.sleep(self.config.plan_interval_s)

    async def _expiry_loop(self) -> None:
        while True:
            await trio.sleep(min(30.0, self.config.idle_session_s / 4))
            for served in self._served.values():
                for sid in served.server.expire_idle():
                    log.info(
                        "session %s expired after %.0f s idle", sid, self.config.idle_session_s
                    )

    # -- routing ------------------------------------------------------------------

    def ready_stages(self) -> set[StageKey]:
        ready = {(self.node.peer_id, a, b) for (a, b), s in self._served.items() if not s.retiring}
        for entry in self._members():
            for st in self._served_by[entry.peer_id][1].stages:
                if st.ready and st.model == self.model_key:
                    ready.add((entry.peer_id, st.start, st.end))
        return ready

    def _route(
        self, session_id: str, avoid: frozenset[PeerId], hashes: Sequence[int] = ()
    ) -> tuple[Hop, ...]:
        plan = self.plan
        if plan is None:
            return ()
        # ready_stages holds live peers' stages only: a dead peer's stages are unready
        unhealthy = set(avoid) | unready_peers(plan, self.ready_stages())
        # one pipeline: nothing to choose between, so no cache or load to weigh
        several = len(plan.pipelines) > 1
        cached: dict[str, int] = {}
        if hashes and several:
            summary = self._summary_of()
            cached = {
                p.key: max(cached_blocks(p, hashes, summary), self._routed.matched(hashes, p.key))
                for p in plan.pipelines
            }
        loads = self._loads(plan) if several else {}
        row_costs, hosts = self._sharing(plan) if several else ({}, {})
        try:
            chosen = route(
                plan,
                MeshLoad(pipelines=loads, unhealthy_peers=tuple(sorted(unhealthy))),
                RouteRequest(session_id=session_id),
                cached,
                local=self.node.peer_id,
                fed=self.gateway is not None and self.gateway.feed_steps > 1,
                row_costs=row_costs,
                hosts=hosts,
            )
        except NoRoute:
            return ()
        if several:
            self._routed.remember(hashes, chosen.key)
        return tuple(Hop(s.peer_id, s.start, s.end) for s in chosen.stages)

    def _helper(
        self, hops: Sequence[Hop], avoid: frozenset[PeerId], hashes: Sequence[int] = ()
    ) -> tuple[Hop, int, int] | None:
        """An idle, ready replica of a one-stage route's units in its format, to split a
        long prefill with (:mod:`hetmesh.node.split`), the unit where to cut, and the
        prompt tokens the route's stage is expected to hold cached; None when there is
        none."""
        plan = self.plan
        if plan is None or len(hops) != 1:
            return None
        unhealthy = frozenset(avoid) | unready_peers(plan, self.ready_stages())
        loads = self._loads(plan)
        costs, _ = self._sharing(plan)
        summary = self._summary_of() if hashes else None

        def state_of(peer: PeerId) -> ServingAnnouncement | None:
            if peer == self.node.peer_id:
                return self._announced
            seen = self._served_by.get(peer)
            return seen[1] if seen is not None else None

        def weights_of(peer: PeerId) -> str:
            if peer == self.node.peer_id:
                return self.weights
            state = state_of(peer)
            return state.weights if state is not None else ""

        def block_s(peer: PeerId) -> float:
            state = state_of(peer)
            calibration = state.calibration if state is not None else None
            return calibration.block_step_s if calibration is not None else 0.0

        def cached(pipeline: Pipeline) -> int:
            # as held (announced summaries), not the router's memory: that has just
            # noted this very prompt on the chosen route
            return cached_blocks(pipeline, hashes, summary) * BLOCK_TOKENS if summary else 0

        replicas = [
            Replica(
                peer_id=p.stages[0].peer_id,
                start=p.stages[0].start,
                end=p.stages[0].end,
                weights=weights_of(p.stages[0].peer_id),
                busy=bool(loads[p.key].active_sessions or loads[p.key].queued_requests),
                row_cost=costs.get(p.key, 1.0),
                cached_tokens=cached(p),
                block_step_s=block_s(p.stages[0].peer_id),
            )
            for p in plan.pipelines
            if len(p.stages) == 1
        ]
        main = next((r for r in replicas if r.peer_id == hops[0].peer_id), None)
        if main is None:
            return None
        found = choose_helper(main, replicas, unhealthy)
        if found is None:
            return None
        helper, unit = found
        return Hop(helper.peer_id, helper.start, helper.end), unit, main.cached_tokens

    def _sharing(self, plan: Plan) -> tuple[dict[str, float], dict[PeerId, Host]]:
        """What the router weighs besides load: each pipeline's cost of a further row of
        a round (its dearest stage's, as announced; 1 where unmeasured) and the cores
        each peer announces it computes on."""
        served = {peer: seen[1] for peer, seen in self._served_by.items()}
        served[self.node.peer_id] = self._announced

        def row_cost(peer: PeerId) -> float:
            state = served.get(peer)
            calibration = state.calibration if state is not None else None
            return calibration.row_cost if calibration is not None else 1.0

        hosts = {peer: state.host for peer, state in served.items() if state.host is not None}
        costs = {p.key: max(row_cost(s.peer_id) for s in p.stages) for p in plan.pipelines}
        return costs, hosts

    def _summary_of(self) -> Callable[[Stage], frozenset[int]]:
        """A stage's announced prefix summary (our own stages': read from their pools)."""
        mine = self._prefix_summaries()
        read: dict[tuple[str, int, int], frozenset[int]] = {}

        def summary(stage: Stage) -> frozenset[int]:
            key = (stage.peer_id, stage.start, stage.end)
            if key not in read:
                if stage.peer_id == self.node.peer_id:
                    text = mine.get((stage.start, stage.end))
                    read[key] = decode_summary(text)
                else:
                    seen = self._served_by.get(stage.peer_id)
                    read[key] = (
                        seen[1].prefix_summary(stage.start, stage.end) if seen else frozenset()
                    )
            return read[key]

        return summary

    def _loads(self, plan: Plan) -> dict[str, PipelineLoad]:
        """Each pipeline's sessions: those this gateway runs on it now, plus the most any
        of its stages serves for other gateways. Ours are counted now; another peer's
        are its announcement less the sessions of ours that ran there while its load was
        sampled (a plan tick before it was sent, at most): it lags, and a stream of ours
        that has ended since must not linger there."""
        gateway = self.gateway
        routes = gateway.routes() if gateway is not None else []
        local = self.node.discovery.local_record(advance=False).load
        mine = sum(s.server.kv.statistics().sessions for s in self._served.values())
        ours_here = sum(1 for hops in routes if any(h.peer_id == self.node.peer_id for h in hops))
        others: dict[PeerId, tuple[int, int]] = {
            self.node.peer_id: (max(0, mine - ours_here), local.queue_depth)
        }
        sampled = {
            peer: (record.sent_at_s - self.config.plan_interval_s, record.sent_at_s)
            for peer, (record, _) in self._served_by.items()
        }
        counted = gateway.sessions_during(sampled) if gateway is not None else {}
        for peer, (record, _) in self._served_by.items():
            ours = counted.get(peer, 0)
            others[peer] = (max(0, record.load.active_sessions - ours), record.load.queue_depth)
        running: dict[str, int] = {}
        for p in plan.pipelines:
            hops = tuple(Hop(s.peer_id, s.start, s.end) for s in p.stages)
            running[p.key] = sum(1 for r in routes if r == hops)
        return {
            p.key: PipelineLoad(
                active_sessions=running[p.key]
                + max(others.get(s.peer_id, (0, 0))[0] for s in p.stages),
                queued_requests=max(others.get(s.peer_id, (0, 0))[1] for s in p.stages),
            )
            for p in plan.pipelines
        }

    def _prefix_summaries(self) -> dict[tuple[int, int], str]:
        """What each of our ready stages holds in its prefix cache, as announced."""
        return {
            key: encode_summary(s.server.pool.prefix.recent_hashes(SUMMARY_BLOCKS))
            for key, s in sorted(self._served.items())
            if not s.retiring
        }

    def ready(self) -> bool:
        """Whether a pipeline of the adopted plan is fully ready (requests can enter)."""
        return bool(ready_pipelines(self.plan, self.ready_stages()))

    async def _choose(
        self, session_id: str, avoid: frozenset[PeerId], hashes: Sequence[int] = ()
    ) -> Sequence[Hop]:
        with trio.move_on_after(self.config.route_wait_s):
            while True:
                hops = self._route(session_id, avoid, hashes)
                if hops:
                    return hops
                verdict = self._insufficient or next(
                    (
                        served.insufficient
                        for e in self._members()
                        if (served := self._served_by[e.peer_id][1]).insufficient
                    ),
                    "",
                )
                if self.plan is None and verdict:  # the coordinator cannot place it: say so now
                    raise InsufficientCapacity(f"cannot serve {self.model_key}: {verdict}")
                await self._changed.wait()
        if self.plan is None:
            why = self._insufficient or "no plan yet (is the coordinator up?)"
        else:
            why = "no pipeline of the current plan is fully ready and healthy"
        raise NoRoute(f"no route for {self.model_key}: {why}")

    # -- transport glue -----------------------------------------------------------

    async def _send(self, peer: PeerId, frame: Frame) -> None:
        if peer == self.node.peer_id:
            self._dispatch(peer, None, frame)  # a hop to ourselves never leaves the process
            return
        assert self.pool is not None
        await self.pool.send(peer, frame)

    def _send_now(self, peer: PeerId, frame: Frame) -> bool:
        """From a stage's device thread: write ``frame`` to ``peer``'s open link if it
        takes it at once (False for a link not open yet or busy); a hop to ourselves
        is handed to trio as it is, in order with the thread's earlier ones."""
        if peer == self.node.peer_id:
            if self._trio_token is None:
                return False
            try:
                self._trio_token.run_sync_soon(self._dispatch_own, frame)
            except trio.RunFinishedError:  # stopping: the outbox path reports it
                return False
            return True
        if self.pool is None:
            return False
        return self.pool.send_now(peer, frame)

    def _dispatch_own(self, frame: Frame) -> None:
        """A frame a stage here sent to this node, on trio (a callback must not raise)."""
        try:
            self._dispatch(self.node.peer_id, None, frame)
        except Exception:  # a bug: the session times out and recovers, the node serves on
            log.exception("a frame to this node failed: %s", type(frame).__name__)

    def _dispatch(self, peer: PeerId, link: Link | None, frame: Frame) -> None:
        def release() -> None:
            if link is not None:
                link.release(frame)

        sender = None if link is None else peer  # None: a hop to ourselves
        try:
            if isinstance(frame, Activations):
                for served in self._served.values():
                    if frame.session_id in served.server.kv:
                        served.server.submit(frame, release, sender)
                        return
                release()
                raise InvalidRequest(f"unknown session {frame.session_id}")
            if isinstance(frame, KVBlock):  # a session migrating here (node.migration)
                for served in self._served.values():
                    if frame.session_id in served.server.kv:
                        served.server.receive_kv(frame, release, sender)
                        return
                release()
                raise InvalidRequest(f"no KV of session {frame.session_id} is expected here")
            release()
            if isinstance(frame, Tokens | Error) and self.gateway is not None:
                self.gateway.on_frame(frame, sender)
            elif isinstance(frame, Cancel):
                for served in self._served.values():
                    served.server.check_control(frame.session_id, sender)
                for served in self._served.values():
                    served.server.close(frame.session_id)
        except (InvalidRequest, Rejected) as exc:  # the sender's mistake, or a full inbox
            assert self._nursery is not None
            self._nursery.start_soon(
                self._send_quietly,
                peer,
                Error(
                    code=error_code(exc),
                    message=str(exc),
                    session_id=str(getattr(frame, "session_id", "")),
                ),
            )

    async def _send_quietly(self, peer: PeerId, frame: Frame) -> None:
        try:
            await self._send(peer, frame)
        except MeshError as exc:
            log.debug("could not tell %s: %s", peer, exc)

    async def _control(self, peer: PeerId, request: Request) -> Reply:
        if peer == self.node.peer_id:
            return self._apply_control(request)
        raw = await call(
            self.node.host,
            peer,
            SESSION_PROTOCOL,
            request.to_wire(),
            timeout_s=self.config.timeouts.ping_s * 2,
        )
        try:
            return Reply.from_wire(raw)
        except ValueError as exc:
            raise RemoteProtocolError(f"malformed control reply from {peer}: {exc}") from exc

    async def _ping(self, peer: PeerId) -> bool:
        if peer == self.node.peer_id:
            return True
        raw = await call(
            self.node.host,
            peer,
            SESSION_PROTOCOL,
            {"op": "ping"},
            timeout_s=self.config.timeouts.ping_s,
        )
        return bool(raw.get("ok"))

    def _apply_control(self, request: Request, sender: PeerId | None = None) -> Reply:
        """Apply a session request from ``sender`` (None: this node); only a session's
        gateway may close or move it (see :class:`StageServer`)."""
        if isinstance(request, MoveSession):
            for served in self._served.values():
                if request.session_id in served.server.kv:
                    return served.server.move(request, sender)
            return Reply.failed(InvalidRequest(f"unknown session {request.session_id}"))
        if isinstance(request, CloseSession):
            for served in self._served.values():
                try:
                    served.server.check_control(request.session_id, sender)
                except InvalidRequest as exc:
                    return Reply.failed(exc)
            for served in self._served.values():
                served.server.close(request.session_id)
            return Reply(ok=True)
        target = self._served.get((request.start, request.end))
        if target is None or target.retiring:
            return Reply.failed(
                NoRoute(f"units [{request.start}, {request.end}) are not served here")
            )
        return target.server.handle(request, sender)

    async def _handle_session(self, stream: INetStream) -> None:
        payload = await wire.read_frame(stream, max_bytes=MAX_CONTROL_BYTES, timeout_s=5.0)
        try:
            data = wire.decode_map(payload, max_bytes=MAX_CONTROL_BYTES)
            if data.get("op") == "ping":
                reply = Reply(ok=True)
            else:
                sender = str(stream.muxed_conn.peer_id)  # authenticated by libp2p
                reply = self._apply_control(parse_request(data), sender)
        except RemoteProtocolError as exc:  # the peer's mistake: say so, keep serving
            reply = Reply.failed(InvalidRequest(str(exc)))
        await wire.write_frame(stream, wire.encode(reply.to_wire()))

    # -- requests -----------------------------------------------------------------

    def encode(self, request: GenerateRequest) -> list[int]:
        """Token ids of a request: given ids, a conversation, or a prompt (``chat``: templated).

        Blocking (it runs the tokenizer). ``InvalidRequest`` for a malformed conversation.
        """
        from hetmesh.partition.text import encode_messages, encode_prompt

        if request.prompt_ids:
            return list(request.prompt_ids)
        if request.messages is not None:
            return encode_messages(self.tokenizer, list(request.messages))
        return encode_prompt(self.tokenizer, request.prompt or "", chat=request.chat)

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        """Token ids with their text deltas; stops at EOS, ``max_new_tokens`` or a stop string."""
        from hetmesh.partition.text import StopMatcher, TextStream

        assert self.gateway is not None
        text = TextStream(self.tokenizer)
        stops = StopMatcher(params.stop)
        async with contextlib.aclosing(self.gateway.generate(prompt_ids, params)) as tokens:
            async for token in tokens:
                delta = stops.feed(text.push(token))
                yield token, delta
                if stops.stopped:
                    return
        tail = stops.feed(text.flush()) + stops.flush()
        if tail:
            yield -1, tail

    async def _handle_generate(self, stream: Any) -> None:
        payload = await wire.read_frame(stream, max_bytes=MAX_REQUEST_BYTES, timeout_s=10.0)
        data = wire.decode_map(payload, max_bytes=MAX_REQUEST_BYTES)
        count = 0
        async with trio.open_nursery() as nursery:
            # the client sends nothing after its request: its stream ending (it closed or
            # reset it, or its host went away) means nobody reads the tokens any more, so
            # the generation stops there instead of running on to max_new_tokens
            nursery.start_soon(_cancel_when_closed, stream, nursery.cancel_scope)
            try:
                request = GenerateRequest.from_wire(data)
                ids = await trio.to_thread.run_sync(self.encode, request)  # off the event loop
                params = request.sampling
                async with contextlib.aclosing(self.stream(ids, params)) as events:
                    async for token, text in events:
                        if token >= 0:
                            count += 1
                        delta = Delta(text, token if token >= 0 else None)
                        await wire.write_frame(stream, wire.encode(delta.to_wire()))
                done = Finish(finish_reason(count, params.max_new_tokens), len(ids), count)
                await wire.write_frame(stream, wire.encode(done.to_wire()))
            except MeshError as exc:
                await wire.write_frame(stream, wire.encode(error_reply(exc)))
            nursery.cancel_scope.cancel()  # done: stop watching the stream

    def statistics(self) -> ServingStatistics:
        links = {}
        if self.pool is not None:
            links = {p: f"{link.backend}: {link.reason}" for p, link in self.pool.links().items()}
        return ServingStatistics(
            plan_epoch=self.plan.epoch if self.plan else -1,
            coordinator=coordinator([self.node.peer_id] + [e.peer_id for e in self._members()])
            or "",
            stages=tuple(sorted(self._served)),
            links=links,
            insufficient=self._insufficient,
        )


async def _cancel_when_closed(stream: Any, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``stream`` yields anything past the request: an end of
    stream, a reset, or bytes the protocol does not allow."""
    with contextlib.suppress(Exception):  # any failure to read is the client gone too
        await stream.read(1)
    scope.cancel()


REFUSAL_LOG_INTERVAL_S = 60.0
STAGE_LOAD_ATTEMPTS = 3  # a stage's fetch + load, before the node gives it up
STAGE_LOAD_RETRY_S = 2.0  # times the attempt number, between attempts
MAX_VERIFIED = 256  # cached signature checks (a few plans are announced at a time)


def verify_signature(signer: PeerId, message: bytes, signature: bytes) -> bool:
    """Whether the key embedded in peer id ``signer`` signed ``message`` (False for a
    malformed id, a key that is not embedded, or a bad signature)."""
    from libp2p.peer.id import ID

    try:
        public = ID.from_base58(signer).extract_public_key()
        return public is not None and bool(public.verify(message, signature))
    except Exception:  # any malformed id, key or signature is simply not a valid one
        return False


COMPACT_HINT = (
    "; nodes started with --weights bfloat16, int8 or int4 hold about 1/2, 1/4 or 1/7 "
    "of float32's weight bytes"
)


def data_plane_host(addrs: Sequence[str]) -> str:
    """The IPv4 address the data plane should listen on: the node's first announced
    non-loopback address (peers on other hosts can reach it), else loopback."""
    hosts = [a.split("/")[2] for a in addrs if a.startswith("/ip4/")]
    for host in hosts:
        if not host.startswith("127.") and host != "0.0.0.0":
            return host
    return "127.0.0.1"


def _as_dict(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


async def serve_model(
    node: Node,
    config: ServingConfig,
    *,
    task_status: TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Resolve the model (pulling it on first use), then serve it; never returns."""
    from hetmesh.partition.store import default_cache_dir, resolve_model
    from hetmesh.shards.fetch import join_from_mesh, wants_mesh_model

    if wants_mesh_model(config.model):  # no local model: its manifest and files from a peer
        assert config.model is not None
        cache_dir = config.cache_dir or default_cache_dir()
        model_dir = await join_from_mesh(node.discovery, config.model, cache_dir)
    else:
        model = config.model
        model_dir = await trio.to_thread.run_sync(
            lambda: resolve_model(model, cache_dir=config.cache_dir)
        )
    serving = Serving(node, config, model_dir)
    await serving.serve(task_status=task_status)


__all__ = ["GENERATE_PROTOCOL", "Serving", "ServingConfig", "serve_model"]
