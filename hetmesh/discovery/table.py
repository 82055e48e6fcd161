"""The peer table's records: a peer's entry, its health and the liveness policy.

The membership core (:class:`hetmesh.discovery.membership.Membership`) keeps
the table and applies the rules below; these are the types it and its
readers share.

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
from dataclasses import dataclass

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


__all__ = [
    "Health",
    "LivenessPolicy",
    "PeerEntry",
    "TableEvent",
    "TableStatistics",
    "live_members",
]
