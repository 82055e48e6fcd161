"""The membership core, without a socket: rules as tables, a virtual network for the rest."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from hetmesh.discovery.membership import Kind, Membership, Message, SwimPolicy, Update
from hetmesh.discovery.membership_wire import decode_message, encode_message
from hetmesh.discovery.simnet import SimNet
from hetmesh.discovery.table import Health, LivenessPolicy
from hetmesh.discovery.wire import Announcement
from hetmesh.errors import RemoteProtocolError

POLICY = SwimPolicy()


def _record(peer: str, boot: int = 5, seq: int = 1) -> Announcement:
    return Announcement(version="t", peer_id=peer, boot_id=boot, seq=seq, addrs=(f"/x/{peer}",))


def _node_with(*peers: str) -> Membership:
    """Node A that knows ``peers`` as alive, records held, boot 5 incarnation 0."""
    node = Membership("A", boot_id=1, addrs=("/x/A",), policy=POLICY)
    node.set_record(_record("A", boot=1), 0.0)
    for peer in peers:
        node.note_record(_record(peer), 0.0, direct=True)
    node.drain_events()
    return node


def _msg(
    kind: Kind, src: str, *, boot: int = 5, inc: int = 0, seq: int = 0, **kw: object
) -> Message:
    return Message(kind, src, "A", boot, inc, 1, seq=seq, **kw)  # type: ignore[arg-type]


# -- rumors: (health A holds for B, rumor about B) -> health after -------------------

ALIVE, SUSPECT, DEAD, LEFT, JOINING = (
    Health.ALIVE,
    Health.SUSPECT,
    Health.DEAD,
    Health.LEFT,
    Health.JOINING,
)


def _to(node: Membership, health: Health) -> None:
    """Bring B to ``health`` through the protocol's own inputs."""
    if health is SUSPECT:
        node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("B", SUSPECT, 5, 0),)), 0.0)
    elif health is DEAD:
        node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("B", DEAD, 5, 0),)), 0.0)
    elif health is LEFT:  # its own goodbye: only the peer itself says it left
        node.receive(_msg(Kind.GOSSIP, "B", updates=(Update("B", LEFT, 5, 0),)), 0.0)
    elif health is JOINING:
        _to(node, DEAD)
        node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("B", ALIVE, 5, 1),)), 0.0)
    assert node.health_of("B") is health


RUMORS = [
    # held, rumor (health, boot, incarnation), expected
    (ALIVE, (SUSPECT, 5, 0), SUSPECT),
    (ALIVE, (SUSPECT, 5, 1), SUSPECT),
    (ALIVE, (DEAD, 5, 0), DEAD),
    (ALIVE, (LEFT, 5, 0), ALIVE),  # C's word that B left: only B may say so
    (ALIVE, (ALIVE, 5, 3), ALIVE),
    (SUSPECT, (ALIVE, 5, 0), SUSPECT),  # the same incarnation does not refute
    (SUSPECT, (ALIVE, 5, 1), ALIVE),  # a refutation
    (SUSPECT, (DEAD, 5, 0), DEAD),
    (DEAD, (ALIVE, 5, 0), DEAD),  # no resurrection without a refutation
    (DEAD, (ALIVE, 5, 1), JOINING),  # back, on probation
    (DEAD, (ALIVE, 9, 0), DEAD),  # a restart on C's word: believed from B's record
    (DEAD, (SUSPECT, 5, 0), DEAD),
    (LEFT, (ALIVE, 5, 1), LEFT),  # a late rumor about a peer that said goodbye
    (LEFT, (ALIVE, 9, 0), LEFT),  # likewise (test_membership_trust: the record's way)
    (JOINING, (SUSPECT, 5, 1), DEAD),  # suspected on probation: out again
    (ALIVE, (SUSPECT, 4, 7), ALIVE),  # a rumor about an older boot
]


@pytest.mark.parametrize(("held", "rumor", "expected"), RUMORS)
def test_membership_rumor_rules(
    held: Health, rumor: tuple[Health, int, int], expected: Health
) -> None:
    node = _node_with("B", "C")
    _to(node, held)
    health, boot, inc = rumor
    node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("B", health, boot, inc),)), 1.0)
    assert node.health_of("B") is expected


def test_membership_joining_peer_is_readmitted_after_hysteresis_only() -> None:
    node = _node_with("B", "C")
    _to(node, JOINING)
    hysteresis = POLICY.liveness.hysteresis_s
    node.tick(hysteresis - 0.5)
    assert node.health_of("B") is JOINING
    node.tick(hysteresis + 0.1)
    assert node.health_of("B") is ALIVE


# -- probing ----------------------------------------------------------------------------


def _pings(out: list[Message]) -> list[Message]:
    return [m for m in out if m.kind is Kind.PING]


def test_membership_probe_answered_keeps_peer_alive() -> None:
    node = _node_with("B")
    (ping,) = _pings(node.tick(10.0))
    assert ping.dst == "B"
    node.receive(_msg(Kind.ACK, "B", seq=ping.seq, target="B"), 10.1)
    node.tick(10.0 + POLICY.probe_timeout_s + 1)
    assert node.health_of("B") is ALIVE


def test_membership_silent_peer_is_asked_about_then_suspect_then_dead() -> None:
    node = _node_with("B", "C", "D")
    t0 = 10.0 - POLICY.interval_s
    ping = None
    while ping is None:  # round-robin: B's turn comes within one lap; the others answer
        t0 += POLICY.interval_s
        for m in _pings(node.tick(t0)):
            if m.dst == "B":
                ping = m
            else:
                node.receive(_msg(Kind.ACK, m.dst, seq=m.seq, target=m.dst), t0)
    asked = node.tick(t0 + POLICY.ack_timeout_s)
    assert {m.dst for m in asked if m.kind is Kind.PING_REQ} == {"C", "D"}
    assert all(m.target == "B" for m in asked if m.kind is Kind.PING_REQ)
    node.tick(t0 + POLICY.probe_timeout_s)
    assert node.health_of("B") is SUSPECT
    node.tick(t0 + POLICY.probe_timeout_s + POLICY.suspicion_s - 0.2)
    assert node.health_of("B") is SUSPECT
    node.tick(t0 + POLICY.probe_timeout_s + POLICY.suspicion_s)
    assert node.health_of("B") is DEAD


def test_membership_indirect_ack_saves_the_peer() -> None:
    node = _node_with("B", "C")
    t0 = 10.0
    pings = {m.dst: m for m in _pings(node.tick(t0))}
    while "B" not in pings:
        t0 += POLICY.interval_s
        pings = {m.dst: m for m in _pings(node.tick(t0))}
    node.tick(t0 + POLICY.ack_timeout_s)
    node.receive(_msg(Kind.ACK, "C", seq=pings["B"].seq, target="B"), t0 + 1.2)
    node.tick(t0 + POLICY.probe_timeout_s + 0.1)
    assert node.health_of("B") is ALIVE


def test_membership_ping_req_is_relayed_and_the_answer_passed_back() -> None:
    node = _node_with("B", "C")
    (relay,) = node.receive(_msg(Kind.PING_REQ, "C", seq=77, target="B"), 1.0)
    assert (relay.kind, relay.dst) == (Kind.PING, "B")
    (back,) = node.receive(_msg(Kind.ACK, "B", seq=relay.seq, target="B"), 1.1)
    assert (back.kind, back.dst, back.seq, back.target) == (Kind.ACK, "C", 77, "B")
    node.tick(1.0 + POLICY.probe_timeout_s + 0.1)
    assert node.health_of("B") is ALIVE  # a relayed ping never makes us suspect


def test_membership_answer_between_refusals_starts_the_count_again() -> None:
    node = _node_with("B", "C")
    node.note_unreachable("B", 3.0)
    node.receive(_msg(Kind.PING, "B", seq=1), 3.1)
    node.note_unreachable("B", 3.2)
    assert node.health_of("B") is ALIVE


def test_membership_two_refusals_kill_at_once() -> None:
    node = _node_with("B", "C")
    again = node.note_unreachable("B", 3.0)
    assert node.health_of("B") is ALIVE  # one refusal proves nothing yet
    assert [m.dst for m in again] == ["B"]  # checked again at once
    node.note_unreachable("B", 3.05)
    assert node.health_of("B") is DEAD
    assert ("B", DEAD) in {(e.peer_id, e.new) for e in node.drain_events()}


def test_membership_suspected_self_refutes_with_a_higher_incarnation() -> None:
    node = _node_with("B", "C")
    out = node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("A", SUSPECT, 1, 0),)), 1.0)
    assert node.incarnation == 1
    told = {u for m in out for u in m.updates if u.peer_id == "A"}
    assert Update("A", ALIVE, 1, 1, 1, ("/x/A",)) in told


def test_membership_dead_peer_pinging_us_is_told_it_was_buried() -> None:
    node = _node_with("B", "C")
    _to(node, DEAD)
    (ack,) = node.receive(_msg(Kind.PING, "B", seq=3), 2.0)
    assert ack.updates[0] == Update("B", DEAD, 5, 0, 1, ("/x/B",))
    assert node.health_of("B") is DEAD
    node.receive(_msg(Kind.PING, "B", inc=1, seq=4), 2.1)  # it refuted
    assert node.health_of("B") is JOINING


def test_membership_goodbye_record_leaves_at_once() -> None:
    node = _node_with("B", "C")
    bye = Announcement(version="t", peer_id="B", boot_id=5, seq=2, addrs=(), goodbye=True)
    node.note_record(bye, 1.0, direct=True)
    assert node.health_of("B") is LEFT
    assert node.members()[0].peer_id == "C"


@pytest.mark.parametrize(
    ("members", "fanout"), [(0, 0), (1, 1), (3, 1), (15, 2), (100, 4), (1000, 5), (10_000, 7)]
)
def test_membership_fanout_grows_like_log_n(members: int, fanout: int) -> None:
    assert POLICY.fanout(members) == fanout


# -- records as versioned deltas ---------------------------------------------------------


def test_membership_newer_record_version_is_pulled_from_whoever_told_us() -> None:
    node = _node_with("B", "C")
    out = node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("B", ALIVE, 5, 0, 4),)), 1.0)
    (pull,) = [m for m in out if m.kind is Kind.PULL]
    assert (pull.dst, pull.target) == ("C", "B")
    again = node.receive(_msg(Kind.GOSSIP, "D", updates=(Update("B", ALIVE, 5, 0, 4),)), 1.1)
    assert not [m for m in again if m.kind is Kind.PULL and m.target == "B"]  # one is enough
    node.receive(_msg(Kind.RECORD, "C", target="B", record=_record("B", seq=4)), 1.2)
    entry = node.entries["B"]
    assert entry.record is not None
    assert entry.record.seq == 4


def test_membership_header_with_the_same_version_pulls_nothing() -> None:
    node = _node_with("B")
    out = node.receive(_msg(Kind.PING, "B", seq=1), 1.0)
    assert [m.kind for m in out] == [Kind.ACK]


def test_membership_answers_pulls_with_the_record_it_holds() -> None:
    node = _node_with("B", "C")
    (reply,) = node.receive(_msg(Kind.PULL, "C", target="B"), 1.0)
    assert reply.kind is Kind.RECORD
    assert reply.record == _record("B")
    (mine,) = node.receive(_msg(Kind.PULL, "C", target="A"), 1.0)
    assert mine.record is not None
    assert mine.record.peer_id == "A"


def test_membership_unrequested_record_is_ignored() -> None:
    node = _node_with("B", "C")
    node.receive(_msg(Kind.RECORD, "C", target="B", record=_record("B", seq=9)), 1.0)
    entry = node.entries["B"]
    assert entry.record is not None
    assert entry.record.seq == 1


# -- the virtual network -------------------------------------------------------------------


def _mesh(n: int, *, seed: int, loss: float) -> tuple[SimNet, list[str]]:
    net = SimNet(seed=seed, loss=loss)
    ids = [f"p{i:03d}" for i in range(n)]
    net.add_node(ids[0])
    for peer in ids[1:]:
        net.add_node(peer, introduce_to=ids[0])
    return net, ids


def _all_alive(net: SimNet, ids: list[str]) -> bool:
    return all(net.health(a, b) == "alive" for a in ids for b in ids if a != b)


def test_simnet_joins_through_one_bootstrap_and_converges_with_records() -> None:
    net, ids = _mesh(30, seed=3, loss=0.01)
    t = 0.0
    while not _all_alive(net, ids):
        t += 0.5
        assert t < 30, "the mesh did not converge"
        net.run_until(t)
    net.run_until(t + 5)
    for a in ids:
        held = {e.peer_id for e in net.nodes[a].members()}
        assert held == set(ids) - {a}  # every record arrived


def test_simnet_crash_and_freeze_within_todays_bounds_without_false_deaths() -> None:
    net, ids = _mesh(40, seed=7, loss=0.01)
    net.run_until(20)
    assert _all_alive(net, ids)
    net.verdicts.clear()
    crashed, frozen = ids[5], ids[6]
    net.crash(crashed)
    net.freeze(frozen)
    net.run_until(40)
    observers = set(ids) - {crashed, frozen}
    dead_at: dict[tuple[str, str], float] = {}
    suspect_first: set[str] = set()
    for v in net.verdicts:
        assert v.event.peer_id in (crashed, frozen), f"a false verdict: {v}"
        if v.event.new is Health.DEAD:
            dead_at.setdefault((v.observer, v.event.peer_id), v.at_s - 20)
        if v.event.peer_id == frozen and v.event.new is Health.SUSPECT:
            suspect_first.add(v.observer)
    for observer in observers:
        assert dead_at[(observer, crashed)] <= 5.0
        assert dead_at[(observer, frozen)] <= 10.0
    assert len(suspect_first) >= len(observers) // 2  # mostly judged over a window


def test_simnet_thawed_peer_is_readmitted_through_probation() -> None:
    net, ids = _mesh(10, seed=11, loss=0.0)
    net.run_until(10)
    net.freeze(ids[3])
    net.run_until(25)
    assert net.health(ids[0], ids[3]) == "dead"
    net.verdicts.clear()
    net.thaw(ids[3])
    net.run_until(40)
    seen = [v for v in net.verdicts if v.observer == ids[0] and v.event.peer_id == ids[3]]
    assert [v.event.new for v in seen] == [Health.JOINING, Health.ALIVE]
    assert seen[1].at_s - seen[0].at_s >= LivenessPolicy().hysteresis_s
    assert _all_alive(net, ids)


# -- wire and purity -----------------------------------------------------------------------


def test_membership_messages_round_trip() -> None:
    msg = Message(
        Kind.RECORD,
        "A",
        "B",
        3,
        1,
        2,
        seq=9,
        target="A",
        updates=(Update("C", SUSPECT, 4, 2, 0, ("/x/C",)),),
        src_addrs=("/x/A",),
        record=_record("A"),
    )
    assert decode_message(encode_message(msg)) == msg


def test_membership_garbage_is_a_remote_protocol_error() -> None:
    """10,000 random payloads (HETMESH_FUZZ_EXAMPLES), random and mutated messages alike,
    drawn with random.Random: each decodes or raises RemoteProtocolError."""
    valid = encode_message(
        Message(Kind.RECORD, "A", "B", 3, 1, 2, seq=9, target="A", record=_record("A"))
    )
    first = random.SystemRandom().randrange(2**48)  # a failure names its seed
    for seed in range(first, first + int(os.environ.get("HETMESH_FUZZ_EXAMPLES", "10000"))):
        rng = random.Random(seed)
        if seed % 2:
            payload = rng.randbytes(rng.randint(0, 200))
        else:
            raw = bytearray(valid)
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            payload = bytes(raw[: rng.randint(1, len(raw))] if rng.random() < 0.3 else raw)
        try:
            decode_message(payload)
        except RemoteProtocolError:
            pass
        except Exception as exc:
            raise AssertionError(f"seed {seed}: {exc!r}") from exc


def test_membership_core_imports_neither_trio_nor_libp2p() -> None:
    code = (
        "import sys, hetmesh.discovery.membership, hetmesh.discovery.simnet, "
        "hetmesh.discovery.membership_wire; "
        "print(sorted(m for m in ('trio', 'libp2p') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
