"""Who may say what about whom: a member's rumor cannot evict another."""

from __future__ import annotations

from hetmesh.discovery.membership import Kind, Membership, Message, Update
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import Announcement


def _node() -> Membership:
    node = Membership("A", boot_id=1, addrs=("/x/A",))
    node.set_record(Announcement(version="t", peer_id="A", boot_id=1, seq=1, addrs=()), 0.0)
    for peer in ("B", "C"):
        record = Announcement(version="t", peer_id=peer, boot_id=5, seq=1, addrs=(f"/x/{peer}",))
        node.note_record(record, 0.0, direct=True)
    return node


def _gossip(src: str, *updates: Update) -> Message:
    return Message(Kind.GOSSIP, src, "A", 5, 0, 1, updates=updates)


def test_only_a_peer_itself_says_it_left() -> None:
    node = _node()
    node.receive(_gossip("C", Update("B", Health.LEFT, 5, 0)), 1.0)
    assert node.health_of("B") is Health.ALIVE
    node.receive(_gossip("C", Update("B", Health.LEFT, 5, 7)), 1.0)  # a later incarnation too
    assert node.health_of("B") is Health.ALIVE
    node.receive(_gossip("B", Update("B", Health.LEFT, 5, 0)), 2.0)  # its own goodbye
    assert node.health_of("B") is Health.LEFT


def test_a_live_peer_refutes_that_it_left() -> None:
    node = _node()
    out = node.receive(_gossip("C", Update("A", Health.LEFT, 1, 0)), 1.0)
    assert node.incarnation == 1
    told = [u for m in out for u in m.updates if u.peer_id == "A"]
    assert told
    assert all(u.health is Health.ALIVE and u.incarnation == 1 for u in told)


def test_after_its_own_leave_a_peer_does_not_refute_its_goodbye() -> None:
    node = _node()
    node.leave()
    node.receive(_gossip("C", Update("A", Health.LEFT, 1, 0)), 1.0)
    assert node.incarnation == 0
