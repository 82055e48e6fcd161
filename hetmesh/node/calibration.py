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

from hetmesh.scheduler.records import Plan, PlanConstraints, Stage, device_key

log = logging.getLogger(__name__)

CALIBRATION_CONTEXT_TOKENS = 128
CALIBRATION_KEY = "calibration"
# a member whose served steps exceed the plan's prediction by more than this many
# times the mesh's most accurate member does is planned on its measurement
# (measured_constraints); 3, not 2: on a shared, loaded machine honest nodes'
# ratios were seen to differ by 2x from one another
MEASURED_FACTOR = 3.0


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
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from hetmesh.partition.stage import load_stage

    # unit 1: the first block, held as the node would hold it
    if weights is None:
        stage = load_stage(model_dir, 1, 2, device=device)
    else:
        stage = load_stage(model_dir, 1, 2, device=device, weights=weights)
    generator = torch.Generator().manual_seed(0)
    hidden = stage.hidden_size

    def states(seq: int) -> torch.Tensor:
        return torch.randn(seq, hidden, generator=generator).to(stage.device, stage.dtype)

    def synchronise() -> None:
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)

    context = max(1, min(context_tokens, stage.max_context // 2))  # tiny models: half theirs

    def fresh_cache() -> Any:
        kv = stage.new_kv()
        stage.forward(states(context), kv)  # the cache a decode step reads
        return kv

    on_cpu = stage.device.type == "cpu"
    threads = torch.get_num_threads()
    share = cpu_share(threads) if on_cpu else 1.0
    # one torch thread computes on this thread: count its CPU time alone, so the
    # node's other threads (link probes, discovery) do not inflate the step
    cpu_clock = time.thread_time if threads == 1 else time.process_time
    step = states(1)
    kv = fresh_cache()
    try:
        for _ in range(3):  # warm-up
            stage.forward(step, kv)
        synchronise()
        best = float("inf")
        deadline = time.perf_counter() + budget_s
        while True:
            kv.free()
            kv = fresh_cache()  # every window decodes at about the same context
            synchronise()
            steps = 0
            began, cpu_began = time.perf_counter(), cpu_clock()
            while True:
                stage.forward(step, kv)
                steps += 1
                if steps % 4 == 0:
                    synchronise()
                    now = time.perf_counter()
                    if now - began >= window_s or kv.length + 4 >= stage.max_context:
                        break
            if on_cpu:
                best = min(best, (cpu_clock() - cpu_began) / steps / share)
            else:
                best = min(best, (now - began) / steps)
            if now >= deadline:
                return best
    finally:
        kv.free()


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
    "measure_block_step_s",
    "measured_constraints",
    "stage_overhead_from_tokens",
]
