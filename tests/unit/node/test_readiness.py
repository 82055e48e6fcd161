"""Whether a plan's pipelines are ready: one pure decision, tested as a table."""

from __future__ import annotations

import pytest

from hetmesh.node.peer_view import ready_stages_in_view
from hetmesh.node.readiness import ready_pipelines, unready_peers
from tests.unit.scheduler.sched_helpers import hand_pipeline, hand_plan, hand_stage

# two replicas: A[0,4) -> B[4,8), and C holding all eight units
PLAN = hand_plan(
    hand_pipeline(hand_stage("A", 0, 4), hand_stage("B", 4, 8)),
    hand_pipeline(hand_stage("C", 0, 8)),
    epoch=3,
)


@pytest.mark.parametrize(
    ("ready", "pipelines", "unready"),
    [
        (set(), 0, {"A", "B", "C"}),
        ({("A", 0, 4)}, 0, {"B", "C"}),
        ({("A", 0, 4), ("B", 4, 8)}, 1, {"C"}),
        ({("C", 0, 8)}, 1, {"A", "B"}),
        ({("A", 0, 4), ("B", 4, 8), ("C", 0, 8)}, 2, set()),
        # a stage of other units on the right peer is not the planned stage
        ({("A", 0, 4), ("B", 4, 7), ("C", 0, 7)}, 0, {"B", "C"}),
    ],
)
def test_pipelines_are_ready_when_every_stage_is(
    ready: set[tuple[str, int, int]], pipelines: int, unready: set[str]
) -> None:
    assert len(ready_pipelines(PLAN, ready)) == pipelines
    assert unready_peers(PLAN, ready) == unready


def test_no_plan_has_no_ready_pipeline() -> None:
    assert ready_pipelines(None, {("C", 0, 8)}) == ()


def test_a_views_ready_stages_are_its_live_peers_ready_ones() -> None:
    def peer(pid: str, health: str, *stages: tuple[int, int, bool]) -> dict[str, object]:
        record = {
            "stages": [{"model": "m", "start": a, "end": b, "ready": r} for a, b, r in stages]
        }
        return {"peer_id": pid, "health": health, "record": record}

    view = {
        "peers": [
            peer("A", "self", (0, 4, True)),
            peer("B", "alive", (4, 8, True), (0, 4, False)),
            peer("C", "dead", (0, 8, True)),
            {"peer_id": "D", "health": "alive", "record": None},
        ]
    }
    assert ready_stages_in_view(view) == {("A", 0, 4), ("B", 4, 8)}
    assert ready_stages_in_view({}) == set()
