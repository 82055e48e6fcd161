"""Who may say what about whom: a member's rumor cannot evict another."""

from __future__ import annotations

import pytest

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


def test_made_up_alive_rumors_neither_grow_the_table_nor_the_dials_without_bound() -> None:
    """C names 1,280 peers nobody has heard of, each at an address of its choosing.
    Before the fix each became a member (and a probe target); now at most
    ``max_unverified`` are held on C's word, and only those are ever dialled."""
    node = _node()
    cap = node.policy.max_unverified
    made_up = [f"fake{i:05d}" for i in range(1280)]
    for start in range(0, len(made_up), 64):
        batch = made_up[start : start + 64]
        rumors = tuple(
            Update(p, Health.ALIVE, 9, 0, 1, (f"/ip4/10.9.0.1/tcp/{i}",))
            for i, p in enumerate(batch)
        )
        node.receive(_gossip("C", *rumors), 1.0)
    held = [p for p in made_up if p in node.entries]
    assert len(held) == cap
    dialled: set[str] = set()
    for step in range(200):  # probe rounds: only held members are ever pinged
        for msg in node.tick(2.0 + step * 0.5):
            dialled.add(msg.dst)
    assert dialled - {"B", "C"} <= set(held)
    # a member heard from directly no longer counts against the bound
    node.receive(Message(Kind.PING, held[0], "A", 9, 0, 1, seq=1), 200.0)
    node.receive(_gossip("C", Update("late", Health.ALIVE, 9, 0, 1, ("/x/late",))), 200.0)
    assert "late" in node.entries


def test_a_boot_named_by_another_cannot_bury_a_live_peer() -> None:
    """C names a boot of B newer than B's real one, alive then dead. Before the fix A
    adopted it: B was buried, and its refutations, under its real boot, counted for
    nothing. Now A asks C for the record of that boot (which only B could have signed)
    and believes nothing until it comes."""
    node = _node()
    out = node.receive(_gossip("C", Update("B", Health.ALIVE, 9, 0, 3, ("/x/B",))), 1.0)
    assert [(m.kind, m.dst, m.target) for m in out if m.kind is Kind.PULL] == [
        (Kind.PULL, "C", "B")
    ]
    node.receive(_gossip("C", Update("B", Health.DEAD, 9, 0)), 1.5)
    node.receive(_gossip("C", Update("B", Health.SUSPECT, 9, 0)), 1.6)
    assert node.health_of("B") is Health.ALIVE
    assert node.entries["B"].boot_id == 5
    # and B itself, told of a boot it never had, does not lower its incarnation
    me = _node()
    me.receive(_gossip("C", Update("A", Health.SUSPECT, 1, 3)), 1.0)
    assert me.incarnation == 4
    me.receive(_gossip("C", Update("A", Health.DEAD, 2, 0)), 2.0)
    assert me.incarnation == 4


def _record(peer: str, boot: int, seq: int = 1) -> Announcement:
    return Announcement(version="t", peer_id=peer, boot_id=boot, seq=seq, addrs=(f"/x/{peer}",))


@pytest.mark.parametrize(
    ("before", "after"), [(Health.DEAD, Health.JOINING), (Health.LEFT, Health.ALIVE)]
)
def test_a_restart_heard_of_is_believed_from_its_record(before: Health, after: Health) -> None:
    """B restarted (boot 9): C's rumor alone moves nothing; the record C then relays
    (signed by B's process; the node's service checks that) brings B back."""
    node = _node()
    if before is Health.DEAD:
        node.receive(_gossip("C", Update("B", Health.DEAD, 5, 0)), 0.5)
    else:
        node.receive(_gossip("B", Update("B", Health.LEFT, 5, 0)), 0.5)
    assert node.health_of("B") is before
    (pull,) = [
        m
        for m in node.receive(_gossip("C", Update("B", Health.ALIVE, 9, 0, 1, ("/x/B",))), 1.0)
        if m.kind is Kind.PULL
    ]
    assert node.health_of("B") is before
    reply = Message(Kind.RECORD, "C", "A", 5, 0, 1, target="B", record=_record("B", 9))
    node.receive(reply, 1.1)
    assert pull.target == "B"
    assert node.health_of("B") is after
    assert node.entries["B"].boot_id == 9
