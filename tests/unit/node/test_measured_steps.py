"""Claims against measurement: a member far slower than it claimed is planned on what it serves."""

from __future__ import annotations

import math

from hetmesh.node.calibration import measured_constraints
from hetmesh.resources import LinkProfile
from hetmesh.scheduler import PlanConstraints, evaluate, plan
from hetmesh.scheduler.records import Plan, device_key
from tests.unit.scheduler.sched_helpers import cpu_device, toy_cpu_model

GIB = 1024**3
MODEL = toy_cpu_model(8)
UNITS = MODEL.num_units
PEERS = ("a", "b")
DEVICES = tuple(cpu_device(p) for p in PEERS)
LINKS = tuple(
    LinkProfile(src=x, dst=y, rtt_s=1e-4, bandwidth_bps=1e9) for x in PEERS for y in PEERS if x != y
)
CLAIMED = PlanConstraints(
    max_context_tokens=128,
    reserve_bytes=0,
    reserve_fraction=0.0,
    # b claims blocks ten times faster than a's
    block_step_s_by_device={device_key("a", "cpu"): 1e-3, device_key("b", "cpu"): 1e-4},
)
HALF = UNITS // 2


def split(constraints: PlanConstraints) -> Plan:
    found = evaluate(
        [[("a", "cpu", 0, HALF), ("b", "cpu", HALF, UNITS)]],
        DEVICES,
        LINKS,
        MODEL,
        constraints=constraints,
    )
    assert found is not None
    return found


PLAN = split(CLAIMED)
PREDICTED = {s.peer_id: s.decode_step_s for s in PLAN.pipelines[0].stages}


def served(**ratio: float) -> dict[str, list[float]]:
    """Recent steps of each peer, ``ratio`` times its predicted step (the fastest of them)."""
    return {p: [PREDICTED[p] * r, PREDICTED[p] * r * 3] for p, r in ratio.items()}


def test_a_member_far_slower_than_claimed_is_planned_on_its_measurement() -> None:
    # b really serves twenty times slower than it claimed
    fixed, corrected = measured_constraints(CLAIMED, PLAN, served(a=1.1, b=20.0))
    assert corrected == {device_key("b", "cpu")}
    b, a = device_key("b", "cpu"), device_key("a", "cpu")
    assert math.isclose(fixed.block_step_s_by_device[b], 1e-4 * 20.0 / 1.1)
    assert fixed.block_step_s_by_device[a] == 1e-3  # the honest one keeps its figure
    # re-scored on the measurement, the pipeline is as slow as b really is
    assert split(fixed).decode_latency_s > PLAN.decode_latency_s
    # and a fresh plan gives b fewer units than the claim did
    units_of_b = [
        sum(s.end - s.start for p in chosen.pipelines for s in p.stages if s.peer_id == "b")
        for chosen in (
            plan(DEVICES, LINKS, MODEL, constraints=CLAIMED),
            plan(DEVICES, LINKS, MODEL, constraints=fixed),
        )
    ]
    assert units_of_b[0] > 0  # the claim attracted units
    assert units_of_b[1] < units_of_b[0], units_of_b


def test_uncalibrated_member_gets_its_measured_step_per_unit() -> None:
    bare = PlanConstraints(max_context_tokens=128, reserve_bytes=0, reserve_fraction=0.0)
    chosen = split(bare)
    steps = {s.peer_id: s.decode_step_s for s in chosen.pipelines[0].stages}
    observed = {"a": [steps["a"]], "b": [steps["b"] * 10]}
    fixed, corrected = measured_constraints(bare, chosen, observed)
    assert corrected == {device_key("b", "cpu")}
    held = UNITS - HALF
    assert math.isclose(
        fixed.block_step_s_by_device[device_key("b", "cpu")], steps["b"] * 10 / held
    )


def test_no_correction_when_it_cannot_be_told_apart_from_load() -> None:
    cases = [
        served(a=1.5, b=4.0),  # within the factor (3) of the best ratio
        served(a=6.0, b=7.0),  # a machine busy for everyone: every ratio alike
        served(b=9.0),  # nobody to compare with (a served nothing)
        {"a": [PREDICTED["a"]], "b": [math.nan, math.inf, -1.0, 0.0]},  # no usable sample
        {},
    ]
    for observed in cases:
        assert measured_constraints(CLAIMED, PLAN, observed) == (CLAIMED, frozenset()), observed
    assert measured_constraints(CLAIMED, None, served(a=1.0, b=9.0)) == (CLAIMED, frozenset())
