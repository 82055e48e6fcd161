"""The peer table: membership and liveness as a pure state machine.

No I/O and no clock of its own: every method takes ``now`` (monotonic
seconds), so the rules are table-tested. The discovery service feeds it
announcements, dial failures and goodbyes and asks it who is alive.

Health of a peer, judged over a window rather than one probe:

- ``alive``: heard from within ``suspect_after_s`` (3 announcement intervals);
- ``suspect``: silent longer than that (still in the table, not routed to);
- ``dead``: silent for ``dead_after_s``, or suspect and refused our connection
  ``refusals_for_dead`` times in a row (a killed process refuses at once; a
  frozen one only goes silent);
- ``joining``: heard again after being dead, re-admitted as ``alive`` only
  after ``hysteresis_s`` of steady announcements (flapping peers stay out).

Dead peers and peers that said goodbye leave the live table; a tombstone
remembers their last ``(boot_id, seq)`` so late records are not mistaken for
a return, and a restarted process (new ``boot_id``) comes back through
``joining`` like any flapping peer (a goodbye tombstone lets it in at once).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from hetmesh.discovery.wire import Announcement
from hetmesh.resources import PeerId


class Health(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    JOINING = "joining"
    LEFT = "left"


@dataclass(frozen=True, slots=True)
class LivenessPolicy:
    interval_s: float = 1.0
    suspect_after_intervals: int = 3
    dead_after_s: float = 7.0
    refusals_for_dead: int = 2
    hysteresis_s: float = 3.0
    tombstone_s: float = 300.0

    @property
    def suspect_after_s(self) -> float:
        return self.interval_s * self.suspect_after_intervals


@dataclass(slots=True)
class PeerEntry:
    peer_id: PeerId
    record: Announcement | None = None
    addrs: tuple[str, ...] = ()
    health: Health = Health.JOINING
    last_heard: float = 0.0
    first_heard_in_streak: float = 0.0
    refusals: int = 0
    state_since: float = 0.0
    ever_alive: bool = False
    # the membership protocol's view (hetmesh.discovery.membership): the peer's
    # incarnation (boot_id, incarnation) and the newest record version heard of
    boot_id: int = 0
    incarnation: int = 0
    record_seq: int = 0


def live_members(entries: Iterable[PeerEntry]) -> list[PeerEntry]:
    """Alive and suspect peers whose record we hold, sorted by peer id."""
    live = (Health.ALIVE, Health.SUSPECT)
    return sorted(
        (e for e in entries if e.health in live and e.record is not None), key=lambda e: e.peer_id
    )


@dataclass(frozen=True, slots=True)
class TableEvent:
    peer_id: PeerId
    old: Health | None
    new: Health


@dataclass(frozen=True, slots=True)
class TableStatistics:
    accepted: int
    rejected: int
    stale: int
    alive: int
    suspect: int
    joining: int
    dead_or_left: int


@dataclass(slots=True)
class PeerTable:
    """Peers of one node, keyed by peer id (our own id never enters)."""

    self_id: PeerId
    policy: LivenessPolicy = field(default_factory=LivenessPolicy)
    entries: dict[PeerId, PeerEntry] = field(default_factory=dict)
    accepted: int = 0
    rejected: int = 0
    stale: int = 0

    # -- inputs --------------------------------------------------------------

    def note_rejected(self) -> None:
        self.rejected += 1

    def note_candidate(self, peer_id: PeerId, addrs: tuple[str, ...], now: float) -> bool:
        """Remember addresses of a peer heard of (mDNS, bootstrap, peer exchange).

        Returns True if the peer is new to us (worth dialling). Candidates are
        not members until they announce themselves.
        """
        if peer_id == self.self_id:
            return False
        entry = self.entries.get(peer_id)
        if entry is None:
            self.entries[peer_id] = PeerEntry(
                peer_id=peer_id, addrs=addrs, state_since=now, health=Health.JOINING
            )
            return True
        if addrs and not entry.addrs:
            entry.addrs = addrs
        return False

    def note_announcement(self, record: Announcement, now: float) -> list[TableEvent]:
        """Apply a validated announcement from its (authenticated) sender."""
        if record.peer_id == self.self_id:
            return []
        entry = self.entries.get(record.peer_id)
        if entry is None:
            entry = PeerEntry(peer_id=record.peer_id, state_since=now)
            self.entries[record.peer_id] = entry
        elif entry.record is not None and record.order <= entry.record.order:
            self.stale += 1
            return []
        self.accepted += 1
        previous = entry.record
        entry.record = record
        entry.addrs = record.addrs or entry.addrs
        entry.refusals = 0
        if record.goodbye:
            entry.last_heard = now
            return self._move(entry, Health.LEFT, now)
        restarted = previous is not None and previous.boot_id != record.boot_id
        gap = now - entry.last_heard
        entry.last_heard = now
        if previous is None:  # first contact: admit at once
            entry.first_heard_in_streak = now
            return self._move(entry, Health.ALIVE, now)
        if entry.health in (Health.DEAD, Health.LEFT) or (
            entry.health is Health.JOINING and gap > self.policy.suspect_after_s
        ):
            entry.first_heard_in_streak = now
            if entry.health is Health.LEFT and restarted:
                return self._move(entry, Health.ALIVE, now)  # a clean restart
            return self._move(entry, Health.JOINING, now)
        if entry.health is Health.JOINING:
            if now - entry.first_heard_in_streak >= self.policy.hysteresis_s:
                return self._move(entry, Health.ALIVE, now)
            return []
        return self._move(entry, Health.ALIVE, now)

    def note_refused(self, peer_id: PeerId, now: float) -> list[TableEvent]:
        """Our dial to the peer was refused (nothing listens at its address)."""
        entry = self.entries.get(peer_id)
        if entry is None:
            return []
        entry.refusals += 1
        return self.tick(now)

    def excuse_gap(self, gap_s: float) -> None:
        """We ourselves were not running for ``gap_s`` (SIGSTOP, a suspended VM).

        Silence we could not have heard is not the peers' fault: shift their
        last-heard times so the window restarts instead of declaring the whole
        mesh dead at once.
        """
        for entry in self.entries.values():
            if entry.health not in (Health.DEAD, Health.LEFT):
                entry.last_heard += gap_s

    # -- clock ---------------------------------------------------------------

    def tick(self, now: float) -> list[TableEvent]:
        """Re-judge every peer's health at ``now``; forget old tombstones."""
        events: list[TableEvent] = []
        p = self.policy
        for entry in list(self.entries.values()):
            silent = now - entry.last_heard
            if entry.health in (Health.DEAD, Health.LEFT):
                if now - entry.state_since > p.tombstone_s:
                    del self.entries[entry.peer_id]
                continue
            if entry.record is None:  # a candidate that never announced
                if now - entry.state_since > p.tombstone_s:
                    del self.entries[entry.peer_id]
                continue
            if silent >= p.dead_after_s or (
                silent >= p.suspect_after_s and entry.refusals >= p.refusals_for_dead
            ):
                events += self._move(entry, Health.DEAD, now)
            elif silent >= p.suspect_after_s and entry.health is Health.ALIVE:
                events += self._move(entry, Health.SUSPECT, now)
            elif silent >= p.suspect_after_s and entry.health is Health.JOINING:
                events += self._move(entry, Health.DEAD, now)
        return events

    def _move(self, entry: PeerEntry, new: Health, now: float) -> list[TableEvent]:
        if entry.health is new:
            return []
        old = entry.health
        entry.health = new
        entry.state_since = now
        if new is Health.ALIVE:
            entry.ever_alive = True
        if new in (Health.DEAD, Health.LEFT):
            entry.refusals = 0
        return [TableEvent(entry.peer_id, old, new)]

    # -- views ---------------------------------------------------------------

    def members(self) -> list[PeerEntry]:
        """Peers in the live table (alive or suspect), sorted by peer id."""
        return live_members(self.entries.values())

    def alive(self) -> list[PeerEntry]:
        return [e for e in self.members() if e.health is Health.ALIVE]

    def dial_targets(self) -> list[PeerEntry]:
        """Peers worth sending announcements to: members, joiners, candidates, recent dead."""
        return sorted(
            (e for e in self.entries.values() if e.health is not Health.LEFT),
            key=lambda e: e.peer_id,
        )

    def health_of(self, peer_id: PeerId) -> Health | None:
        entry = self.entries.get(peer_id)
        return None if entry is None else entry.health

    def statistics(self) -> TableStatistics:
        counts = {h: 0 for h in Health}
        for e in self.entries.values():
            counts[e.health] += 1
        return TableStatistics(
            accepted=self.accepted,
            rejected=self.rejected,
            stale=self.stale,
            alive=counts[Health.ALIVE],
            suspect=counts[Health.SUSPECT],
            joining=counts[Health.JOINING],
            dead_or_left=counts[Health.DEAD] + counts[Health.LEFT],
        )


__all__ = ["Health", "LivenessPolicy", "PeerEntry", "PeerTable", "TableEvent", "TableStatistics"]
