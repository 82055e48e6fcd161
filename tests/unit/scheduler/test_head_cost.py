"""A quantised head costs its FLOPs at the calibrated block's rate (issue 42, item 3).

The default model's int8 head ran 7.4 blocks' time on a CPU (its FLOPs are 8
blocks'), while the roofline scaled by the calibrated block put it at ~4 blocks
wherever the bandwidth measured high (it keeps the roofline's proportions): the
balanced cut then gave the head's stage as many blocks as the others, and it
bounded concurrent streams. Pure cost-model arithmetic, against hand-computed
figures.
"""

from __future__ import annotations

import dataclasses

import pytest

from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.scheduler import PlanConstraints, plan
from hetmesh.scheduler.caps import stage_cap_bytes
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.records import WeightBytes, device_key
from tests.unit.scheduler.sched_helpers import device

MIB = 1 << 20
SHAPE = KNOWN_SHAPES["smollm2-135m"]
INT4 = model_profile(SHAPE, weights="int4", name="smollm2")
BLOCK_S = 1.04e-3  # one int4 block's decode step, as measured on the project's CPU


def constraints(peers: list[str], weights: WeightBytes, block_s: float | None) -> PlanConstraints:
    return PlanConstraints(
        max_context_tokens=1024,
        max_sessions=8,
        reserve_bytes=64 * MIB,
        weights_by_device={device_key(p, "cpu"): weights for p in peers},
        block_step_s_by_device={device_key(p, "cpu"): block_s for p in peers if block_s},
    )


def head_and_block(bandwidth: float, block_s: float | None, weights: str = "int4"):
    profile = model_profile(SHAPE, weights=weights, name="smollm2")
    cons = constraints(["p"], WeightBytes.of(profile, weights), block_s)
    cost = CostModel(
        profile, [device("p", flops=1.6e11, bandwidth=bandwidth, backend="cpu")], [], cons
    )
    n = cost.n
    overhead = cons.stage_overhead_s
    return cost, cost.step_s(0, n - 1, n) - overhead, cost.step_s(0, 5, 6) - overhead


@pytest.mark.parametrize("bandwidth", [2e10, 4e10])
def test_a_calibrated_int8_head_costs_its_flops_at_the_blocks_rate(bandwidth: float) -> None:
    cost, head, _block = head_and_block(bandwidth, BLOCK_S)
    units = INT4.units
    block = next(u for u in units if u.kind == "block")
    c = float(cost.constraints.calibration_context_tokens)
    block_flops = block.flops_per_token + c * block.attention_flops_per_token_per_context
    overhead = cost.constraints.unit_overhead_for("p", "cpu", "cpu")
    rate = (BLOCK_S - overhead) / block_flops
    # its FLOPs at the measured block's rate, plus its own dispatch overhead
    expected = units[-1].flops_per_token * rate + overhead * cost.calibration_scale(0)
    assert head == pytest.approx(expected, rel=1e-9)
    assert head > 6 * BLOCK_S  # ~7 blocks, where the scaled roofline said ~4-5
    assert cost.head_extra_s(0) > 0


def test_the_roofline_stands_where_it_is_the_larger_or_nothing_was_measured() -> None:
    cost, head, block = head_and_block(5.5e9, BLOCK_S)  # bandwidth-bound: 7.7 blocks
    assert cost.head_extra_s(0) == 0.0
    assert head / block > 7
    cost, head, block = head_and_block(4e10, None)  # uncalibrated: the roofline alone
    assert cost.head_extra_s(0) == 0.0
    cost, _, _ = head_and_block(1e10, 1.2e-3, weights="float32")  # a float32 head reads
    assert cost.head_extra_s(0) == 0.0  # 113 MB: memory binds, not its arithmetic


def test_a_balanced_cut_of_three_equal_cpus_gives_the_head_stage_the_fewest_blocks() -> None:
    peers = ["a", "b", "c"]
    weights = WeightBytes.of(INT4, "int4")
    base = constraints(peers, weights, None)
    cap = stage_cap_bytes(INT4, weights, base, 3)
    devices = [device(p, memory=cap, flops=1.6e11, bandwidth=4e10, backend="cpu") for p in peers]
    cons = constraints(peers, weights, BLOCK_S)
    (pipeline,) = plan(devices, [], INT4, constraints=cons).pipelines
    assert len(pipeline.stages) == 3
    blocks = [s.end - s.start for s in pipeline.stages]
    # the head weighs ~7 blocks: its stage holds ~7 fewer than the others
    assert blocks[2] <= min(blocks[:2]) - 5, blocks
    steps = [s.decode_step_s for s in pipeline.stages]
    assert max(steps) <= 1.15 * min(steps), steps
    uncalibrated = plan(
        devices, [], INT4, constraints=dataclasses.replace(cons, block_step_s_by_device={})
    )
    assert (
        uncalibrated.pipelines[0].stages[2].end - uncalibrated.pipelines[0].stages[2].start
        > blocks[2]
    )
