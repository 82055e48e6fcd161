"""Probe timers count from the wire, and a refutation reaches its accuser (pure core)."""

from __future__ import annotations

from hetmesh.discovery.membership import Kind, Membership, Message, SwimPolicy, Update
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import Announcement

POLICY = SwimPolicy()
PEERS = ("B", "C", "D", "E")


def _record(peer: str, boot: int = 5) -> Announcement:
    return Announcement(version="t", peer_id=peer, boot_id=boot, seq=1, addrs=(f"/x/{peer}",))


def _node() -> Membership:
    node = Membership("A", boot_id=1, addrs=("/x/A",), policy=POLICY)
    node.set_record(_record("A", boot=1), 0.0)
    for peer in PEERS:
        node.note_record(_record(peer), 0.0, direct=True)
    node.drain_events()
    return node


def _ping_to(node: Membership, peer: str, t0: float) -> tuple[Message, float]:
    """Tick until ``node`` pings ``peer``; answer every other ping at once."""
    while True:
        for m in node.tick(t0):
            if m.kind is not Kind.PING:
                continue
            if m.dst == peer:
                return m, t0
            node.receive(Message(Kind.ACK, m.dst, "A", 5, 0, 1, seq=m.seq, target=m.dst), t0)
        t0 += POLICY.interval_s


def _asked_about(msgs: list[Message], peer: str) -> bool:
    return any(m.kind is Kind.PING_REQ and m.target == peer for m in msgs)


def test_probe_timers_start_when_the_ping_is_written() -> None:
    node = _node()
    ping, t0 = _ping_to(node, "B", 10.0)
    written = t0 + 1.5  # the driver spent 1.5 s dialling B before the ping left
    node.note_sent(ping.seq, written)
    assert not _asked_about(node.tick(t0 + POLICY.ack_timeout_s + 0.1), "B")
    assert _asked_about(node.tick(written + POLICY.ack_timeout_s), "B")
    node.tick(written + POLICY.probe_timeout_s - 0.1)
    assert node.health_of("B") is Health.ALIVE
    node.tick(written + POLICY.probe_timeout_s)
    assert node.health_of("B") is Health.SUSPECT


def test_probe_never_reported_written_times_out_as_before() -> None:
    node = _node()
    _, t0 = _ping_to(node, "B", 10.0)
    assert _asked_about(node.tick(t0 + POLICY.ack_timeout_s), "B")
    node.tick(t0 + POLICY.probe_timeout_s)
    assert node.health_of("B") is Health.SUSPECT


def test_refutation_goes_straight_to_the_accuser() -> None:
    node = _node()
    suspicion = Update("A", Health.SUSPECT, 1, 0, accuser="E")
    out = node.receive(Message(Kind.GOSSIP, "C", "A", 5, 0, 1, updates=(suspicion,)), 1.0)
    assert node.incarnation == 1
    refuting = {
        m.dst for m in out if any(u.peer_id == "A" and u.incarnation == 1 for u in m.updates)
    }
    assert {"C", "E"} <= refuting
