"""SWIM-style membership and liveness as a pure state machine (sans-IO).

Messages in, messages out, an injected clock: every input takes ``now``
(monotonic seconds) and returns the :class:`Message` list to send; health
changes queue up as :class:`~hetmesh.discovery.table.TableEvent` for
:meth:`Membership.drain_events`. The node's discovery service and the
simulator in ``bench/scale.py`` run this same code. Nothing here imports
trio or libp2p.

The protocol, per node and per ``interval_s``:

- **probe** ``fanout(N) ~ log N`` members, round-robin over a shuffled list
  (every member is probed by every node once per lap): ``PING`` → ``ACK``;
- no ack within ``ack_timeout_s``: ask ``indirect_probes`` other members to
  ping it for us (``PING_REQ``); still nothing after ``probe_timeout_s``: the
  member is **suspect**, and a suspicion rumor spreads;
- a suspect not refuted (by a higher incarnation) within ``suspicion_s`` is
  **dead** (so a frozen peer is dead ``probe_timeout_s + suspicion_s`` after a
  probe first misses); a member whose dial is *refused* ``refusals_for_dead``
  times in a row is dead at once (a killed process refuses at once);
- news (joins, suspicions, deaths, departures, record versions) rides
  piggybacked on every message, each rumor ``retransmit_mult * log N`` times;
  deaths and departures are also pushed at once to ``fanout`` members by
  each node that learns of them, so they spread in a few network hops, not a
  few periods; a suspicion is pushed by its accuser only (the suspect has
  ``suspicion_s`` to refute it, and an epidemic of pushes per suspicion fed
  more suspicions on a starved machine).

**Local health** (Lifeguard's idea, in our own shape): a node that is itself
slow must not blame its peers. Signs that we are the slow one (a ``tick`` that
comes much later than the driver's promised ``tick_s``, an ack that arrives
after we gave its probe up, a suspicion of ourselves to refute) raise
``local_health`` by one, to ``max_local_health``; each direct ack in time takes
one off. Our ack, probe and suspicion timeouts and our probe interval stretch
``1 + local_health`` times, and the time a late tick shows we were not running
does not count against pending probes and suspicions. Each suspicion names its
accuser; independent accusers pull a stretched suspicion back towards today's
window (never below it by default). Whatever we send a suspect leads with its
suspicion, so a merely slow peer refutes (a higher incarnation) as soon as it
reads its inbox. On a machine that keeps up nothing changes: today's bounds.

Records (the node's announcement) are versioned: ``(boot_id, seq)``. A record
travels whole only when asked for (``PULL`` → ``RECORD``): a node that hears of
a newer version than it holds (from a message header or an alive rumor) pulls
it from whoever told it, who holds it; the new holder spreads the news in turn.

Health keeps the peer table's rules (:mod:`hetmesh.discovery.table`):
first contact admits at once; a dead peer heard again (with a higher
incarnation: it refuted its death) is ``joining`` and is re-admitted only after
``hysteresis_s`` without a new suspicion; a goodbye makes it ``left`` at once
and a restarted process (new ``boot_id``) after a goodbye is admitted at once.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from hetmesh.discovery.cow import CowDict, CowList, CowSet
from hetmesh.discovery.membership_types import (
    MAX_INCARNATION,
    Kind,
    Message,
    SwimPolicy,
    Update,
)
from hetmesh.discovery.table import (
    Health,
    PeerEntry,
    TableEvent,
    TableStatistics,
    live_members,
)
from hetmesh.discovery.wire import Announcement
from hetmesh.resources import PeerId


@dataclass(slots=True)
class _Probe:
    target: PeerId
    sent_at: float
    indirect_sent: bool = False


@dataclass(slots=True)
class _Relay:
    """A PING we send on someone's behalf (PING_REQ): whom to tell, under which number."""

    requester: PeerId
    requester_seq: int
    target: PeerId
    sent_at: float


@dataclass(slots=True)
class MembershipStatistics:
    accepted: int = 0
    rejected: int = 0
    stale: int = 0
    messages_in: int = 0
    messages_out: int = 0
    pulls: int = 0
    suspicions: int = 0
    refuted: int = 0
    deaths: int = 0  # members we declared (or learnt were) dead
    late_ticks: int = 0  # our own clock ran late: we were starved
    late_acks: int = 0  # an ack came after we had given its probe up


_LIVE = (Health.ALIVE, Health.SUSPECT, Health.JOINING)


class Membership:
    """One node's membership view and protocol state (see the module doc)."""

    def __init__(
        self,
        self_id: PeerId,
        *,
        boot_id: int,
        addrs: tuple[str, ...] = (),
        policy: SwimPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.self_id = self_id
        self.boot_id = boot_id
        self.incarnation = 0
        self.addrs = addrs
        self.policy = policy or SwimPolicy()
        self.rng = rng or random.Random(hash(self_id) ^ boot_id)
        self.entries: MutableMapping[PeerId, PeerEntry] = {}
        self.record: Announcement | None = None
        self.stats = MembershipStatistics()
        self._events: list[TableEvent] = []
        self._rumors: dict[PeerId, tuple[Update, int]] = {}
        self._probe_seq = 0
        self._probes: dict[int, _Probe] = {}
        self._relays: dict[int, _Relay] = {}
        self._order: list[PeerId] = []
        self._next_probe_at: float | None = None
        self._suspects: dict[PeerId, float] = {}  # peer -> suspected since
        self._joining: set[PeerId] = set()
        self._pulls: dict[PeerId, float] = {}  # subject -> asked at
        # live members whose newest record we lack -> since when (or last repair)
        self._missing: dict[PeerId, float] = {}
        self._knows_us: set[PeerId] | CowSet[PeerId] = set()
        self._dead: set[PeerId] = set()  # members we hold dead (a set: no scan of N entries)
        self._dead_order: list[PeerId] = []
        # members believed up (alive, suspect, joining after having been alive), kept
        # as a list plus positions so adding, removing and sampling are O(1) at any N
        self._live: list[PeerId] | CowList[PeerId] = []
        self._live_at: MutableMapping[PeerId, int] = {}
        self._candidates: dict[PeerId, tuple[float, int]] = {}  # -> (last try, tries)
        # local health (Lifeguard): 0 when we keep up; each sign that we are the slow
        # one (a late tick, a late ack, a suspicion of ourselves) adds one, each ack
        # in time takes one off; every timeout of ours stretches (1 + it) times
        self.local_health = 0
        self._last_tick: float | None = None
        self._accusers: dict[PeerId, set[PeerId]] = {}  # suspect -> who suspects it
        self._expired: dict[int, PeerId] = {}  # recent probes given up (seq -> target)
        self._leaving = False  # leave() was called: our own goodbye is not refuted
        # members we know of only from others' rumors (never heard from directly),
        # until they answer or are forgotten: at most _unverified_cap() of them
        self._unverified: set[PeerId] = set()

    # -- a shared start (the simulator's large meshes) ----------------------------

    def adopt_view(self, view: SharedView) -> None:
        """Start from ``view``'s converged mesh, sharing its table copy-on-write.

        What follows is exactly as if each member's record had reached us
        directly at ``view``'s time (and the join news were old): the same
        entries, live list and knowledge of who knows us. Only what this node
        later touches is copied, so N nodes cost far less than N full tables.
        """
        entries: CowDict[PeerId, PeerEntry] = CowDict(view.entries)
        live_at: CowDict[PeerId, int] = CowDict(view.live_at, copy_values=False)
        self.entries, self._live, self._live_at = entries, CowList(view.live), live_at
        self._knows_us = CowSet(view.knows_us)
        if self.self_id in entries:  # we are in the view too: not our own member
            self._track_live(self.self_id, False)
            del entries[self.self_id]

    # -- local state -----------------------------------------------------------

    @property
    def record_seq(self) -> int:
        return self.record.seq if self.record is not None else 0

    def set_record(self, record: Announcement, now: float) -> list[Message]:
        """Our own record changed (a new ``seq``): tell ``fanout`` members at once."""
        changed = self.record is None or record.seq != self.record.seq
        self.record = record
        self.addrs = record.addrs or self.addrs
        if not changed:
            return []
        self._spread(self._self_update(), urgent=False)
        return self._push_urgent(now, (self._self_update(),))

    def _self_update(self) -> Update:
        return Update(
            self.self_id,
            Health.ALIVE,
            self.boot_id,
            self.incarnation,
            self.record_seq,
            self.addrs,
        )

    def _message(self, kind: Kind, dst: PeerId, **kw: Any) -> Message:
        self.stats.messages_out += 1
        intro = self.addrs if dst not in self._knows_us else ()
        updates = self._piggyback()
        entry = self.entries.get(dst)
        if entry is not None and entry.health is Health.SUSPECT:
            # Lifeguard's buddy system: whatever we send a suspect tells it so, so a
            # merely slow peer refutes as soon as it reads its inbox
            notice = self._suspicion(entry, self.self_id)
            updates = (notice, *(u for u in updates if u.peer_id != dst))
        return Message(
            kind,
            self.self_id,
            dst,
            self.boot_id,
            self.incarnation,
            self.record_seq,
            updates=updates,
            src_addrs=intro,
            **kw,
        )

    # -- inputs ----------------------------------------------------------------

    def note_candidate(self, peer_id: PeerId, addrs: tuple[str, ...], now: float) -> bool:
        """Addresses of a peer heard of (mDNS, bootstrap, peer exchange); True if new."""
        if peer_id == self.self_id:
            return False
        entry = self.entries.get(peer_id)
        if entry is None:
            self.entries[peer_id] = PeerEntry(
                peer_id=peer_id, addrs=addrs, state_since=now, health=Health.JOINING
            )
            self._candidates[peer_id] = (now, 0)
            return True
        if addrs and not entry.addrs:
            entry.addrs = addrs
        return False

    def introduce(self, peer_id: PeerId, now: float) -> list[Message]:
        """A first PING to a candidate (it answers, and we learn of each other).

        Unanswered introductions are retried by :meth:`tick`, backing off.
        """
        _, tries = self._candidates.get(peer_id, (now, 0))
        self._candidates[peer_id] = (now, tries + 1)
        return [self._ping(peer_id, now)]

    def note_record(self, record: Announcement, now: float, *, direct: bool) -> list[Message]:
        """A whole record: pushed by its owner (``direct``) or pulled from a holder."""
        subject = record.peer_id
        if subject == self.self_id:
            return []
        self._pulls.pop(subject, None)
        entry = self.entries.get(subject)
        if entry is not None and entry.record is not None and record.order <= entry.record.order:
            self.stats.stale += 1
            return []
        if not direct and entry is not None and record.boot_id < entry.boot_id:
            self.stats.stale += 1
            return []
        self.stats.accepted += 1
        # a restart heard of from others is believed from the record its process signed
        # (the driver checks the signature), not from a rumor (see _apply)
        restarted = (
            not direct
            and not record.goodbye
            and entry is not None
            and entry.boot_id != 0
            and record.boot_id > entry.boot_id
        )
        out: list[Message] = []
        if direct:
            if record.goodbye:
                entry = self._entry(subject, record.addrs, now)
                entry.record = record
                self._set(entry, Health.LEFT, now)
                _rekey(entry, (record.boot_id, record.incarnation))
                # not passed on: a LEFT rumor counts only from the peer itself, which
                # sent its goodbye to every live member
                return []
            out += self._heard(subject, record.boot_id, record.incarnation, 0, now)
        entry = self._entry(subject, record.addrs, now)
        entry.record = record
        entry.addrs = record.addrs or entry.addrs
        entry.record_seq = max(entry.record_seq, record.seq)
        if record.seq >= entry.record_seq:
            self._missing.pop(subject, None)
        if restarted:
            restart = Update(
                subject, Health.ALIVE, record.boot_id, record.incarnation, record.seq, record.addrs
            )
            return out + self._apply(restart, subject, now)  # its own word, signed
        if entry.health is Health.ALIVE:
            self._spread(self._update_of(entry), urgent=False)  # we hold it now: tell others
        return out

    def note_rejected(self) -> None:
        self.stats.rejected += 1

    def note_sent(self, seq: int, now: float) -> None:
        """Our PING ``seq`` left only at ``now`` (the driver first had to dial the
        peer or open a stream to it): its timers count from then. Setting up our own
        connection is not the peer's silence; a peer that never accepts it (frozen)
        is never reported sent, and its probe times out as before."""
        probe = self._probes.get(seq)
        if probe is not None and now > probe.sent_at:
            probe.sent_at = now
        relay = self._relays.get(seq)
        if relay is not None and now > relay.sent_at:
            relay.sent_at = now

    def check(self, peer_id: PeerId, now: float) -> list[Message]:
        """Probe a live member now (e.g. its connection just dropped: killed, or not)."""
        entry = self.entries.get(peer_id)
        if entry is None or peer_id not in self._live_at:
            return []
        if any(p.target == peer_id for p in self._probes.values()):
            return []
        return [self._ping(peer_id, now)]

    def note_unreachable(self, peer_id: PeerId, now: float) -> list[Message]:
        """Our dial to ``peer_id`` was refused: nothing listens there (killed, not frozen).

        A refusal is checked once more at once; ``refusals_for_dead`` in a row,
        with nothing heard in between, is a death. Other send failures are not
        refusals (a loaded peer may fail a stream): the probes judge those.
        """
        entry = self.entries.get(peer_id)
        if entry is None or entry.health in (Health.DEAD, Health.LEFT):
            return []
        entry.refusals += 1
        if entry.record is None and not entry.ever_alive:
            return []  # a candidate that never answered: not a member yet
        if entry.refusals >= self.policy.liveness.refusals_for_dead:
            return self._declare_dead(entry, now)
        return [self._ping(peer_id, now)]  # check again at once: a second refusal is final

    def excuse_gap(self, gap_s: float) -> None:
        """We were not running for ``gap_s``: restart our timers instead of blaming peers."""
        self._probes.clear()
        self._relays.clear()
        self._worse()  # a stall is the plainest sign that we are the slow one
        if self._last_tick is not None:
            self._last_tick += gap_s  # tick must not count the same gap as late again
        for peer_id in self._suspects:
            self._suspects[peer_id] += gap_s
        for entry in self.entries.values():
            if entry.health not in (Health.DEAD, Health.LEFT):
                entry.last_heard += gap_s
                entry.first_heard_in_streak += gap_s

    def receive(self, msg: Message, now: float) -> list[Message]:
        """Apply one message from its (authenticated) sender ``msg.src``."""
        if msg.src == self.self_id or msg.dst != self.self_id:
            return []
        self.stats.messages_in += 1
        entry = self.entries.get(msg.src)
        if msg.src_addrs:
            self.note_candidate(msg.src, msg.src_addrs, now)
        out: list[Message] = []
        dead_notice = entry is not None and self._refutes_nothing(entry, msg)
        out += self._heard(msg.src, msg.src_boot, msg.src_incarnation, msg.src_record_seq, now)
        for update in msg.updates:
            out += self._apply(update, msg.src, now)
        if msg.kind is Kind.PING:
            reply = self._message(Kind.ACK, msg.src, seq=msg.seq, target=self.self_id)
            if dead_notice:
                reply = _with_notice(reply, self._update_of(self.entries[msg.src]))
            elif msg.src_addrs:  # a newcomer: peer exchange, a bounded sample of members
                sample = self._sample_alive(self.policy.exchange_size, exclude=msg.src)
                reply = _with_notice(reply, *(self._update_of(self.entries[p]) for p in sample))
            out.append(reply)
        elif msg.kind is Kind.ACK:
            out += self._on_ack(msg, now)
        elif msg.kind is Kind.PING_REQ and msg.target and msg.target != self.self_id:
            ping = self._ping(msg.target, now)
            self._probes.pop(ping.seq, None)  # not our own probe: no suspicion if it fails
            self._relays[ping.seq] = _Relay(msg.src, msg.seq, msg.target, now)
            out.append(ping)
        elif msg.kind is Kind.PULL:
            record = self.record if msg.target == self.self_id else None
            held = self.entries.get(msg.target)
            if record is None and held is not None:
                record = held.record
            if record is not None:
                out.append(self._message(Kind.RECORD, msg.src, target=msg.target, record=record))
        elif msg.kind is Kind.RECORD and msg.record is not None:
            if msg.record.peer_id == msg.target and msg.target in self._pulls:
                out += self.note_record(msg.record, now, direct=msg.target == msg.src)
            else:
                self.stats.stale += 1  # one we no longer (or never) asked for
        return out

    # -- clock -------------------------------------------------------------------

    def tick(self, now: float) -> list[Message]:
        """Probe, time out probes, conclude suspicions; call every ~0.2 s."""
        out: list[Message] = []
        p = self.policy
        self._late_tick(now)
        stretch = self._stretch
        if self._next_probe_at is None:
            self._next_probe_at = now
        if now >= self._next_probe_at:
            self._next_probe_at += p.interval_s * stretch
            if self._next_probe_at < now:  # we fell behind (a loaded machine): do not catch up
                self._next_probe_at = now + p.interval_s * stretch
            out += self._probe_round(now)
            out += self._retry_candidates(now)
        for seq, probe in list(self._probes.items()):
            age = now - probe.sent_at
            if age >= p.probe_timeout_s * stretch:
                del self._probes[seq]
                self._expired[seq] = probe.target
                if len(self._expired) > 64:  # remember only the recent ones
                    del self._expired[next(iter(self._expired))]
                entry = self.entries.get(probe.target)
                if entry is None:
                    continue
                if entry.health is Health.ALIVE:
                    self._suspect(entry, now, self.self_id)
                    out += self._push_urgent(now, ())
                    out.append(self._message(Kind.GOSSIP, entry.peer_id))  # the buddy notice
                elif entry.health is Health.SUSPECT:
                    self._confirm(entry, self.self_id)  # our own evidence agrees
                elif entry.health is Health.JOINING and entry.ever_alive:
                    out += self._declare_dead(entry, now)  # failed its probation
            elif age >= p.ack_timeout_s * stretch and not probe.indirect_sent:
                probe.indirect_sent = True
                out += self._indirect(probe, seq)
        for seq, relay in list(self._relays.items()):
            if now - relay.sent_at > p.probe_timeout_s * stretch:
                del self._relays[seq]
        for peer_id, since in list(self._suspects.items()):
            entry = self.entries.get(peer_id)
            if entry is None or entry.health is not Health.SUSPECT:
                del self._suspects[peer_id]
            elif now - since >= self.suspicion_timeout_s(peer_id):
                out += self._declare_dead(entry, now)
        for peer_id in list(self._joining):
            entry = self.entries.get(peer_id)
            if entry is None or entry.health is not Health.JOINING:
                self._joining.discard(peer_id)
            elif now - entry.first_heard_in_streak >= p.liveness.hysteresis_s:
                self._joining.discard(peer_id)
                self._set(entry, Health.ALIVE, now)
                self._spread(self._update_of(entry), urgent=False)
        for subject, asked in list(self._pulls.items()):
            if now - asked > p.pull_retry_s:
                del self._pulls[subject]  # lost: news, or the repair below, asks again
        out += self._repair_records(now)
        return out

    def _repair_records(self, now: float) -> list[Message]:
        """Pull records still missing after ``pull_retry_s`` from their owners (a few a tick)."""
        out: list[Message] = []
        for peer_id, since in list(itertools.islice(self._missing.items(), 8)):
            entry = self.entries.get(peer_id)
            if entry is None or entry.health not in _LIVE:
                del self._missing[peer_id]
            elif now - since >= self.policy.pull_retry_s and peer_id not in self._pulls:
                self._missing[peer_id] = now
                self._pulls[peer_id] = now
                self.stats.pulls += 1
                out.append(self._message(Kind.PULL, peer_id, target=peer_id))
            if len(out) >= 2:
                break
        return out

    def forget_tombstones(self, now: float) -> None:
        """Drop dead/left peers and silent candidates older than ``tombstone_s``."""
        limit = self.policy.liveness.tombstone_s
        for entry in list(self.entries.values()):
            ended = entry.health in (Health.DEAD, Health.LEFT)
            never = entry.record is None and not entry.ever_alive
            if (ended or never) and now - entry.state_since > limit:
                del self.entries[entry.peer_id]
                self._unverified.discard(entry.peer_id)
                self._dead.discard(entry.peer_id)
                self._rumors.pop(entry.peer_id, None)
                self._candidates.pop(entry.peer_id, None)

    def leave(self) -> list[Message]:
        """Goodbye rumors to every live member (the service sends the goodbye record)."""
        self._leaving = True
        update = Update(self.self_id, Health.LEFT, self.boot_id, self.incarnation)
        out = []
        for entry in self.entries.values():
            if entry.health in _LIVE and (entry.record is not None or entry.ever_alive):
                msg = self._message(Kind.GOSSIP, entry.peer_id)
                out.append(_with_notice(msg, update))
        return out

    def drain_events(self) -> list[TableEvent]:
        events, self._events = self._events, []
        return events

    # -- views -------------------------------------------------------------------

    def members(self) -> list[PeerEntry]:
        """Alive and suspect peers whose record we hold, sorted by peer id."""
        return live_members(self.entries.values())

    def alive(self) -> list[PeerEntry]:
        return [e for e in self.members() if e.health is Health.ALIVE]

    @property
    def pending_candidates(self) -> int:
        """Candidates introduced to but not yet answering (the service bounds them)."""
        return len(self._candidates)

    def live_ids(self) -> list[PeerId]:
        """Members we believe up (alive, suspect or joining), record or not."""
        return list(self._live)

    def _sample_alive(self, k: int, exclude: PeerId = "") -> list[PeerId]:
        """Up to ``k`` distinct random alive members (O(k) expected, whatever N)."""
        n = len(self._live)
        if n <= 3 * k + 2:
            pool = [p for p in self._live if p != exclude and self._is_alive(p)]
            return self.rng.sample(pool, min(k, len(pool)))
        chosen: set[PeerId] = set()
        for _ in range(8 * k):
            p = self._live[self.rng.randrange(n)]
            if p != exclude and self._is_alive(p):
                chosen.add(p)
                if len(chosen) == k:
                    break
        return sorted(chosen)

    def _is_alive(self, peer_id: PeerId) -> bool:
        return self.entries[peer_id].health is Health.ALIVE

    def _track_live(self, peer_id: PeerId, live: bool) -> None:
        at = self._live_at.get(peer_id)
        if live and at is None:
            self._live_at[peer_id] = len(self._live)
            self._live.append(peer_id)
        elif not live and at is not None:
            last = self._live.pop()
            if last != peer_id:  # move the last one into the hole
                self._live[at] = last
                self._live_at[last] = at
            del self._live_at[peer_id]

    def health_of(self, peer_id: PeerId) -> Health | None:
        entry = self.entries.get(peer_id)
        return None if entry is None else entry.health

    def statistics(self) -> TableStatistics:
        counts = dict.fromkeys(Health, 0)
        for e in self.entries.values():
            counts[e.health] += 1
        return TableStatistics(
            accepted=self.stats.accepted,
            rejected=self.stats.rejected,
            stale=self.stats.stale,
            alive=counts[Health.ALIVE],
            suspect=counts[Health.SUSPECT],
            joining=counts[Health.JOINING],
            dead_or_left=counts[Health.DEAD] + counts[Health.LEFT],
        )

    # -- rules -------------------------------------------------------------------

    def _unverified_cap(self) -> int:
        """Members held on others' word alone: the policy's bound, or as many as we
        verified ourselves (a large mesh's joins spread by rumor still fit)."""
        return max(self.policy.max_unverified, len(self.entries) - len(self._unverified))

    def _entry(self, peer_id: PeerId, addrs: tuple[str, ...], now: float) -> PeerEntry:
        entry = self.entries.get(peer_id)
        if entry is None:
            entry = PeerEntry(peer_id=peer_id, addrs=addrs, state_since=now)
            self.entries[peer_id] = entry
        elif addrs and not entry.addrs:
            entry.addrs = addrs
        return entry

    def _refutes_nothing(self, entry: PeerEntry, msg: Message) -> bool:
        """A dead peer talks to us under the incarnation we buried: tell it so."""
        return entry.health is Health.DEAD and (msg.src_boot, msg.src_incarnation) <= (
            entry.boot_id,
            entry.incarnation,
        )

    def _heard(
        self, peer_id: PeerId, boot: int, incarnation: int, record_seq: int, now: float
    ) -> list[Message]:
        """Direct evidence that ``peer_id`` runs, under ``(boot, incarnation)``."""
        entry = self._entry(peer_id, (), now)
        self._unverified.discard(peer_id)
        key = (boot, incarnation)
        newer = key > (entry.boot_id, entry.incarnation)
        restarted = boot > entry.boot_id and entry.boot_id != 0
        self._knows_us.add(peer_id)
        self._candidates.pop(peer_id, None)
        entry.refusals = 0
        if not entry.ever_alive and entry.health is Health.JOINING and entry.boot_id == 0:
            _rekey(entry, key)
            entry.last_heard = entry.first_heard_in_streak = now
            self._set(entry, Health.ALIVE, now)  # first contact: admit at once
            self._spread(self._update_of(entry, record_seq), urgent=False)
            return self._want_record(entry, record_seq, peer_id, now)
        if entry.health is Health.LEFT and not restarted:
            return []  # a late message from a peer that said goodbye
        if entry.health is Health.DEAD and not newer:
            return []  # it must refute its death first (we tell it in our reply)
        entry.last_heard = now
        if newer:
            _rekey(entry, key)
        if entry.health is Health.LEFT or (entry.health is Health.SUSPECT and newer):
            self._set(entry, Health.ALIVE, now)
            self._spread(self._update_of(entry, record_seq), urgent=False)
        elif entry.health is Health.DEAD:
            self._probation(entry, now)
        elif entry.health is Health.SUSPECT:
            self._set(entry, Health.ALIVE, now)  # we heard it ourselves
        return self._want_record(entry, record_seq, peer_id, now)

    def _apply(self, update: Update, via: PeerId, now: float) -> list[Message]:
        """Apply one rumor; re-spread it if it was news."""
        if update.peer_id == self.self_id:
            # we run: whatever else is said about us (suspect, dead, left) is refuted
            # (under our own boot only: a rumor of a boot we never had is a lie that no
            # incarnation of ours could beat, and that nobody adopts: see below)
            if (
                update.health is not Health.ALIVE
                and not self._leaving
                and update.boot_id == self.boot_id
                and update.incarnation >= self.incarnation
            ):
                # never past what our messages may carry (the wire refuses more)
                self.incarnation = min(update.incarnation + 1, MAX_INCARNATION)
                self.stats.refuted += 1
                self._worse()  # others waited for us in vain: we answer late
                self._spread(self._self_update(), urgent=True)
                out = self._push_urgent(now, ())
                # and straight to whoever accused us and whoever told us: the accuser's
                # timer is the one running out, and a random push may miss it
                told = {m.dst for m in out}
                for peer in dict.fromkeys((update.accuser, via)):
                    if peer and peer != self.self_id and peer not in told and peer in self._live_at:
                        out.append(self._message(Kind.GOSSIP, peer))
                return out
            return []
        if update.health is Health.LEFT and via != update.peer_id:
            # only a peer itself says it left (its goodbye record, or its own message:
            # both come over its authenticated connection); anyone else's word for it
            # would evict a live member. Its goodbye reaches every live member directly,
            # and one it missed finds the peer gone by probing it.
            self.stats.rejected += 1
            return []
        entry = self.entries.get(update.peer_id)
        if entry is None:
            if update.health is not Health.ALIVE:
                return []  # news of a stranger's end: nothing to forget
            if len(self._unverified) >= self._unverified_cap():
                # a member could name any number of made-up peers (and addresses for
                # us to dial): bounded, as peer exchange is; the rest we learn as they
                # reach us, or once the ones we hold have answered or been forgotten
                self.stats.rejected += 1
                return []
            entry = self._entry(update.peer_id, update.addrs, now)
            self._unverified.add(update.peer_id)
        known = (entry.boot_id, entry.incarnation)
        h = update.health
        if update.boot_id > known[0] and known[0] != 0 and via != update.peer_id:
            # a boot we have not seen, on another's word: were it adopted, a member could
            # name a future boot of a live peer and then bury it where its refutations,
            # under its real boot, count for nothing. A restart proves itself by its
            # signed record, pulled from the teller; news of its end waits until then
            return self._pull_restart(entry, via, now) if h is Health.ALIVE else []
        news = False
        if h is Health.ALIVE:
            if update.key > known:
                _rekey(entry, update.key)
                entry.addrs = update.addrs or entry.addrs
                news = True
                if not entry.ever_alive and entry.health is Health.JOINING:
                    entry.last_heard = entry.first_heard_in_streak = now
                    self._set(entry, Health.ALIVE, now)  # a join we heard of
                elif entry.health is Health.SUSPECT or (
                    entry.health is Health.LEFT and update.boot_id > known[0]
                ):
                    self._set(entry, Health.ALIVE, now)
                elif entry.health is Health.DEAD:
                    self._probation(entry, now)
            if update.record_seq > entry.record_seq and update.key >= known:
                news = True
            out = self._want_record(entry, update.record_seq, via, now)
            if news:
                self._spread(self._update_of(entry, update.record_seq), urgent=False)
            return out
        if update.key < known or entry.health is Health.LEFT:
            return []
        if h is Health.SUSPECT:
            accuser = update.accuser or via
            if entry.health is Health.ALIVE:
                _rekey(entry, update.key)
                self._suspect(entry, now, accuser)
                # no push of our own: the accuser pushed it, and it rides on our
                # messages; re-pushed by every adopter, one suspicion cost N x fanout
                # messages, which on a starved machine bred the next suspicions
                return []
            if entry.health is Health.SUSPECT and update.key > known:
                _rekey(entry, update.key)
            if entry.health is Health.SUSPECT and update.key == (entry.boot_id, entry.incarnation):
                self._confirm(entry, accuser)
            if entry.health is Health.JOINING:  # suspected while on probation: out again
                return self._declare_dead(entry, now)
            return []
        if entry.health is Health.DEAD and h is Health.DEAD:
            return []
        _rekey(entry, update.key)
        if h is Health.DEAD:
            return self._declare_dead(entry, now)
        if h is Health.LEFT:  # its own word (see above): not passed on, others heard it too
            self._set(entry, Health.LEFT, now)
        return []

    def _pull_restart(self, entry: PeerEntry, holder: PeerId, now: float) -> list[Message]:
        """Ask ``holder`` for the record of ``entry``'s newer boot (see :meth:`_apply`)."""
        if entry.peer_id in self._pulls:
            return []
        self._pulls[entry.peer_id] = now
        self.stats.pulls += 1
        return [self._message(Kind.PULL, holder, target=entry.peer_id)]

    def _probation(self, entry: PeerEntry, now: float) -> None:
        entry.first_heard_in_streak = now
        self._joining.add(entry.peer_id)
        self._set(entry, Health.JOINING, now)

    def _suspect(self, entry: PeerEntry, now: float, accuser: PeerId) -> None:
        self.stats.suspicions += 1
        self._suspects[entry.peer_id] = now
        self._accusers[entry.peer_id] = {accuser}
        self._set(entry, Health.SUSPECT, now)
        self._spread(self._suspicion(entry, accuser), urgent=True)

    def _confirm(self, entry: PeerEntry, accuser: PeerId) -> None:
        """Another member suspects ``entry`` on its own evidence: the suspicion shortens."""
        accusers = self._accusers.setdefault(entry.peer_id, set())
        if accuser in accusers or len(accusers) > self.policy.confirmations:
            return
        accusers.add(accuser)
        self._spread(self._suspicion(entry, accuser), urgent=False)  # pass it on

    def _suspicion(self, entry: PeerEntry, accuser: PeerId) -> Update:
        return Update(
            entry.peer_id, Health.SUSPECT, entry.boot_id, entry.incarnation, accuser=accuser
        )

    def suspicion_timeout_s(self, peer_id: PeerId) -> float:
        """How long a suspicion of ``peer_id`` lasts before it is a death, for us now.

        Today's ``suspicion_s`` while we keep up; stretched ``1 + local_health`` times
        when we do not, and pulled back towards ``min_suspicion_ratio * suspicion_s``
        by each independent confirmation (Lifeguard: log-scaled, all the way at
        ``confirmations``): many accusers are not all slow.
        """
        p = self.policy
        longest = p.suspicion_s * self._stretch
        shortest = min(longest, p.suspicion_s * p.min_suspicion_ratio)
        others = len(self._accusers.get(peer_id, ())) - 1
        if others <= 0:
            return longest
        share = math.log(others + 1) / math.log(p.confirmations + 1)
        return max(shortest, longest - (longest - shortest) * share)

    # -- local health --------------------------------------------------------------

    @property
    def _stretch(self) -> int:
        return 1 + self.local_health

    def _worse(self) -> None:
        self.local_health = min(self.local_health + 1, self.policy.max_local_health)

    def _better(self) -> None:
        self.local_health = max(self.local_health - 1, 0)

    def _late_tick(self, now: float) -> None:
        """Notice that the driver called ``tick`` late (we were starved) and excuse it.

        The time we were not running does not count against our probes and
        suspicions: they are judged on the time we were awake to hear answers.
        """
        tick_s = self.policy.tick_s
        last, self._last_tick = self._last_tick, now
        if tick_s is None or last is None:
            return
        late_s = now - last - tick_s
        if late_s <= 1.5 * tick_s:  # scheduling jitter, not starvation
            return
        self.stats.late_ticks += 1
        self._worse()
        for probe in self._probes.values():
            probe.sent_at += late_s
        for relay in self._relays.values():
            relay.sent_at += late_s
        for peer_id in self._suspects:
            self._suspects[peer_id] += late_s

    def _declare_dead(self, entry: PeerEntry, now: float) -> list[Message]:
        self._set(entry, Health.DEAD, now)
        self._suspects.pop(entry.peer_id, None)
        self._spread(
            Update(entry.peer_id, Health.DEAD, entry.boot_id, entry.incarnation), urgent=True
        )
        return self._push_urgent(now, ())

    def _set(self, entry: PeerEntry, new: Health, now: float) -> None:
        if entry.health is new:
            return
        old = entry.health
        entry.health = new
        entry.state_since = now
        if new is Health.ALIVE:
            entry.ever_alive = True
            entry.refusals = 0
        if new in (Health.DEAD, Health.LEFT):
            entry.refusals = 0
            self._joining.discard(entry.peer_id)
        if new is Health.DEAD:
            self.stats.deaths += 1
            self._dead.add(entry.peer_id)
        elif old is Health.DEAD:
            self._dead.discard(entry.peer_id)
        if old is Health.SUSPECT:
            self._accusers.pop(entry.peer_id, None)
        self._track_live(entry.peer_id, new in _LIVE and entry.ever_alive)
        self._events.append(TableEvent(entry.peer_id, old, new))

    def _update_of(self, entry: PeerEntry, record_seq: int | None = None) -> Update:
        held = entry.record.seq if entry.record is not None else 0
        seq = held if record_seq is None else min(record_seq, max(held, 0))
        health = entry.health if entry.health is not Health.JOINING else Health.ALIVE
        return Update(entry.peer_id, health, entry.boot_id, entry.incarnation, seq, entry.addrs)

    def _want_record(
        self, entry: PeerEntry, record_seq: int, holder: PeerId, now: float
    ) -> list[Message]:
        """Pull the record when ``holder`` has a newer version than ours."""
        entry.record_seq = max(entry.record_seq, record_seq)
        have = entry.record
        stale = have is None or have.boot_id < entry.boot_id or have.seq < entry.record_seq
        if not stale or entry.health not in _LIVE:
            return []
        self._missing.setdefault(entry.peer_id, now)
        if record_seq <= 0 or (have is not None and have.seq >= record_seq):
            return []  # the teller does not hold a newer one
        if entry.peer_id in self._pulls:
            return []
        self._pulls[entry.peer_id] = now
        self.stats.pulls += 1
        return [self._message(Kind.PULL, holder, target=entry.peer_id)]

    # -- probing -----------------------------------------------------------------

    def _ping(self, peer_id: PeerId, now: float) -> Message:
        self._probe_seq += 1
        self._probes[self._probe_seq] = _Probe(peer_id, now)
        return self._message(Kind.PING, peer_id, seq=self._probe_seq)

    def _probe_round(self, now: float) -> list[Message]:
        out: list[Message] = []
        busy = {p.target for p in self._probes.values()}
        for _ in range(self.policy.fanout(len(self._live))):
            target = self._next_target()
            if target is None:
                break
            if target not in busy:
                busy.add(target)
                out.append(self._ping(target, now))
        # a buried peer gets one ping per interval, so a healed partition heals
        if not self._dead_order:
            self._dead_order = sorted(self._dead)
            self.rng.shuffle(self._dead_order)
        elif (peer := self._dead_order.pop()) in self.entries:
            entry = self.entries[peer]
            if (
                entry.health is Health.DEAD
                and now - entry.state_since >= 5 * self.policy.interval_s
            ):
                # it may be back without knowing it was buried: say so, it will refute
                out.append(_with_notice(self._message(Kind.GOSSIP, peer), self._update_of(entry)))
        return out

    def _retry_candidates(self, now: float) -> list[Message]:
        """Introduce ourselves again to candidates that never answered (1, 2, 4 ... 30 s)."""
        out = []
        for peer_id, (last, tries) in list(self._candidates.items())[:4]:
            entry = self.entries.get(peer_id)
            if entry is None or entry.ever_alive:
                del self._candidates[peer_id]
            elif now - last >= min(30.0, self.policy.interval_s * 2 ** max(tries - 1, 0)):
                out += self.introduce(peer_id, now)
        return out

    def _next_target(self) -> PeerId | None:
        for _ in range(2):
            while self._order:
                peer = self._order.pop()
                entry = self.entries.get(peer)
                if entry is not None and entry.health in _LIVE:
                    return peer
            if not self._live:
                return None
            self._order = list(self._live)
            self.rng.shuffle(self._order)
        return None

    def _indirect(self, probe: _Probe, seq: int) -> list[Message]:
        helpers = self._sample_alive(self.policy.indirect_probes, exclude=probe.target)
        return [self._message(Kind.PING_REQ, h, seq=seq, target=probe.target) for h in helpers]

    def _on_ack(self, msg: Message, now: float) -> list[Message]:
        relay = self._relays.pop(msg.seq, None)
        if relay is not None:  # we pinged for someone else: pass the good news on
            return [
                self._message(Kind.ACK, relay.requester, seq=relay.requester_seq, target=msg.src)
            ]
        probe = self._probes.get(msg.seq)
        if probe is None and self._expired.pop(msg.seq, None) == msg.target:
            self.stats.late_acks += 1
            self._worse()  # we gave up too soon: our clock or our inbox is behind
        if probe is not None and probe.target == msg.target:
            del self._probes[msg.seq]
            if msg.target == msg.src:
                self._better()  # a direct answer in time: we keep up
            if msg.target != msg.src:  # an indirect ack vouches for the target
                entry = self.entries.get(msg.target)
                if entry is not None and entry.health is Health.SUSPECT:
                    self._set(entry, Health.ALIVE, now)
        return []

    # -- dissemination -------------------------------------------------------------

    def _spread(self, update: Update, *, urgent: bool) -> None:
        n = len(self.entries) + 1
        times = self.policy.retransmit_mult * max(1, math.ceil(math.log2(n + 1)))
        self._rumors[update.peer_id] = (update, times)

    def _piggyback(self) -> tuple[Update, ...]:
        if not self._rumors:
            return ()
        # the least-told rumors first: fresh news travels before old news
        chosen = sorted(self._rumors.items(), key=lambda kv: -kv[1][1])[: self.policy.max_updates]
        out = []
        for peer_id, (update, left) in chosen:
            out.append(update)
            if left <= 1:
                del self._rumors[peer_id]
            else:
                self._rumors[peer_id] = (update, left - 1)
        return tuple(out)

    def _push_urgent(self, now: float, extra: Iterable[Update]) -> list[Message]:
        """Push pending news to ``fanout`` members right away."""
        del now
        k = self.policy.fanout(len(self._live)) + 1
        msgs = [self._message(Kind.GOSSIP, p) for p in self._sample_alive(k)]
        extra = tuple(extra)
        return [_with_notice(m, *extra) for m in msgs] if extra else msgs


@dataclass(frozen=True, slots=True)
class SharedView:
    """A converged mesh's member table, shared read-only by nodes that adopt it."""

    entries: dict[PeerId, PeerEntry]
    live: list[PeerId]
    live_at: dict[PeerId, int]
    knows_us: frozenset[PeerId]


def converged_view(records: Iterable[Announcement], now: float) -> SharedView:
    """Every record's owner alive, as if each had reached us directly at ``now``.

    Built by the protocol's own code (a scratch node hears each record), so a
    node that adopts it is in the state a long-finished join would leave it in.
    """
    scratch = Membership("", boot_id=1)  # no real peer has the empty id
    for record in records:
        scratch.note_record(record, now, direct=True)
    return SharedView(
        entries=dict(scratch.entries),
        live=list(scratch._live),
        live_at=dict(scratch._live_at),
        knows_us=frozenset(p for p in scratch.entries if p in scratch._knows_us),
    )


def _rekey(entry: PeerEntry, key: tuple[int, int]) -> None:
    """Adopt a member's incarnation; a new boot starts its record versions afresh."""
    if key[0] != entry.boot_id:
        entry.record_seq = 0
    entry.boot_id, entry.incarnation = key


def _with_notice(msg: Message, *updates: Update) -> Message:
    """``msg`` with ``updates`` put first among its rumors."""
    from dataclasses import replace

    keep = tuple(u for u in msg.updates if u.peer_id not in {x.peer_id for x in updates})
    return replace(msg, updates=(*updates, *keep))


__all__ = [
    "Kind",
    "Membership",
    "MembershipStatistics",
    "Message",
    "SharedView",
    "SwimPolicy",
    "Update",
    "converged_view",
]
