"""Whether a request waiting for a route can still get one: the pure decision, as a table."""

from __future__ import annotations

import pytest

from hetmesh.node.route_wait import hopeless, lost_units
from hetmesh.scheduler.records import Pipeline, Plan, Stage
from tests.unit.scheduler.sched_helpers import hand_stage

VERDICT = "m (int4 weights) does not fit on these 3 device(s): 0.10 GiB more free memory"


def _pipeline(*stages: Stage) -> Pipeline:
    return Pipeline(
        stages=stages,
        decode_latency_s=0.02,
        prefill_s_per_1k=0.2,
        bottleneck_s=0.01,
        throughput_tps=50.0,
    )


def _plan(*pipelines: Pipeline) -> Plan:
    return Plan(
        epoch=1,
        model_name="m",
        objective="latency",
        strategy="exact",
        pipelines=pipelines,
        objective_value=0.02,
        decode_latency_s=0.02,
        prefill_s_per_1k=0.2,
        throughput_tps=50.0,
    )


# a four-stage cut, and the same with a standby replica of its third stage on E
CUT = _plan(
    _pipeline(
        hand_stage("A", 0, 2), hand_stage("B", 2, 4), hand_stage("C", 4, 6), hand_stage("D", 6, 8)
    )
)
BACKED = _plan(
    CUT.pipelines[0],
    _pipeline(
        hand_stage("A", 0, 2), hand_stage("B", 2, 4), hand_stage("E", 4, 6), hand_stage("D", 6, 8)
    ),
)


@pytest.mark.parametrize(
    ("plan", "live", "verdict", "hopeless_"),
    [
        # the coordinator has not said it cannot place the model: wait
        (CUT, {"A", "B", "D"}, "", False),
        (None, {"A"}, "", False),
        # it said so and no plan is followed: refuse
        (None, {"A"}, VERDICT, True),
        # it said so, and the plan followed lost a peer: refuse
        (CUT, {"A", "B", "D"}, VERDICT, True),
        # a pipeline of live peers remains (a standby replica): it may still serve
        (BACKED, {"A", "B", "D", "E"}, VERDICT, False),
        (BACKED, {"A", "B", "D"}, VERDICT, True),
        # every peer of the plan alive (loading, or a stale verdict): wait
        (CUT, {"A", "B", "C", "D"}, VERDICT, False),
    ],
)
def test_waiting_is_hopeless_only_when_the_mesh_says_so_and_no_pipeline_lives(
    plan: Plan | None, live: set[str], verdict: str, hopeless_: bool
) -> None:
    assert bool(hopeless(plan, live, verdict)) == hopeless_


def test_the_refusal_names_the_memory_and_the_units_that_lost_their_host() -> None:
    why = hopeless(BACKED, {"A", "D"}, VERDICT)
    assert why.startswith(VERDICT)
    assert "units [2,4) (their host B left)" in why
    assert "units [4,6) (their host C left)" in why
    assert "units [4,6) (their host E left)" in why
    assert "[0,2)" not in why
    assert lost_units(CUT, {"A", "B", "C", "D"}) == []
