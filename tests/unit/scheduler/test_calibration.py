"""Measured block step times calibrate the cost model per device."""

from __future__ import annotations

import dataclasses

import pytest

from hetmesh.node.calibration import calibrated_constraints, calibration_extra
from hetmesh.scheduler import plan
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.records import PlanConstraints
from tests.unit.scheduler.sched_helpers import BARE, device, full_links, toy_model


def _one_block(cost: CostModel, dev: int) -> float:
    first = next(i for i, u in enumerate(cost.model.units) if u.kind == "block")
    return cost.step_s(dev, first, first + 1) - cost.constraints.stage_overhead_s


def test_calibration_makes_one_block_cost_what_was_measured() -> None:
    model = toy_model()
    devices = [device("a", backend="cpu"), device("b", backend="cpu")]
    c = dataclasses.replace(
        BARE,
        decode_context_tokens=BARE.calibration_context_tokens,
        block_step_s_by_device={"a/cpu": 4e-3},
    )
    cost = CostModel(model, devices, full_links(devices), c)
    assert _one_block(cost, 0) == pytest.approx(4e-3)
    assert cost.calibration_scale(1) == 1.0  # b measured nothing: the roofline
    roofline = CostModel(model, devices, full_links(devices), BARE)
    whole = model.num_units
    assert cost.step_s(0, 0, whole) == pytest.approx(
        cost.calibration_scale(0) * roofline.step_s(0, 0, whole), rel=0.05
    )


def test_calibration_moves_units_away_from_the_slow_measured_device() -> None:
    model = toy_model(layers=12)
    devices = [device("a", memory=2**30), device("b", memory=2**30)]
    links = full_links(devices, bandwidth=1e12, rtt=0.0)
    tight = dataclasses.replace(BARE, max_context_tokens=64)
    # memory for about two thirds of the model each: both are needed
    share = int(model.total_param_bytes * 0.7)
    small = [
        dataclasses.replace(d, memory_free_bytes=share, memory_total_bytes=share) for d in devices
    ]

    def units_of_b(slow: str) -> int:
        measured = dataclasses.replace(tight, block_step_s_by_device={f"{slow}/cuda:0": 1.0})
        chosen = plan(small, links, model, constraints=measured)
        assert chosen.decode_latency_s > 1.0  # the measured second per block shows
        return sum(s.end - s.start for s in chosen.pipelines[0].stages if s.peer_id == "b")

    assert units_of_b(slow="b") < units_of_b(slow="a")


def test_calibrated_constraints_reads_only_matching_announcements() -> None:
    base = PlanConstraints()
    announced = [
        ("p1", {"calibration": calibration_extra("m", "cpu", 2e-3)}),
        ("p2", {"calibration": calibration_extra("other-model", "cpu", 9e-3)}),
        ("p3", {"calibration": {"model": "m", "device": "cpu", "block_step_s": "fast"}}),
        ("p4", {}),
        ("p5", {"calibration": {**calibration_extra("m", "cpu", 5e-3), "context_tokens": 7}}),
    ]
    out = calibrated_constraints(base, "m", announced)
    assert out.block_step_s_by_device == {"p1/cpu": 2e-3}
    assert calibrated_constraints(out, "m", announced) is out
    assert PlanConstraints.from_wire(out.to_wire()) == out


def test_calibration_rejects_non_positive_times() -> None:
    with pytest.raises(ValueError, match="positive"):
        PlanConstraints(block_step_s_by_device={"p/cpu": 0.0})


def test_a_claimed_speed_is_planned_on_what_was_measured() -> None:
    from hetmesh.resources import MAX_BANDWIDTH_BPS, MAX_FLOPS

    model = toy_model()
    # b claims the fastest device the wire admits; its measured block is 50 ms
    devices = [device("a"), device("b", flops=MAX_FLOPS, bandwidth=MAX_BANDWIDTH_BPS)]
    measured = dataclasses.replace(
        BARE,
        decode_context_tokens=BARE.calibration_context_tokens,
        block_step_s_by_device={"a/cuda:0": 1e-3, "b/cuda:0": 5e-2},
    )
    cost = CostModel(model, devices, full_links(devices), measured)
    assert _one_block(cost, 1) == pytest.approx(5e-2)
    chosen = plan(devices, full_links(devices), model, constraints=measured)
    assert {s.peer_id for s in chosen.pipelines[0].stages} == {"a"}  # not the claimed-fast one
