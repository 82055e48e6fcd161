"""Each device's weight format: the planner charges its real bytes per unit."""

from __future__ import annotations

import dataclasses

import pytest

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import ModelProfile
from hetmesh.scheduler import Plan, PlanConstraints, evaluate, plan
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.records import WeightBytes
from tests.unit.scheduler.sched_helpers import BARE, GIB, device, full_links, toy_model


def _compact(model: ModelProfile, name: str, divisor: int) -> WeightBytes:
    """``model``'s bytes with weights ``divisor`` times smaller, KV unchanged."""
    full = WeightBytes.of(model)
    return WeightBytes(
        weights=name,
        param_bytes=tuple(b // divisor for b in full.param_bytes),
        kv_bytes_per_token=full.kv_bytes_per_token,
        tied_bytes=full.tied_bytes // divisor,
    )


def _with(constraints: PlanConstraints, **by_device: WeightBytes) -> PlanConstraints:
    return dataclasses.replace(
        constraints, weights_by_device={f"{k}/cuda:0": v for k, v in by_device.items()}
    )


def test_weight_bytes_of_a_profile_counts_the_tied_matrix_once() -> None:
    model = toy_model()
    wb = WeightBytes.of(model)
    assert wb.weights == model.dtype
    assert sum(wb.param_bytes) - wb.tied_bytes == model.total_param_bytes
    assert wb.kv_bytes_per_token == tuple(u.kv_bytes_per_token for u in model.units)


def test_weight_bytes_refuse_inconsistent_figures() -> None:
    with pytest.raises(ValueError, match="same units"):
        WeightBytes(weights="int8", param_bytes=(1, 2), kv_bytes_per_token=(0,))
    with pytest.raises(ValueError, match="non-negative"):
        WeightBytes(weights="int8", param_bytes=(-1,), kv_bytes_per_token=(0,))


def test_a_model_that_fits_only_in_a_compact_format_is_placed_in_it() -> None:
    model = toy_model(layers=8)
    whole = CostModel(model, [device("a")], [], BARE).model_bytes()
    # three devices that together hold 80 % of the model in its own format
    each = int(whole * 0.8 / 3)
    devices = [device(p, memory=each) for p in ("a", "b", "c")]
    links = full_links(devices)
    with pytest.raises(InsufficientCapacity):
        plan(devices, links, model, constraints=BARE)
    int8 = _compact(model, "int8", 2)
    chosen = plan(devices, links, model, constraints=_with(BARE, a=int8, b=int8, c=int8))
    stages = [s for p in chosen.pipelines for s in p.stages]
    assert {s.weights for s in stages} == {"int8"}
    assert all(s.memory_bytes <= each for s in stages)


def test_a_mixed_mesh_charges_each_device_its_own_bytes() -> None:
    model = toy_model(layers=8)
    devices = [device("a", memory=64 * GIB), device("b", memory=64 * GIB)]
    int4 = _compact(model, "int4", 4)
    cons = _with(BARE, b=int4)
    cost = CostModel(model, devices, full_links(devices), cons)
    plain = CostModel(model, devices, full_links(devices), BARE)
    assert cost.weights(0) == model.dtype
    assert cost.weights(1) == "int4"
    for start, end in ((0, 1), (1, 5), (5, model.num_units)):
        assert cost.stage_memory_bytes(0, start, end) == plain.stage_memory_bytes(0, start, end)
        saved = sum(model.units[i].param_bytes - int4.param_bytes[i] for i in range(start, end))
        assert plain.stage_memory_bytes(1, start, end) - cost.stage_memory_bytes(
            1, start, end
        ) == pytest.approx(saved, abs=1)
    # a decode step reads fewer bytes: on a bandwidth-bound device it is faster
    slow_memory = [device("a", bandwidth=1e9), device("b", bandwidth=1e9)]
    cost = CostModel(model, slow_memory, [], cons)
    assert cost.step_s(1, 1, 5) < cost.step_s(0, 1, 5)


def test_the_plan_says_which_format_each_stage_holds_and_survives_the_wire() -> None:
    model = toy_model(layers=8)
    whole = CostModel(model, [device("a")], [], BARE).model_bytes()
    # a alone holds the model in bf16-like halves, not in full: both must serve
    devices = [device("a", memory=int(whole * 0.45)), device("b", memory=int(whole * 0.7))]
    cons = _with(BARE, a=_compact(model, "int8", 2))
    chosen = plan(devices, full_links(devices), model, constraints=cons)
    by_peer = {s.peer_id: s.weights for p in chosen.pipelines for s in p.stages}
    assert by_peer == {"a": "int8", "b": model.dtype}
    again = Plan.from_wire(chosen.to_wire())
    assert again == chosen
    rescored = evaluate(
        [[(s.peer_id, s.device, s.start, s.end) for s in p.stages] for p in chosen.pipelines],
        devices,
        full_links(devices),
        model,
        constraints=cons,
    )
    assert rescored is not None
    assert rescored.pipelines == chosen.pipelines


def test_bytes_for_another_model_are_refused() -> None:
    model = toy_model(layers=8)
    other = _compact(toy_model(layers=4), "int8", 2)
    with pytest.raises(ValueError, match="units"):
        CostModel(model, [device("a")], [], _with(BARE, a=other))


def test_calibration_is_judged_against_the_format_it_was_timed_in() -> None:
    model = toy_model()
    devices = [device("a", backend="cpu")]
    first = next(i for i, u in enumerate(model.units) if u.kind == "block")
    measured = {"a/cpu": 4e-3}
    base = dataclasses.replace(
        BARE, decode_context_tokens=BARE.calibration_context_tokens, block_step_s_by_device=measured
    )
    compact = dataclasses.replace(base, weights_by_device={"a/cpu": _compact(model, "int8", 2)})
    for cons in (base, compact):
        cost = CostModel(model, devices, [], cons)
        assert cost.step_s(0, first, first + 1) == pytest.approx(4e-3)
