"""When the coordinator's start-up wait for peers may end early (plan_follower.heard_from_all)."""

from __future__ import annotations

from hetmesh.node.peer_view import PeerState, PeerView
from hetmesh.node.plan_follower import heard_from_all
from hetmesh.scheduler.announcement import ServingAnnouncement

SERVING = ServingAnnouncement(model="m", weights="int4")
STARTING = ServingAnnouncement()  # joined, its model not announced yet


def _view(*peers: tuple[str, ServingAnnouncement, str]) -> PeerView:
    return PeerView.of("m", [PeerState(pid, s, health=h) for pid, s, h in peers])


def test_a_node_alone_waits_the_whole_settle_time() -> None:
    assert not heard_from_all(_view())


def test_every_live_peer_announcing_its_model_ends_the_wait() -> None:
    assert heard_from_all(_view(("B", SERVING, "alive"), ("C", SERVING, "alive")))
    # a peer serving another model has said all it will: it does not hold the wait
    other = ServingAnnouncement(model="other")
    assert heard_from_all(_view(("B", SERVING, "alive"), ("X", other, "alive")))


def test_a_peer_still_starting_keeps_the_wait() -> None:
    assert not heard_from_all(_view(("B", SERVING, "alive"), ("C", STARTING, "alive")))


def test_a_dead_peer_does_not_hold_the_wait_and_others_models_do_not_end_it() -> None:
    assert heard_from_all(_view(("B", SERVING, "alive"), ("C", STARTING, "dead")))
    # nobody serving this model: nothing to plan with yet
    other = ServingAnnouncement(model="other")
    assert not heard_from_all(_view(("X", other, "alive")))
