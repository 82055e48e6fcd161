"""How many shard requests a holder answers at once: per requesting peer and in all.

Each request read off disk is held in memory until its reply is written, so a
requester that opens many requests, or never reads its replies, must not hold
more than a few: a request past a cap is refused at once (the fetcher tries
another holder, or this one a moment later), and every reply is written within
a deadline set by its size (:func:`reply_deadline_s`), after which its stream or
link is dropped and its place given back. Pure bookkeeping: no trio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from hetmesh.errors import LocalProtocolError
from hetmesh.resources import PeerId

MAX_REQUESTS_PER_PEER: Final = 4  # a fetcher asks for 4 tensors at once (Shards' parallel)
MAX_REQUESTS: Final = 16
MIN_REPLY_RATE_BPS: Final = 256 * 1024  # a reply written slower than this has stalled
REPLY_MARGIN_S: Final = 30.0
BUSY: Final = "busy: too many shard requests in flight"


def reply_deadline_s(nbytes: int) -> float:
    """How long writing a reply of ``nbytes`` may take before its requester is dropped."""
    return REPLY_MARGIN_S + nbytes / MIN_REPLY_RATE_BPS


@dataclass(slots=True)
class ServeCaps:
    """Requests in flight: at most ``per_peer`` from one peer, ``total`` in all."""

    per_peer: int = MAX_REQUESTS_PER_PEER
    total: int = MAX_REQUESTS
    _held: dict[PeerId, int] = field(default_factory=dict)
    _count: int = 0
    refused: int = 0

    def take(self, peer: PeerId) -> bool:
        """A place for one request of ``peer``; False (counted) past a cap."""
        held = self._held.get(peer, 0)
        if held >= self.per_peer or self._count >= self.total:
            self.refused += 1
            return False
        self._held[peer] = held + 1
        self._count += 1
        return True

    def give_back(self, peer: PeerId) -> None:
        held = self._held.get(peer, 0)
        if held <= 0:
            raise LocalProtocolError(f"no shard request of {peer} to give back")
        if held == 1:
            del self._held[peer]
        else:
            self._held[peer] = held - 1
        self._count -= 1

    @property
    def in_flight(self) -> int:
        return self._count


__all__ = [
    "BUSY",
    "MAX_REQUESTS",
    "MAX_REQUESTS_PER_PEER",
    "ServeCaps",
    "reply_deadline_s",
]
