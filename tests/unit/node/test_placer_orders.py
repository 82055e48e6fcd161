"""The placement leader's orders lapse by whether their node took them up (pure logic).

A node that took an order up is starting a member, which loads a model: the leader
waits for it (up to ``ORDER_CARRIED_S``) instead of ordering another node after
``ORDER_EXPIRES_ROUNDS`` rounds; an order nobody took up still lapses by rounds.
"""

from __future__ import annotations

from hetmesh.node.placer import (
    ORDER_CARRIED_S,
    ORDER_EXPIRES_ROUNDS,
    PlacerState,
    _order_growth,
)
from hetmesh.scheduler.model_placement import (
    ModelState,
    NodePool,
    Placement,
    PlacementPolicy,
)

SHARE = 100
POLICY = PlacementPolicy(grow_at=3, interval_s=0.2, window_s=600)
ME, OTHER = "a-leader", "b-roomy"


def states(members: int) -> list[ModelState]:
    # six recent requests over the mesh's members: demand 3 per member at two
    return [ModelState("B", SHARE, 1, members, recent_requests=6)]


def pools(other_free: int) -> list[NodePool]:
    return [NodePool(ME, SHARE, {"B": SHARE}), NodePool(OTHER, other_free, {"B": SHARE})]


def others(done_seq: int, other_free: int) -> dict[str, Placement]:
    pool = pools(other_free)[1]
    return {OTHER: Placement(pool, None, ME if done_seq else "", done_seq)}


def seq(state: PlacerState) -> int:
    assert state.order is not None
    return state.order.seq


def rounds(state: PlacerState, n: int, done_seq: int, other_free: int, now: float) -> None:
    for _ in range(n):
        _order_growth(
            state, states(2), pools(other_free), others(done_seq, other_free), ME, POLICY, now
        )


def test_the_first_order_goes_to_the_node_with_most_room() -> None:
    state = PlacerState()
    rounds(state, 1, 0, 2 * SHARE, now=10.0)
    assert state.order is not None
    assert (state.order.seq, state.order.node, state.order.model) == (1, OTHER, "B")


def test_an_order_taken_up_is_waited_for_past_the_rounds_then_lapses_in_time() -> None:
    state = PlacerState()
    rounds(state, 1, 0, 2 * SHARE, now=10.0)
    # the other node took it up (done 1) and is starting its member: its pool now
    # shows the share taken, so the node with most room ties and the least id wins
    rounds(state, ORDER_EXPIRES_ROUNDS + 20, 1, SHARE, now=10.0 + ORDER_CARRIED_S - 1)
    assert seq(state) == 1  # no second order
    rounds(state, 1, 1, SHARE, now=10.0 + ORDER_CARRIED_S)
    assert seq(state) == 2


def test_an_order_nobody_took_up_lapses_after_its_rounds() -> None:
    state = PlacerState()
    rounds(state, 1, 0, 2 * SHARE, now=10.0)
    rounds(state, ORDER_EXPIRES_ROUNDS - 1, 0, 2 * SHARE, now=11.0)
    assert seq(state) == 1
    rounds(state, 1, 0, 2 * SHARE, now=11.0)
    assert seq(state) == 2


def test_an_order_seen_through_is_not_repeated_once_demand_is_met() -> None:
    state = PlacerState()
    rounds(state, 1, 0, 2 * SHARE, now=10.0)
    # its member is in the mesh: three members, demand 2 a member, under the bar
    _order_growth(state, states(3), pools(SHARE), others(1, SHARE), ME, POLICY, 11.0)
    assert seq(state) == 1  # nothing more wanted
