"""Who coordinates: one table of (live peers, what this node follows, what the members
announce following) -> the coordinator, and the succession's properties.

Peer ids are short strings; ``"0"`` sorts below every honest id, as a ground key would.
Before issue 45 the coordinator was the lowest live id, so ``"0"`` won every row it
appears in.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hetmesh.scheduler.coordination import choose_coordinator
from hetmesh.scheduler.records import Plan
from tests.unit.scheduler.test_coordination import ABC, mesh, split_on, whole_model_on

GROUND = "0"  # a newcomer's ground low peer id
ON_AB = split_on(mesh("a", "b"), "a", "b")
ON_ABC = whole_model_on(ABC, "a", "b", "c")


@dataclass(frozen=True)
class Row:
    name: str
    live: tuple[str, ...]
    me: str
    plan: Plan | None
    signer: str | None
    following: dict[str, str]
    expected: str | None


ROWS = [
    Row(
        "a mesh starting, nobody follows a plan: the lowest id",
        ("b", "a"),
        "b",
        None,
        None,
        {},
        "a",
    ),
    Row("an empty mesh", (), "a", None, None, {}, "a"),
    Row(
        "a ground low id joins a mesh that follows a: a stays",
        ("a", "b", "c", GROUND),
        "b",
        ON_ABC,
        "a",
        {"a": "a", "c": "a", GROUND: GROUND},
        "a",
    ),
    Row(
        "the coordinator itself keeps coordinating when a ground id joins",
        ("a", "b", GROUND),
        "a",
        ON_AB,
        "a",
        {"b": "a", GROUND: GROUND},
        "a",
    ),
    Row(
        "a newcomer follows the signer most members follow, not the lowest id",
        ("a", "b", "n", GROUND),
        "n",
        None,
        None,
        {"a": "a", "b": "a", GROUND: GROUND},
        "a",
    ),
    Row(
        "a newcomer with a ground id of its own does not name itself",
        ("a", "b", GROUND),
        GROUND,
        None,
        None,
        {"a": "a", "b": "a"},
        "a",
    ),
    Row(
        "two halves that planned apart merge on the signer with more votes",
        ("a", "b", "c"),
        "c",
        ON_ABC,
        "c",
        {"a": "a", "b": "a"},
        "a",
    ),
    Row(
        "a half with more votes keeps its coordinator, whatever the ids",
        ("a", "b", "c"),
        "b",
        ON_ABC,
        "b",
        {"a": "a", "c": "b"},
        "b",
    ),
    Row(
        "tied halves: the lower id (two lone nodes that planned apart merge)",
        ("a", "b"),
        "b",
        ON_AB,
        "b",
        {"a": "a"},
        "a",
    ),
    Row(
        "the known limit: one honest node and one liar tie, and the lower id wins",
        ("a", GROUND),
        "a",
        ON_AB,
        "a",
        {GROUND: GROUND},
        GROUND,
    ),
    Row(
        "votes for a signer that is gone, or from members that are gone, count for nothing",
        ("b", "c", "n"),
        "n",
        None,
        None,
        {"b": "a", "c": "a", "x": "x", "y": "x"},
        "b",
    ),
    Row(
        "the signer gone: its successor is placed in its plan, never an unplaced ground id",
        ("b", GROUND),
        "b",
        ON_AB,
        "a",
        {GROUND: GROUND},
        "b",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_choose_coordinator_table(row: Row) -> None:
    got = choose_coordinator(
        row.live, me=row.me, plan=row.plan, signer=row.signer, following=row.following
    )
    assert got == row.expected


def test_every_follower_names_the_same_successor_and_a_ground_id_never_wins_it() -> None:
    live = ("b", "c", GROUND, "00", "000")  # a is gone; the ground ids joined after the plan
    named = {
        choose_coordinator(
            live,
            me=me,
            plan=ON_ABC,
            signer="a",
            following={"b": "a", "c": "a", GROUND: GROUND, "00": GROUND, "000": GROUND},
        )
        for me in ("b", "c")
    }
    assert len(named) == 1
    assert named <= {"b", "c"}


def test_the_successor_depends_on_the_plan_not_on_the_id_order() -> None:
    """Over many plans (epochs) each placed peer succeeds sometimes: no id is favoured."""
    winners = {
        choose_coordinator(
            ("b", "c", "d"),
            me="b",
            plan=whole_model_on(mesh("a", "b", "c", "d"), "a", "b", "c", "d", epoch=epoch),
            signer="a",
            following={},
        )
        for epoch in range(3, 40)
    }
    assert winners == {"b", "c", "d"}
