"""Lifeguard-style local health: a slow node stretches its own timeouts instead of
blaming its peers. The pure core by hand, then starved nodes on the virtual network."""

from __future__ import annotations

import random

from hetmesh.discovery.membership import Kind, Membership, Message, SwimPolicy, Update
from hetmesh.discovery.membership_wire import decode_message, encode_message
from hetmesh.discovery.simnet import SimNet
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import Announcement

TICK_S = 0.2
POLICY = SwimPolicy(tick_s=TICK_S)


def _record(peer: str, boot: int = 5) -> Announcement:
    return Announcement(version="t", peer_id=peer, boot_id=boot, seq=1, addrs=(f"/x/{peer}",))


def _node_with(*peers: str, policy: SwimPolicy = POLICY) -> Membership:
    node = Membership("A", boot_id=1, addrs=("/x/A",), policy=policy)
    node.set_record(_record("A", boot=1), 0.0)
    for peer in peers:
        node.note_record(_record(peer), 0.0, direct=True)
    node.drain_events()
    return node


def _msg(kind: Kind, src: str, *, seq: int = 0, **kw: object) -> Message:
    return Message(kind, src, "A", 5, 0, 1, seq=seq, **kw)  # type: ignore[arg-type]


def _ticks(node: Membership, start: float, end: float) -> list[Message]:
    """Tick on the promised cadence from ``start`` to ``end`` (inclusive)."""
    out: list[Message] = []
    t = start
    while t <= end + 1e-9:
        out += node.tick(t)
        t += TICK_S
    return out


# -- the core by hand ------------------------------------------------------------------


def test_local_health_late_tick_excuses_the_gap_and_stretches_timeouts() -> None:
    node = _node_with("B")
    pings = [m for m in _ticks(node, 10.0, 10.0) if m.kind is Kind.PING]
    assert [m.dst for m in pings] == ["B"]
    # starved for 5 s: the probe is older than probe_timeout_s by the clock, but we
    # were not running to read B's answer, so it is not given up
    node.tick(15.0)
    assert node.health_of("B") is Health.ALIVE
    assert node.local_health == 1
    assert node.stats.late_ticks == 1
    assert node.suspicion_timeout_s("B") == 2 * POLICY.suspicion_s
    node.receive(_msg(Kind.ACK, "B", seq=pings[0].seq, target="B"), 15.05)
    assert node.local_health == 0  # an answer in time: we keep up again
    assert node.suspicion_timeout_s("B") == POLICY.suspicion_s


def test_local_health_on_time_ticks_keep_todays_timeouts() -> None:
    node = _node_with("B")
    _ticks(node, 10.0, 20.0)
    assert node.local_health == 0
    assert node.stats.late_ticks == 0


def test_local_health_late_ack_means_we_gave_up_too_soon() -> None:
    node = _node_with("B", "C", "D")
    t = 10.0
    ping = None
    while ping is None:
        for m in (m for m in node.tick(t) if m.kind is Kind.PING):
            if m.dst == "B":
                ping = m
            else:
                node.receive(_msg(Kind.ACK, m.dst, seq=m.seq, target=m.dst), t)
        t += TICK_S
    _ticks(node, t, t + POLICY.probe_timeout_s)
    assert node.health_of("B") is Health.SUSPECT
    node.receive(_msg(Kind.ACK, "B", seq=ping.seq, target="B"), t + POLICY.probe_timeout_s + 0.1)
    assert node.stats.late_acks == 1
    assert node.local_health == 1
    assert node.health_of("B") is Health.ALIVE  # heard directly


def test_local_health_suspicion_of_ourselves_makes_us_humbler() -> None:
    node = _node_with("B", "C")
    node.receive(_msg(Kind.GOSSIP, "C", updates=(Update("A", Health.SUSPECT, 1, 0),)), 1.0)
    assert node.incarnation == 1  # refuted by incarnation
    assert node.local_health == 1


def test_local_health_stretch_is_bounded() -> None:
    node = _node_with("B")
    t = 0.0
    for _ in range(20):
        t += 3.0  # every tick late
        node.tick(t)
    assert node.local_health == POLICY.max_local_health
    assert node.suspicion_timeout_s("B") == (1 + POLICY.max_local_health) * POLICY.suspicion_s


def test_local_health_independent_confirmations_shrink_a_stretched_suspicion() -> None:
    node = _node_with("B", "C", "D", "E", "F")
    node.tick(0.0)
    node.tick(5.0)  # one late tick: stretched twice
    stretched = 2 * POLICY.suspicion_s
    node.receive(
        _msg(Kind.GOSSIP, "C", updates=(Update("B", Health.SUSPECT, 5, 0, accuser="C"),)), 5.1
    )
    assert node.health_of("B") is Health.SUSPECT
    assert node.suspicion_timeout_s("B") == stretched
    timeouts = []
    for accuser in ("D", "E", "F"):
        rumor = Update("B", Health.SUSPECT, 5, 0, accuser=accuser)
        node.receive(_msg(Kind.GOSSIP, "C", updates=(rumor,)), 5.2)  # relayed by C
        timeouts.append(node.suspicion_timeout_s("B"))
    assert stretched > timeouts[0] > timeouts[1] > timeouts[2]
    assert timeouts[2] == POLICY.suspicion_s  # never below today's window
    # the same accuser told again is no new evidence
    again = Update("B", Health.SUSPECT, 5, 0, accuser="F")
    node.receive(_msg(Kind.GOSSIP, "E", updates=(again,)), 5.3)
    assert node.suspicion_timeout_s("B") == timeouts[2]


def test_local_health_messages_to_a_suspect_tell_it_so() -> None:
    node = _node_with("B", "C")
    node.receive(
        _msg(Kind.GOSSIP, "C", updates=(Update("B", Health.SUSPECT, 5, 0, accuser="C"),)), 1.0
    )
    assert node.health_of("B") is Health.SUSPECT
    t, to_b = 1.0, []
    while not to_b:  # B's turn in the probe round comes within one lap
        t += POLICY.interval_s
        to_b = [m for m in node.tick(t) if m.dst == "B"]
        assert t < 10
    # whatever we send a suspect leads with its suspicion, so it can refute it
    assert all(m.updates[0].peer_id == "B" for m in to_b)
    assert all(m.updates[0].health is Health.SUSPECT for m in to_b)


def test_local_health_accuser_survives_the_wire_and_old_rumors_still_decode() -> None:
    rumor = Update("B", Health.SUSPECT, 5, 2, accuser="C")
    msg = Message(Kind.GOSSIP, "A", "D", 1, 0, 1, updates=(rumor, Update("E", Health.ALIVE, 3, 0)))
    assert decode_message(encode_message(msg)) == msg


# -- starved nodes on the virtual network -------------------------------------------------


def _mesh(n: int, *, seed: int) -> tuple[SimNet, list[str]]:
    net = SimNet(seed=seed, loss=0.01, tick_s=TICK_S)
    ids = [f"p{i:03d}" for i in range(n)]
    net.add_node(ids[0])
    for peer in ids[1:]:
        net.add_node(peer, introduce_to=ids[0])
    net.run_until(20.0)
    assert all(net.health(a, b) == "alive" for a in ids for b in ids if a != b)
    net.verdicts.clear()
    return net, ids


def test_simnet_stalling_node_blames_no_one() -> None:
    net, ids = _mesh(12, seed=2)
    slow = ids[4]
    t = 20.0
    while t < 80.0:  # starved 1.5 s of every 2.5 s for a minute
        net.stall(slow, 1.5)
        t += 2.5
        net.run_until(t)
    blamed = [v for v in net.verdicts if v.observer == slow]
    assert blamed == [], f"the slow node blamed its peers: {blamed[:3]}"
    assert not [v for v in net.verdicts if v.event.new is Health.DEAD]
    assert net.nodes[slow].stats.late_ticks > 10


def test_simnet_starved_mesh_has_no_false_deaths_and_still_detects_faults() -> None:
    net, ids = _mesh(16, seed=5)
    rng = random.Random(5)
    t = 20.0
    while t < 80.0:  # every node starved now and then, up to 4 s at a time
        t += 0.5
        for peer in ids:
            if rng.random() < 0.05 and net._stalled(peer) is None:
                net.stall(peer, rng.uniform(0.5, 4.0))
        net.run_until(t)
    deaths = [v for v in net.verdicts if v.event.new is Health.DEAD]
    assert deaths == [], f"false deaths: {deaths[:3]}"
    assert sum(n.stats.late_ticks for n in net.nodes.values()) > 50  # one per stall
    # the machine calms down: today's bounds hold again once health has recovered
    net.run_until(t + 10.0)
    assert all(n.local_health == 0 for n in net.nodes.values())
    crashed, frozen = ids[3], ids[9]
    t_fault = net.now
    net.crash(crashed)
    net.freeze(frozen)
    net.run_until(t_fault + 15.0)
    dead_at: dict[tuple[str, str], float] = {}
    for v in net.verdicts:
        if v.event.new is Health.DEAD and v.at_s >= t_fault:
            dead_at.setdefault((v.observer, v.event.peer_id), v.at_s - t_fault)
    for observer in set(ids) - {crashed, frozen}:
        assert dead_at[(observer, crashed)] <= 5.0
        assert dead_at[(observer, frozen)] <= 10.0
