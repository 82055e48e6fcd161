"""The membership protocol's messages and timings (pure records, no behaviour).

See :mod:`hetmesh.discovery.membership` for the protocol that uses them and
:mod:`hetmesh.discovery.membership_wire` for their encoding.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from hetmesh.discovery.table import Health, LivenessPolicy
from hetmesh.discovery.wire import MAX_COUNTER, MAX_INCARNATION, Announcement
from hetmesh.resources import PeerId


class Kind(enum.IntEnum):
    """Message tags on the wire (stable integers, never names)."""

    PING = 1
    ACK = 2
    PING_REQ = 3
    GOSSIP = 4  # updates only, pushed at once on urgent news
    PULL = 5  # "send me your copy of target's record"
    RECORD = 6  # the answer: a whole record


@dataclass(frozen=True, slots=True)
class Update:
    """A rumor about one member: its state under incarnation ``(boot_id, incarnation)``."""

    peer_id: PeerId
    health: Health  # ALIVE, SUSPECT, DEAD or LEFT
    boot_id: int
    incarnation: int
    record_seq: int = 0  # the newest record version the teller holds (ALIVE only)
    addrs: tuple[str, ...] = ()
    accuser: PeerId = ""  # SUSPECT only: whose own probe failed (independent confirmations)

    @property
    def key(self) -> tuple[int, int]:
        return (self.boot_id, self.incarnation)


@dataclass(frozen=True, slots=True)
class Message:
    """One protocol message. The header describes the sender (direct evidence)."""

    kind: Kind
    src: PeerId
    dst: PeerId
    src_boot: int
    src_incarnation: int
    src_record_seq: int
    seq: int = 0  # probe number (PING, ACK, PING_REQ)
    target: PeerId = ""  # PING_REQ: whom to ping; ACK: who answered; PULL/RECORD: whose record
    updates: tuple[Update, ...] = ()
    src_addrs: tuple[str, ...] = ()  # only while the receiver may not know how to reach us
    record: Announcement | None = None  # RECORD only
    # RECORD only, filled by the node's service: the record's exact bytes and its
    # origin's signature over them (hetmesh.discovery.signing); empty in the simulator
    record_blob: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True, slots=True)
class SwimPolicy:
    """Timings and bounds; the defaults keep today's liveness bounds (see the module doc)."""

    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    ack_timeout_s: float = 1.0
    indirect_probes: int = 3
    min_fanout: int = 1
    max_fanout: int = 8
    retransmit_mult: int = 3
    max_updates: int = 8  # rumors per message
    pull_retry_s: float = 2.0
    exchange_size: int = 16  # members told to a newcomer in one reply
    # members we may hold on others' rumors alone (not yet heard from ourselves),
    # or as many as we verified if more: made-up ALIVE rumors cannot grow the table
    # (nor the addresses we dial) past that
    max_unverified: int = 256
    # local health (Lifeguard): the cadence the driver promises to call ``tick`` at;
    # a tick much later than that means we were starved, not that peers went quiet.
    # None (the default for hand-driven tests): no late-timer detection
    tick_s: float | None = None
    max_local_health: int = 4  # our timeouts stretch up to (1 + this) times
    # a stretched suspicion shrinks back towards min_suspicion_ratio * suspicion_s as up
    # to ``confirmations`` other members independently suspect the same peer; below 1.0
    # it would also cut today's window (in the simulator, 0.5 turned 4-5 s stalls into
    # false deaths: every member that probes a stalled peer is an accuser)
    confirmations: int = 3
    min_suspicion_ratio: float = 1.0

    @property
    def interval_s(self) -> float:
        return self.liveness.interval_s

    @property
    def probe_timeout_s(self) -> float:
        # a probe that started up to one interval late still suspects within today's window
        return max(self.ack_timeout_s * 2, self.liveness.suspect_after_s - self.interval_s)

    @property
    def suspicion_s(self) -> float:
        return self.liveness.dead_after_s - self.liveness.suspect_after_s

    def fanout(self, members: int) -> int:
        """Members probed per interval: about log2(N)/2, at least one, bounded."""
        wanted = math.ceil(math.log2(members + 1) / 2) if members > 0 else 0
        return max(min(wanted, self.max_fanout, members), min(self.min_fanout, members))


__all__ = ["MAX_COUNTER", "MAX_INCARNATION", "Kind", "Message", "SwimPolicy", "Update"]
