"""The step times a node announces leave out its retiring stages (``stage_host.plan_steps``)."""

from __future__ import annotations

from hetmesh.node.calibration import measured_constraints
from hetmesh.node.stage_host import plan_steps
from hetmesh.scheduler.records import PlanConstraints
from tests.unit.scheduler.sched_helpers import hand_pipeline, hand_plan, hand_stage


def test_a_retiring_stage_steps_are_not_announced() -> None:
    steps = plan_steps([(False, (0.1, 0.2, 0.3, 0.4, 0.5)), (True, (9.0,))])
    assert steps == (0.2, 0.3, 0.4, 0.5)
    assert plan_steps([(True, (9.0, 8.0))]) == ()


def test_a_node_moved_to_a_shorter_stage_is_not_judged_on_its_old_one() -> None:
    """b served a stage four times as long (28 ms steps) and now is given [0, 7)
    (predicted 7 ms); its new stage has not served yet. Announcing the old stage's
    steps made b read four times as slow as claimed (past the factor of 3) and moved
    it again; without them nobody is corrected."""
    plan = hand_plan(
        hand_pipeline(hand_stage("b", 0, 7, step_s=0.007), hand_stage("a", 7, 21, step_s=0.014))
    )
    claims = PlanConstraints(block_step_s_by_device={"a/cpu": 0.001, "b/cpu": 0.001})
    old_steps = (0.028, 0.029, 0.03)
    stale = {"a": (0.014,), "b": plan_steps([(True, old_steps), (False, ())])}
    _, corrected = measured_constraints(claims, plan, stale)
    assert corrected == frozenset()
    announced_before = {"a": (0.014,), "b": old_steps}  # what the node announced before
    _, wrongly = measured_constraints(claims, plan, announced_before)
    assert wrongly == frozenset({"b/cpu"})
