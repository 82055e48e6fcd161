"""A relay's bookkeeping, purely: reservations, circuit counts, per-peer bandwidth.

A public member relaying for members behind NAT must not be drained by them:
at most ``max_reservations`` members hold a slot at once (each for
``reservation_ttl_s`` unless renewed), at most ``max_circuits`` circuits run
at once (``max_circuits_per_peer`` touching any one member), and the bytes a
member sends through the relay are paced to ``bandwidth_bps`` by a token
bucket. Times are passed in (``now``, seconds on any monotonic clock); no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLimits:
    max_reservations: int = 32
    reservation_ttl_s: float = 300.0
    max_circuits: int = 64
    max_circuits_per_peer: int = 8
    bandwidth_bps: float = 64e6  # bytes/s one member may send through the relay
    burst_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "max_circuits_per_peer", "burst_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"RelayLimits.{name} must be at least 1")
        if self.reservation_ttl_s <= 0 or self.bandwidth_bps <= 0:
            raise ValueError("RelayLimits: reservation_ttl_s and bandwidth_bps must be positive")


@dataclass(slots=True)
class TokenBucket:
    """``rate`` bytes/s with ``burst`` bytes of credit; :meth:`take` says how long to wait."""

    rate: float
    burst: float
    tokens: float | None = None  # None until first used (then it starts full)
    at: float = 0.0

    def take(self, n: int, now: float) -> float:
        """Charge ``n`` bytes at ``now``; the seconds to wait before sending them (0: at once)."""
        tokens = self.burst if self.tokens is None else self.tokens
        if self.tokens is not None:
            tokens = min(self.burst, tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens = tokens - n  # negative: bytes owed, paid for by waiting
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


@dataclass(slots=True)
class RelayBook:
    """Who holds a slot, which circuits run, and each member's bandwidth bucket."""

    limits: RelayLimits
    reservations: dict[str, float] = field(default_factory=dict)  # peer -> expiry
    circuits: dict[str, int] = field(default_factory=dict)  # peer -> circuits touching it
    open_circuits: int = 0
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    refused: int = 0

    def _expire(self, now: float) -> None:
        for peer in [p for p, until in self.reservations.items() if until <= now]:
            del self.reservations[peer]
            if not self.circuits.get(peer):
                self.buckets.pop(peer, None)

    def reserve(self, peer: str, now: float) -> str | None:
        """Give (or renew) ``peer`` a slot until ``now + ttl``; the reason if refused."""
        self._expire(now)
        if peer not in self.reservations and len(self.reservations) >= self.limits.max_reservations:
            self.refused += 1
            return f"relay full: {self.limits.max_reservations} reservations held"
        self.reservations[peer] = now + self.limits.reservation_ttl_s
        return None

    def release(self, peer: str) -> None:
        self.reservations.pop(peer, None)

    def open(self, src: str, dst: str, now: float) -> str | None:
        """Count a circuit ``src`` -> ``dst`` (``dst`` must hold a slot); the reason if refused."""
        self._expire(now)
        reason = None
        if dst not in self.reservations:
            reason = "the destination holds no reservation on this relay"
        elif src == dst:
            reason = "a circuit to oneself"
        elif self.open_circuits >= self.limits.max_circuits:
            reason = f"relay busy: {self.limits.max_circuits} circuits open"
        elif max(self.circuits.get(src, 0), self.circuits.get(dst, 0)) >= (
            self.limits.max_circuits_per_peer
        ):
            reason = f"at most {self.limits.max_circuits_per_peer} circuits per member"
        if reason is not None:
            self.refused += 1
            return reason
        self.open_circuits += 1
        for peer in (src, dst):
            self.circuits[peer] = self.circuits.get(peer, 0) + 1
        return None

    def close(self, src: str, dst: str) -> None:
        self.open_circuits = max(0, self.open_circuits - 1)
        for peer in (src, dst):
            left = self.circuits.get(peer, 0) - 1
            if left > 0:
                self.circuits[peer] = left
            else:
                self.circuits.pop(peer, None)

    def charge(self, peer: str, n: int, now: float) -> float:
        """Seconds ``peer`` must wait before ``n`` more bytes go through (its bucket)."""
        bucket = self.buckets.get(peer)
        if bucket is None:
            bucket = TokenBucket(self.limits.bandwidth_bps, float(self.limits.burst_bytes))
            self.buckets[peer] = bucket
        return bucket.take(n, now)


__all__ = ["RelayBook", "RelayLimits", "TokenBucket"]
