"""Which peers a new plan demotes from the primary pipeline to standby (pure).

The chain it is for: a latency plan with a standby; the stages report step
times, one peer of the primary is far slower than it claimed; the plan made
on the measured times puts the standby in its place and keeps the slow peer
as a standby of the same stage. That stage stays loaded and ready, so
nothing would retire it: ``standby_takeovers`` names the peer, and its
sessions move off it with their KV.
"""

from __future__ import annotations

import dataclasses

from hetmesh.node.calibration import measured_constraints
from hetmesh.scheduler.planner import plan
from hetmesh.scheduler.records import Pipeline, Plan, Stage
from hetmesh.scheduler.standby import standby_takeovers, with_standby
from tests.unit.scheduler.test_standby import CONS, MODEL, cpu


def latency_plan(devices, constraints, previous=None):
    best = plan(devices, [], MODEL, constraints=constraints)
    return with_standby(best, devices, [], MODEL, constraints=constraints, previous=previous)


def test_a_replan_on_measured_steps_demotes_the_slow_peer_and_names_it():
    devices = [cpu(p, 500) for p in ("a", "b", "c", "d")]
    before = latency_plan(devices, CONS)
    primary, standby = before.pipelines
    # the peer of the primary stage the standby backs up serves ten times slower
    (slow,) = [x.peer_id for x, y in zip(primary.stages, standby.stages, strict=True) if x != y]
    observed = {
        s.peer_id: (s.decode_step_s * (10 if s.peer_id == slow else 1),)
        for p in before.pipelines
        for s in p.stages
    }
    constraints, corrected = measured_constraints(CONS, before, observed)
    assert corrected == {f"{slow}/cpu"}
    after = latency_plan(devices, constraints, previous=before)
    assert slow not in after.pipelines[0].peers  # the primary no longer uses it ...
    kept = {(s.peer_id, s.start, s.end) for p in after.pipelines for s in p.stages}
    old = next(s for s in primary.stages if s.peer_id == slow)
    assert (slow, old.start, old.end) in kept  # ... but it still serves its stage
    assert standby_takeovers(before, after) == {slow}
    assert standby_takeovers(after, after) == frozenset()
    assert standby_takeovers(None, after) == frozenset()


def stage(peer: str, start: int, end: int) -> Stage:
    return Stage(
        peer_id=peer,
        device="cpu",
        start=start,
        end=end,
        decode_step_s=0.01,
        batch_step_s=0.01,
        prefill_s_per_1k=1.0,
        link_out_s=0.001,
        memory_bytes=1,
    )


def pipeline(*peers: str) -> Pipeline:
    stages = tuple(stage(p, 2 * i, 2 * i + 2) for i, p in enumerate(peers))
    return Pipeline(
        stages=stages,
        decode_latency_s=0.03,
        prefill_s_per_1k=3.0,
        bottleneck_s=0.01,
        throughput_tps=30.0,
    )


def made(*pipelines: Pipeline, objective: str = "latency") -> Plan:
    return Plan(
        epoch=1,
        model_name="m",
        objective=objective,  # type: ignore[arg-type]
        strategy="test",
        pipelines=pipelines,
        objective_value=0.03,
        decode_latency_s=0.03,
        prefill_s_per_1k=3.0,
        throughput_tps=30.0,
    )


def test_only_a_peer_kept_as_a_standby_of_its_stage_is_named():
    before = made(pipeline("a", "b1", "c"), pipeline("a", "b2", "c"))
    swapped = made(pipeline("a", "b2", "c"), pipeline("a", "b1", "c"))
    assert standby_takeovers(before, swapped) == {"b1"}
    # dropped from the plan: its stage retires, which moves its sessions already
    assert standby_takeovers(before, made(pipeline("a", "b2", "c"))) == frozenset()
    # still in the primary (another stage): not replaced
    moved = made(pipeline("b1", "a", "c"), pipeline("b2", "a", "c"))
    assert standby_takeovers(before, moved) == frozenset()
    # throughput plans have no primary: every pipeline serves
    throughput = dataclasses.replace(swapped, objective="throughput")
    assert standby_takeovers(dataclasses.replace(before, objective="throughput"), throughput) == (
        frozenset()
    )
