"""A CPU quota under one core: sustained steps alone, bursts at a whole core in a cut."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hetmesh.resources import LinkProfile
from hetmesh.scheduler import plan
from hetmesh.scheduler.announcement import Host, quota_constraints
from hetmesh.scheduler.cost import Assignment, CostModel
from hetmesh.scheduler.records import PlanConstraints
from tests.unit.scheduler.sched_helpers import BARE, cpu_device, full_links, toy_cpu_model

OVERHEAD = 4e-3
BASE = dataclasses.replace(BARE, stage_overhead_s=OVERHEAD, feed_steps=16)
MODEL = toy_cpu_model(layers=6)  # 8 units: embed, 6 blocks, head
N = MODEL.num_units
DEVICES = [cpu_device("a"), cpu_device("b")]  # sorted: a is 0, b is 1
LINKS = full_links(DEVICES)


def _cost(shares: dict[str, float]) -> CostModel:
    constraints = dataclasses.replace(BASE, cpu_share_by_device=shares)
    return CostModel(MODEL, DEVICES, LINKS, constraints)


def _compute(cost: CostModel, dev: int, start: int, end: int) -> float:
    """The sustained step without its per-stage overhead."""
    return cost.step_s(dev, start, end) - cost.stage_overhead_s(start, end)


CUTS = [
    # (b's share, the stages as (device, start, end))
    (1.0, [(1, 0, N)]),
    (0.5, [(1, 0, N)]),
    (0.25, [(1, 0, N)]),
    (1.0, [(1, 0, 3), (0, 3, N)]),
    (0.5, [(1, 0, 3), (0, 3, N)]),
    (0.5, [(0, 0, 3), (1, 3, N)]),
    (0.25, [(1, 0, 4), (0, 4, N)]),
    (0.1, [(0, 0, 2), (1, 2, N)]),
]


@pytest.mark.parametrize(("share", "stages"), CUTS)
def test_decode_latency_is_the_bursts_in_sequence_or_the_slowest_sustained_step(
    share: float, stages: list[tuple[int, int, int]]
) -> None:
    cost = _cost({"b/cpu": share} if share < 1 else {})
    plain = _cost({})
    assignment = [Assignment(d, a, b) for d, a, b in stages]
    got = cost.pipeline(assignment)
    links = sum(s.link_out_s for s in plain.pipeline(assignment).stages)
    shares = (1.0, share)
    bursts = [
        shares[d] * _compute(cost, d, a, b) + cost.stage_overhead_s(a, b) for d, a, b in stages
    ]
    sustained = max(cost.step_s(d, a, b) for d, a, b in stages)
    assert got.decode_latency_s == pytest.approx(max(sum(bursts) + links, sustained))
    assert [s.decode_step_s for s in got.stages] == pytest.approx(bursts)
    # what a busy stage costs stays the sustained step: throughput is unchanged
    assert got.bottleneck_s == pytest.approx(plain.pipeline(assignment).bottleneck_s)
    assert got.decode_latency_s <= plain.pipeline(assignment).decode_latency_s + 1e-12


@pytest.mark.parametrize("share", [0.5, 0.25, 0.1])
def test_a_stage_alone_on_a_quota_is_predicted_as_before(share: float) -> None:
    whole = [Assignment(1, 0, N)]
    before = _cost({}).pipeline(whole)
    after = _cost({"b/cpu": share}).pipeline(whole)
    assert after.decode_latency_s == pytest.approx(before.decode_latency_s)


def test_a_quota_device_idle_most_of_a_cut_runs_its_stage_at_a_whole_core() -> None:
    """b holds a small first stage at half a core: its step is half its sustained one,
    and the token is the two stages' bursts in sequence."""
    cut = [Assignment(1, 0, 2), Assignment(0, 2, N)]
    half = _cost({"b/cpu": 0.5})
    sustained_b = _compute(half, 1, 0, 2)
    got = half.pipeline(cut)
    assert got.stages[0].decode_step_s == pytest.approx(sustained_b / 2 + OVERHEAD)
    assert got.decode_latency_s < _cost({}).pipeline(cut).decode_latency_s
    assert half.burst_step_s(0, 2, N) == pytest.approx(half.step_s(0, 2, N))  # a: no quota


def test_the_planner_carries_the_shares_into_the_plan_and_its_predictions() -> None:
    constraints = dataclasses.replace(BASE, cpu_share_by_device={"b/cpu": 0.5})
    found = plan(DEVICES, LINKS, MODEL, objective="latency", constraints=constraints)
    assert found.constraints.cpu_share_by_device == {"b/cpu": 0.5}
    again = type(found.constraints).from_wire(found.constraints.to_wire())
    assert again.cpu_share_by_device == {"b/cpu": 0.5}
    pipeline = found.pipelines[0]
    cost = CostModel(MODEL, DEVICES, LINKS, constraints)
    index = {d.peer_id: i for i, d in enumerate(cost.devices)}
    assignment = [Assignment(index[s.peer_id], s.start, s.end) for s in pipeline.stages]
    assert pipeline.decode_latency_s == pytest.approx(cost.pipeline(assignment).decode_latency_s)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, math.nan])
def test_a_share_outside_zero_to_one_core_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="CPU share"):
        PlanConstraints(cpu_share_by_device={"b/cpu": share})


def _host(share: float, cores: float = 2.0) -> dict[str, object]:
    return {"host": Host(key="k", cores=cores, share=share).to_wire()}


@pytest.mark.parametrize(
    ("announced", "expected"),
    [
        ([("a", _host(1.0)), ("b", _host(0.5))], {"b/cpu": 0.5}),
        ([("a", _host(2.0)), ("c", _host(0.25))], {"c/cpu": 0.25}),
        ([("a", {}), ("b", _host(1.0))], {}),
        ([("b", {"host": {"key": "k", "cores": 2.0, "share": 0.0}})], {}),  # ill-formed
        ([("b", {"host": "half a core"})], {}),
        ([("b", _host(0.5, cores=0.5)), ("c", _host(0.75))], {"b/cpu": 0.5, "c/cpu": 0.75}),
    ],
)
def test_quota_constraints_reads_each_peers_announced_host(
    announced: list[tuple[str, dict[str, object]]], expected: dict[str, float]
) -> None:
    out = quota_constraints(BASE, announced)
    assert out.cpu_share_by_device == expected
    if not expected:
        assert out is BASE


def _link(src: str, dst: str, rtt: float, bandwidth: float = 1.25e9) -> LinkProfile:
    return LinkProfile(src=src, dst=dst, rtt_s=rtt, bandwidth_bps=bandwidth)


@pytest.mark.parametrize(
    ("links", "expected"),
    [
        # (the measured links, (rtt, bandwidth) a -> b)
        ([_link("a", "b", 2e-4), _link("b", "a", 2e-4)], (2e-4, 1.25e9)),
        ([_link("a", "b", 5.6e-2), _link("b", "a", 6e-4)], (6e-4, 1.25e9)),  # a probe queued
        ([_link("a", "b", 6e-4), _link("b", "a", 5.6e-2)], (6e-4, 1.25e9)),
        ([_link("b", "a", 3e-3, 6.25e6)], (3e-3, 6.25e6)),  # the other direction alone
        ([_link("a", "b", 3e-3, 6.25e6), _link("b", "a", 1e-3, 1.25e9)], (1e-3, 6.25e6)),
        ([_link("a", "b", 1e-3, 0.0), _link("b", "a", 4e-3, 6.25e6)], (4e-3, 6.25e6)),
        ([], (BASE.default_rtt_s, BASE.default_bandwidth_bps)),  # unmeasured: the defaults
    ],
)
def test_a_links_rtt_is_the_lower_directions_and_its_bandwidth_this_directions(
    links: list[LinkProfile], expected: tuple[float, float]
) -> None:
    cost = CostModel(MODEL, DEVICES, links, BASE)
    assert cost.link(0, 1) == pytest.approx(expected)
