"""Balanced cuts, the memory caps that force a cut, and the head's logits workspace.

A single stream's latency is the sum of its stages' steps, so on equal devices
every cut costs it about the same; the planner then keeps, among the cuts
within ``SearchOptions.balance_tolerance`` of the fastest, the one whose
slowest stage is fastest (what bounds concurrent streams and a pipelined
prefill). Checked against brute force over every cut of the planned devices.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hetmesh.errors import InsufficientCapacity
from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.scheduler import PlanConstraints, SearchOptions, plan
from hetmesh.scheduler.caps import min_max_stage_bytes, stage_cap_bytes
from hetmesh.scheduler.cost import Assignment, CostModel, head_workspace_bytes
from hetmesh.scheduler.records import WeightBytes
from tests.unit.scheduler.sched_helpers import device, toy_model

MIB = 1 << 20
SMOL = model_profile(KNOWN_SHAPES["smollm2-135m"], name="smollm2")
CONS = PlanConstraints(max_context_tokens=1024, max_sessions=8, reserve_bytes=64 * MIB)


def cpus(memory: int, *bandwidths: float) -> list:
    return [
        device(f"p{i}", memory=memory, flops=1e11, bandwidth=bw, backend="cpu")
        for i, bw in enumerate(bandwidths)
    ]


def cuts(n: int, k: int) -> list[tuple[int, ...]]:
    """Every cut of ``n`` units into ``k`` non-empty contiguous stages (their ends)."""
    return [(*inner, n) for inner in itertools.combinations(range(1, n), k - 1)]


def scored(cost: CostModel, order: list[int], ends: tuple[int, ...]) -> tuple[float, float] | None:
    """(latency, slowest stage step) of a cut of ``order``; None if a stage does not fit."""
    starts = (0, *ends[:-1])
    stages = [Assignment(d, a, b) for d, a, b in zip(order, starts, ends, strict=True)]
    if not cost.feasible(stages):
        return None
    p = cost.pipeline(stages)
    return p.decode_latency_s, max(s.batch_step_s for s in p.stages)


@pytest.mark.parametrize(
    "bandwidths",
    [(1e10, 1e10, 1e10), (2e10, 1e10, 1e10), (1e10, 1.5e10, 3e10), (1e10, 1.05e10, 0.98e10)],
    ids=["equal", "one-twice-as-fast", "1-1.5-3", "measured-noise"],
)
def test_the_cut_has_the_fastest_slowest_stage_within_the_tolerance(bandwidths) -> None:
    cap = stage_cap_bytes(SMOL, WeightBytes.of(SMOL), CONS, 3)
    devices = cpus(cap, *bandwidths)
    got = plan(devices, [], SMOL, constraints=CONS)
    (pipeline,) = got.pipelines
    assert len(pipeline.stages) == 3  # the caps force three stages
    cost = CostModel(SMOL, devices, [], CONS)
    index = {d.peer_id: i for i, d in enumerate(cost.devices)}
    order = [index[s.peer_id] for s in pipeline.stages]
    unbalanced = plan(
        devices, [], SMOL, constraints=CONS, options=SearchOptions(balance_tolerance=-1)
    )
    limit = unbalanced.decode_latency_s * (1 + SearchOptions().balance_tolerance) + 1e-12
    near = [s for ends in cuts(SMOL.num_units, 3) if (s := scored(cost, order, ends)) is not None]
    best_bottleneck = min(bottleneck for latency, bottleneck in near if latency <= limit)
    ours = max(s.batch_step_s for s in pipeline.stages)
    assert ours == pytest.approx(best_bottleneck, rel=1e-9)
    assert pipeline.decode_latency_s <= limit
    assert unbalanced.decode_latency_s == pytest.approx(
        min(latency for latency, _ in near), rel=1e-9
    )  # the fastest cut of these devices in this order


def test_three_equal_nodes_get_stages_of_equal_speed_not_7_16_9() -> None:
    cap = stage_cap_bytes(SMOL, WeightBytes.of(SMOL), CONS, 3)
    (pipeline,) = plan(cpus(cap, 1e10, 1e10, 1e10), [], SMOL, constraints=CONS).pipelines
    steps = [s.decode_step_s for s in pipeline.stages]
    assert max(steps) <= 1.1 * min(steps)
    # the head weighs as many blocks as it reads: the last stage holds fewer blocks
    blocks = [s.end - s.start for s in pipeline.stages]
    assert blocks[2] < min(blocks[0], blocks[1])


def test_units_follow_speed_as_far_as_memory_allows() -> None:
    # four times faster, it would take about two thirds of the model by speed; its
    # memory holds about a third: it is filled, and still has the quickest stage
    cap = stage_cap_bytes(SMOL, WeightBytes.of(SMOL), CONS, 3)
    devices = [
        device("fast", memory=cap, flops=1e11, bandwidth=4e10, backend="cpu"),
        device("slow1", memory=cap, flops=1e11, bandwidth=1e10, backend="cpu"),
        device("slow2", memory=cap, flops=1e11, bandwidth=1e10, backend="cpu"),
    ]
    (pipeline,) = plan(devices, [], SMOL, constraints=CONS).pipelines
    by_peer = {s.peer_id: s for s in pipeline.stages}
    fast = by_peer["fast"]
    assert fast.memory_bytes <= cap
    grown = CostModel(SMOL, devices, [], CONS)
    index = {d.peer_id: i for i, d in enumerate(grown.devices)}
    # one more unit at either end would not fit
    if fast.start > 0:
        assert not grown.fits(index["fast"], fast.start - 1, fast.end)
    if fast.end < SMOL.num_units:
        assert not grown.fits(index["fast"], fast.start, fast.end + 1)
    assert fast.decode_step_s < min(by_peer[p].decode_step_s for p in ("slow1", "slow2"))
    slow = [by_peer[p].decode_step_s for p in ("slow1", "slow2")]
    assert max(slow) <= 1.1 * min(slow)  # the slow pair share the rest evenly


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stage_caps_make_the_model_need_exactly_k_stages(stages) -> None:
    weights = WeightBytes.of(SMOL)
    cap = stage_cap_bytes(SMOL, weights, CONS, stages)
    got = plan(cpus(cap, *[1e10] * stages), [], SMOL, constraints=CONS)
    assert [len(p.stages) for p in got.pipelines] == [stages]
    if stages > 1:
        with pytest.raises(InsufficientCapacity):
            plan(cpus(cap, *[1e10] * (stages - 1)), [], SMOL, constraints=CONS)


def test_stage_caps_refuse_what_memory_cannot_force() -> None:
    tiny = toy_model(2)  # 4 units: a head as large as the rest, five stages impossible
    with pytest.raises(ValueError, match="stages of a model of 4 units"):
        stage_cap_bytes(tiny, WeightBytes.of(tiny), CONS, 5)
    resident = [[0, 5, 10], [0, 0, 5], [0, 0, 0]]
    assert min_max_stage_bytes(resident, 1) == 10
    assert min_max_stage_bytes(resident, 2) == 5


@pytest.mark.parametrize(
    ("vocab", "sessions", "chunk"),
    [(4096, 1, 512), (4096, 8, 512), (32000, 8, 512), (32000, 8, 64), (128256, 4, 2048)],
)
def test_the_head_workspace_is_vocabulary_by_sampled_rows_by_float32(vocab, sessions, chunk):
    m = toy_model(2, vocab=vocab)
    cons = PlanConstraints(
        max_context_tokens=256,
        max_sessions=sessions,
        prefill_chunk_tokens=chunk,
        reserve_bytes=0,
        reserve_fraction=0.0,
    )
    assert head_workspace_bytes(vocab, cons) == vocab * sessions * 4
    cost = CostModel(m, [device("a", memory=1 << 40)], [], cons)
    n = m.num_units
    head = m.units[-1]
    block_work = chunk * 8 * m.units[1].input_bytes_per_token  # a block's prefill scratch
    assert cost.stage_memory_bytes(0, n - 1, n) == head.param_bytes + vocab * sessions * 4
    with_block = cost.stage_memory_bytes(0, n - 2, n)
    block = m.units[-2]
    assert with_block == (
        head.param_bytes
        + block.param_bytes
        + 256 * sessions * block.kv_bytes_per_token
        + block_work
        + vocab * sessions * 4
    )
    # a bigger prefill chunk grows the blocks' scratch only, never the logits
    wider = CostModel(
        m,
        [device("a", memory=1 << 40)],
        [],
        dataclasses.replace(cons, prefill_chunk_tokens=chunk * 2),
    )
    assert wider.stage_memory_bytes(0, n - 1, n) == cost.stage_memory_bytes(0, n - 1, n)
