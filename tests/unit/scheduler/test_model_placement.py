"""Where a node serving several models puts its spare memory (hetmesh.scheduler.model_placement)."""

from __future__ import annotations

import pytest

from hetmesh.node.placer import RecentRequests
from hetmesh.scheduler.model_placement import (
    ModelState,
    Move,
    NodePool,
    Order,
    Placement,
    PlacementPolicy,
    grower,
    leader,
    place,
    wanted,
)

POLICY = PlacementPolicy(grow_at=4, shrink_after=3)
GIB = 1 << 30


def state(name: str, **kw: int) -> ModelState:
    fields = {"member_bytes": GIB, "local_members": 1, "mesh_members": 1, **kw}
    return ModelState(name=name, **fields)


def test_a_model_below_its_minimum_gets_a_member_when_it_fits() -> None:
    models = [state("a", min_members=3), state("b", recent_requests=100)]
    assert place(models, GIB, POLICY) == Move("add", "a", "1 of at least 3 members", "minimum")
    # no room for either member: nothing moves (no replica to take memory from)
    move = place(models, GIB - 1, POLICY)
    assert move is None


def test_demand_per_member_grows_the_neediest_model() -> None:
    quiet = state("a", recent_requests=3)  # 3 per member: under the bar
    busy = state("b", recent_requests=6, load=2, mesh_members=2)  # 4 per member
    move = place([quiet, busy], GIB, POLICY)
    assert move is not None
    assert (move.kind, move.model) == ("add", "b")
    assert place([quiet, busy], GIB - 1, POLICY) is None  # no room and nothing idle
    # more members across the mesh dilute the same demand under the bar
    assert (
        place([quiet, state("b", recent_requests=6, load=2, mesh_members=3)], GIB, POLICY) is None
    )


def test_an_idle_replica_makes_room_for_a_needy_model_and_idle_ones_shrink() -> None:
    idle = state("a", local_members=2, mesh_members=2)
    busy = state("b", recent_requests=9)
    move = place([idle, busy], 0, POLICY)
    assert move is not None
    assert (move.kind, move.model) == ("remove", "a")
    # never below the minimum, never the first member
    assert place([state("a", local_members=2, min_members=2), busy], 0, POLICY) is None
    assert place([state("a"), busy], 0, POLICY) is None
    # idle long enough: back to the pool; not before
    assert place([state("a", local_members=2, idle_rounds=2)], 0, POLICY) is None
    move = place([state("a", local_members=2, idle_rounds=3)], 0, POLICY)
    assert move is not None
    assert (move.kind, move.model) == ("remove", "a")


def test_a_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="grow_at"):
        PlacementPolicy(grow_at=0)
    with pytest.raises(ValueError, match="interval_s"):
        PlacementPolicy(interval_s=0)


def test_recent_requests_count_within_the_window() -> None:
    now = [100.0]
    recent = RecentRequests(clock=lambda: now[0])
    recent.add("a")
    now[0] = 105.0
    recent.add("a")
    recent.add("b")
    assert (recent.count("a", 10), recent.count("b", 10), recent.count("c", 10)) == (2, 1, 0)
    now[0] = 112.0
    assert recent.count("a", 10) == 1  # the first one is older than the window


def test_the_leader_is_the_least_id_and_the_grower_the_node_with_most_room() -> None:
    pools = [
        NodePool("n2", 2 * GIB, {"a": GIB, "b": GIB}),
        NodePool("n1", GIB, {"a": GIB, "b": GIB}),
        NodePool("n3", 5 * GIB, {"a": GIB}),  # room, but it does not serve b
        NodePool("n4", 2 * GIB, {"b": 3 * GIB}),  # serves b, its share does not fit
    ]
    assert leader(pools) == "n1"
    assert leader([]) is None
    assert grower(pools, "b") == "n2"
    assert grower(pools, "a") == "n3"
    assert grower([*pools, NodePool("n0", 2 * GIB, {"b": GIB})], "b") == "n0"  # tie: least id
    assert grower(pools, "c") is None
    assert grower([NodePool("n1", GIB - 1, {"b": GIB})], "b") is None


def test_wanted_is_the_neediest_model_at_the_bar() -> None:
    assert wanted([state("a", recent_requests=3), state("b", recent_requests=2)], POLICY) is None
    top = wanted([state("a", recent_requests=4), state("b", load=9, mesh_members=2)], POLICY)
    assert top is not None
    assert top.name == "b"


def test_a_placement_round_trips_and_malformed_ones_are_dropped() -> None:
    placement = Placement(NodePool("n1", GIB, {"a": GIB}), Order(3, "n2", "a"), "n1", 2)
    assert Placement.read(placement.as_extra()) == placement
    bare = Placement(NodePool("n1", 0, {}))
    assert Placement.read(bare.as_extra()) == bare
    good = placement.as_extra()
    for bad in (
        None,
        [],
        {**good, "node": ""},
        {**good, "free": -1},
        {**good, "free": True},
        {**good, "shares": {"a": "1"}},
        {**good, "shares": [1]},
    ):
        assert Placement.read(bad) is None
    # a malformed order or done is dropped, the pool kept
    odd = Placement.read({**good, "order": [1, 2, 3], "done": ["x"]})
    assert odd == Placement(NodePool("n1", GIB, {"a": GIB}))
