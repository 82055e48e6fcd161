"""Calibrating the cost model: one real decoder block's decode step, timed on this node.

The planner's roofline (FLOP/s and memory bandwidth from the profiler's
synthetic benchmarks) misses what a real decode step costs on a CPU: matrix-
vector products far below the copy benchmark's bandwidth, Python and kernel
dispatch, attention over the cache. So each serving node times the model's
first decoder block — loaded with the stage code that serves it, only that
block's tensors — doing single-token decode steps over
:data:`CALIBRATION_CONTEXT_TOKENS` tokens of KV cache. On a CPU it counts
the CPU time a step takes and divides by the cores it may use (a cgroup
quota of a quarter core makes a sustained step four times longer), so a busy
neighbour at start-up does not make a fast node look slow.

The figure travels in the node's announcement (``extra["calibration"]``);
the coordinator turns every member's figure into
``PlanConstraints.block_step_s_by_device`` (:func:`calibrated_constraints`),
and the cost model scales its prediction for that device so that one block
costs what was measured. Blocking (torch): call through ``trio.to_thread``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hetmesh.partition.prefill import MAX_PREFILL_CHUNKS, PREFILL_CHUNK_TOKENS, prefill_chunks
from hetmesh.scheduler.records import Plan, PlanConstraints, Stage, device_key

log = logging.getLogger(__name__)

CALIBRATION_CONTEXT_TOKENS = 128
CALIBRATION_KEY = "calibration"
# a member whose served steps exceed the plan's prediction by more than this many
# times the mesh's most accurate member does is planned on its measurement
# (measured_constraints); 3, not 2: on a shared, loaded machine honest nodes'
# ratios were seen to differ by 2x from one another
MEASURED_FACTOR = 3.0


class _Block:
    """The model's first decoder block (unit 1), loaded as a node would hold it, and the
    clock a calibration reads on its device (see :func:`measure_block_step_s`)."""

    def __init__(
        self, model_dir: Path, device: str, weights: str | None, threads: int | None
    ) -> None:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        from hetmesh.partition.stage import load_stage

        if weights is None:
            self.stage = load_stage(model_dir, 1, 2, device=device)
        else:
            self.stage = load_stage(model_dir, 1, 2, device=device, weights=weights)
        self._generator = torch.Generator().manual_seed(0)
        self.on_cpu = self.stage.device.type == "cpu"
        torch_threads = torch.get_num_threads()
        self._share = cpu_share(torch_threads) if self.on_cpu else 1.0
        # one torch thread computes on this thread: count its CPU time alone, so the
        # node's other threads (link probes, discovery) do not inflate the step
        self._cpu_clock = time.thread_time if torch_threads == 1 else time.process_time

    def states(self, seq: int) -> Any:
        import torch

        hidden = self.stage.hidden_size
        return torch.randn(seq, hidden, generator=self._generator).to(
            self.stage.device, self.stage.dtype
        )

    def synchronise(self) -> None:
        import torch

        if self.stage.device.type == "cuda":
            torch.cuda.synchronize(self.stage.device)

    def now(self) -> tuple[float, float]:
        """(wall, CPU) clocks, to pass to :meth:`since`."""
        return time.perf_counter(), self._cpu_clock()

    def since(self, began: tuple[float, float]) -> float:
        """Seconds of work since ``began``: on a CPU its CPU time ÷ the cores it may use,
        on a GPU wall time (synchronise first)."""
        if self.on_cpu:
            return (self._cpu_clock() - began[1]) / self._share
        return time.perf_counter() - began[0]


def measure_block_step_s(
    model_dir: Path,
    *,
    device: str = "cpu",
    context_tokens: int = CALIBRATION_CONTEXT_TOKENS,
    budget_s: float = 1.2,
    window_s: float = 0.3,
    weights: str | None = None,
    threads: int | None = None,
) -> float:
    """Seconds of one decode step of the model's first decoder block on ``device``.

    On a CPU: the CPU time per step (which other processes sharing the cores
    do not inflate; with one torch thread, that thread's alone) ÷ the cores
    this node's torch threads may use (its threads, capped by the cgroup quota
    and affinity): the sustained
    step time of a node that keeps its cores busy. On a GPU: wall time. The
    mean over a window of ``window_s``, best of the windows in ``budget_s``
    (neighbours only ever slow a window down, as in the profiler). ``weights``:
    the weight format to time the block in (None: the stage loader's default).
    ``threads``: the torch threads the node's stages run with (bound to this
    thread's OpenMP team, as the stage server does; None: leave it).
    """
    block = _Block(model_dir, device, weights, threads)
    stage = block.stage
    context = max(1, min(context_tokens, stage.max_context // 2))  # tiny models: half theirs

    def fresh_cache() -> Any:
        kv = stage.new_kv()
        stage.forward(block.states(context), kv)  # the cache a decode step reads
        return kv

    step = block.states(1)
    kv = fresh_cache()
    try:
        for _ in range(3):  # warm-up
            stage.forward(step, kv)
        block.synchronise()
        best = float("inf")
        deadline = time.perf_counter() + budget_s
        while True:
            kv.free()
            kv = fresh_cache()  # every window decodes at about the same context
            block.synchronise()
            steps = 0
            began = block.now()
            while True:
                stage.forward(step, kv)
                steps += 1
                if steps % 4 == 0:
                    block.synchronise()
                    now = time.perf_counter()
                    if now - began[0] >= window_s or kv.length + 4 >= stage.max_context:
                        break
            best = min(best, block.since(began) / steps)
            if now >= deadline:
                return best
    finally:
        kv.free()


def measure_chunk_cost(
    model_dir: Path,
    *,
    device: str = "cpu",
    weights: str | None = None,
    threads: int | None = None,
    chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    chunks: int = MAX_PREFILL_CHUNKS,
    repeats: int = 3,
) -> float:
    """What a prefill cut into ``chunks`` chunks of ``chunk_tokens`` costs the first
    decoder block on ``device``, as a multiple of the same prefill whole.

    About 1 where the prefill is bound by compute (the chunks do the same
    work); well above where it is bound by streaming the weights, which every
    chunk streams again (see :mod:`hetmesh.partition.prefill`). Times as
    :func:`measure_block_step_s` counts them, the best of ``repeats`` for each
    side. A tiny model prefills half its context.
    """
    block = _Block(model_dir, device, weights, threads)
    stage = block.stage
    total = max(chunks, min(chunk_tokens * chunks, stage.max_context // 2))
    sizes = prefill_chunks(total, total // chunks, chunks)
    inputs = block.states(total)

    def prefill(pieces: list[int]) -> float:
        kv = stage.new_kv()
        try:
            block.synchronise()
            began = block.now()
            for piece in inputs.split(pieces):
                stage.forward(piece, kv)
            block.synchronise()
            return block.since(began)
        finally:
            kv.free()

    prefill(sizes)  # warm-up: first-use costs of both shapes
    prefill([total])
    whole = min(prefill([total]) for _ in range(repeats))
    cut = min(prefill(sizes) for _ in range(repeats))
    return cut / max(whole, 1e-9)


ROW_COST_ROWS = 4  # a decode round of this many sessions against one of a single session
ROW_COST_STEPS = 64  # decode steps a timing takes at most ...
ROW_COST_WINDOW_S = 0.01  # ... once it has run this long (a tiny block's step is ~0.1 ms)


def measure_row_cost(
    model_dir: Path,
    *,
    device: str = "cpu",
    weights: str | None = None,
    threads: int | None = None,
    rows: int = ROW_COST_ROWS,
    context_tokens: int = CALIBRATION_CONTEXT_TOKENS,
    repeats: int = 5,
) -> float:
    """What each further session of a decode round adds on ``device``, as a fraction of
    a one-session step: ``(t(rows) / t(1) - 1) / (rows - 1)``, in [0, 1].

    Timed on the first decoder block as :func:`measure_block_step_s` times it, the
    two round sizes in turn (a neighbour slows both alike), the best of ``repeats``
    each. Near 0 where a step streams the weights once for all its rows (a CPU at
    small batches: ~0.1 for the default model in int4), 1 where every row costs a
    step of its own. The router packs sessions by it (:mod:`hetmesh.scheduler.router`).
    """
    if rows < 2:
        raise ValueError("rows must be at least 2")
    from hetmesh.partition.blocks import blocks_for

    block = _Block(model_dir, device, weights, threads)
    stage = block.stage
    context = max(1, min(context_tokens, stage.max_context // 2))
    most = max(1, min(ROW_COST_STEPS, stage.max_context - context - 1))
    # the sessions share one pool, as a stage server's do (its rounds read them so)
    pool = stage.new_pool(rows * blocks_for(context + most))
    caches = [stage.new_kv(pool) for _ in range(rows)]
    step = block.states(1)
    try:
        for kv in caches:
            stage.forward(block.states(context), kv)

        def timed(n: int) -> float:
            """Seconds of one round of ``n`` sessions, over a window of rounds."""
            batch = [(step, kv) for kv in caches[:n]]
            block.synchronise()
            began = block.now()
            steps = 0
            while steps < most:
                stage.forward_batch(batch)
                steps += 1
                if steps % 4 == 0:
                    block.synchronise()
                    if time.perf_counter() - began[0] >= ROW_COST_WINDOW_S:
                        break
            block.synchronise()
            spent = block.since(began) / steps
            for kv in caches[:n]:
                kv.truncate(context)
            return spent

        timed(1)  # warm-up: first-use costs of both shapes
        timed(rows)
        one, many = float("inf"), float("inf")
        for _ in range(repeats):
            one = min(one, timed(1))
            many = min(many, timed(rows))
    finally:
        for kv in caches:
            kv.free()
    return min(1.0, max(0.0, (many / max(one, 1e-9) - 1.0) / (rows - 1)))


def host_share(threads: int) -> tuple[str, float, float]:
    """(key, cores, share) of the CPU cores this process computes on: the key names this
    machine's boot and the CPUs this process may run on (nodes started on one machine
    with the same affinity announce the same key), ``cores`` how many those are,
    ``share`` how many of them ``threads`` torch threads keep busy (:func:`cpu_share`)."""
    import hashlib
    import os
    import socket

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the host name stands for the machine
        boot = socket.gethostname()
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API: every CPU
        cpus = list(range(os.cpu_count() or 1))
    seen = f"{boot}/{','.join(map(str, cpus))}".encode()
    share = cpu_share(threads)
    return hashlib.sha256(seen).hexdigest()[:32], float(len(cpus)), min(share, len(cpus))


def cpu_share(threads: int) -> float:
    """Cores ``threads`` torch threads can keep busy here: CPU quota and affinity included."""
    import psutil

    from hetmesh.discovery.profiling import effective_cores, read_cgroup_limits

    cores = effective_cores(psutil.cpu_count() or 1, read_cgroup_limits())
    return max(1e-3, min(float(max(1, threads)), cores))


def calibration_extra(
    model_key: str, device: str, block_step_s: float, weights: str = ""
) -> dict[str, Any]:
    """What a node announces: its device's measured block step for ``model_key``,
    in the weight format ``weights`` it serves in (a
    :class:`~hetmesh.scheduler.announcement.Calibration`'s wire map)."""
    from hetmesh.scheduler.announcement import Calibration

    return Calibration(
        model=model_key,
        device=device,
        block_step_s=float(block_step_s),
        context_tokens=CALIBRATION_CONTEXT_TOKENS,
        weights=weights,
    ).to_wire()


def calibrated_constraints(
    constraints: PlanConstraints,
    model_key: str,
    announced: Iterable[tuple[str, Mapping[str, Any]]],
) -> PlanConstraints:
    """``constraints`` with every peer's announced calibration for ``model_key`` filled in.

    ``announced``: (peer id, that peer's announcement ``extra``). Figures for
    another model, measured at another context, or ill-typed are ignored (the
    cost model then falls back to its roofline for that device).
    """
    from hetmesh.scheduler.announcement import read_serving

    measured: dict[str, float] = {}
    for peer_id, extra in announced:
        entry = read_serving(extra, plan_of=None).calibration
        if (
            entry is not None
            and entry.model == model_key
            and entry.context_tokens == constraints.calibration_context_tokens
        ):
            measured[device_key(peer_id, entry.device)] = entry.block_step_s
    if measured == constraints.block_step_s_by_device:
        return constraints
    return dataclasses.replace(constraints, block_step_s_by_device=measured)


def measured_constraints(
    constraints: PlanConstraints,
    plan: Plan | None,
    observed: Mapping[str, Sequence[float]],
    *,
    factor: float = MEASURED_FACTOR,
) -> tuple[PlanConstraints, frozenset[str]]:
    """``constraints`` with each member that serves far slower than it claimed planned
    on what it measured, and the device keys so corrected.

    ``observed``: peer id -> the step times its stage servers report serving ``plan``
    (its announced ``load.recent_step_s``). A peer's ratio is its fastest recent step
    (the one least inflated by batching or a prefill) ÷ the slowest decode step the
    plan predicted for its stages. The mesh's most accurate claim (its lowest ratio,
    at least 1) is the yardstick: a machine that is busy for everyone slows every
    ratio alike and corrects nobody. A peer whose ratio exceeds ``factor`` times the
    yardstick claimed a speed it does not deliver: its devices' block step is scaled
    up by ratio ÷ yardstick (with no calibration announced, set to the measured step
    spread over the units it holds), so the next plan charges it what it costs.
    """
    if plan is None:
        return constraints, frozenset()
    stages_of: dict[str, list[Stage]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            stages_of.setdefault(stage.peer_id, []).append(stage)
    ratios: dict[str, tuple[float, float]] = {}  # peer -> (measured ÷ predicted, measured)
    for peer, stages in stages_of.items():
        samples = [x for x in observed.get(peer, ()) if math.isfinite(x) and 0 < x < 3600]
        predicted = max(s.decode_step_s for s in stages)
        if samples and predicted > 0:
            ratios[peer] = (min(samples) / predicted, min(samples))
    if not ratios:
        return constraints, frozenset()
    yardstick = max(1.0, min(r for r, _ in ratios.values()))
    steps = dict(constraints.block_step_s_by_device)
    corrected: set[str] = set()
    for peer, (ratio, measured) in sorted(ratios.items()):
        if ratio <= factor * yardstick:
            continue
        for stage in stages_of[peer]:
            key = device_key(stage.peer_id, stage.device)
            claimed = constraints.block_step_s_by_device.get(key)
            if claimed is not None:
                fixed = claimed * ratio / yardstick
            else:
                fixed = measured / yardstick / (stage.end - stage.start)
            steps[key] = max(steps.get(key, 0.0), fixed)
            corrected.add(key)
    if not corrected:
        return constraints, frozenset()
    return dataclasses.replace(constraints, block_step_s_by_device=steps), frozenset(corrected)


def stage_overhead_from_tokens(token_s: float, stage_steps_s: Sequence[float]) -> float:
    """Seconds per stage per token that a pipeline spends outside its stages' compute.

    ``token_s``: the measured time per decode token of one stream (the gateway's
    or the client's view); ``stage_steps_s``: each stage's measured decode step
    (its stage server's ``recent_step_s``). What is left of the token after the
    steps is the hops (frame encode, send, the receiver's wake-up and decode),
    the gateway and the stream, spread over the stages — one outgoing message
    each, the last stage's being the token's return — as the cost model's
    ``PlanConstraints.stage_overhead_s`` counts it. Never negative. Raises
    ``ValueError`` for no stages or a non-positive time.
    """
    if not stage_steps_s:
        raise ValueError("a pipeline has at least one stage")
    if not token_s > 0 or any(not s > 0 for s in stage_steps_s):
        raise ValueError("measured times must be positive")
    return max(0.0, token_s - sum(stage_steps_s)) / len(stage_steps_s)


__all__ = [
    "CALIBRATION_CONTEXT_TOKENS",
    "CALIBRATION_KEY",
    "MEASURED_FACTOR",
    "calibrated_constraints",
    "calibration_extra",
    "cpu_share",
    "host_share",
    "measure_block_step_s",
    "measure_chunk_cost",
    "measure_row_cost",
    "measured_constraints",
    "stage_overhead_from_tokens",
]
