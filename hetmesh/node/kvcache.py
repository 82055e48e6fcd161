"""Admission control and bookkeeping for the KV caches a stage holds.

Each session opened on a stage reserves room for its whole run up front
(prompt + max new tokens, times the stage's KV bytes per token), so a session
that was admitted can never run the device out of memory half way. When the
budget is spent, new sessions are refused with :class:`~hetmesh.errors.Rejected`
("busy"): the gateway waits and retries instead of the stage crashing.

Pure bookkeeping: the cache objects themselves come from a factory (the
stage's ``SessionKV``), the clock is injected, nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hetmesh.errors import InvalidRequest, Rejected


class SizedCache(Protocol):
    @property
    def nbytes(self) -> int: ...


KV = TypeVar("KV", bound=SizedCache)


@dataclass(frozen=True, slots=True)
class KVLimits:
    max_sessions: int
    max_tokens_per_session: int
    budget_bytes: int
    idle_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class KVStatistics:
    sessions: int
    bytes_used: int
    bytes_reserved: int
    budget_bytes: int
    rejected_busy: int
    expired: int


@dataclass(slots=True)
class _Entry(Generic[KV]):
    cache: KV
    reserved_bytes: int
    last_used_s: float


class KVManager(Generic[KV]):
    """Sessions' caches on one stage, bounded in count, tokens and bytes."""

    def __init__(
        self,
        limits: KVLimits,
        *,
        bytes_per_token: int,
        factory: Callable[[], KV],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bytes_per_token < 0:
            raise ValueError("bytes_per_token must be non-negative")
        self._limits = limits
        self._bytes_per_token = bytes_per_token
        self._factory = factory
        self._clock = clock
        self._entries: dict[str, _Entry[KV]] = {}
        self._rejected_busy = 0
        self._expired = 0

    def open(self, session_id: str, max_tokens: int) -> KV:
        """Admit a session that will hold at most ``max_tokens`` tokens.

        Raises ``InvalidRequest`` for an impossible request (more tokens than a
        session may ever hold, a duplicate id) and ``Rejected`` when the stage
        is merely full right now (retry later).
        """
        if session_id in self._entries:
            raise InvalidRequest(f"session {session_id} is already open on this stage")
        if max_tokens <= 0 or max_tokens > self._limits.max_tokens_per_session:
            raise InvalidRequest(
                f"session needs {max_tokens} tokens; this stage allows 1 to "
                f"{self._limits.max_tokens_per_session}"
            )
        need = max_tokens * self._bytes_per_token
        if need > self._limits.budget_bytes:
            raise InvalidRequest(
                f"session needs {need} bytes of KV cache, more than the stage's "
                f"whole budget of {self._limits.budget_bytes}"
            )
        if (
            len(self._entries) >= self._limits.max_sessions
            or self.bytes_reserved + need > self._limits.budget_bytes
        ):
            self._rejected_busy += 1
            raise Rejected(
                f"busy: {len(self._entries)} sessions hold "
                f"{self.bytes_reserved} of {self._limits.budget_bytes} KV bytes"
            )
        entry = _Entry(self._factory(), need, self._clock())
        self._entries[session_id] = entry
        return entry.cache

    def get(self, session_id: str) -> KV:
        """The session's cache, marked as used now: idle time counts from the last call."""
        entry = self._entries.get(session_id)
        if entry is None:
            raise InvalidRequest(f"unknown session {session_id}")
        entry.last_used_s = self._clock()
        return entry.cache

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def close(self, session_id: str) -> bool:
        """Free a session's cache at once; False if it was not open."""
        return self._entries.pop(session_id, None) is not None

    def idle_sessions(self) -> list[str]:
        """Sessions idle longer than the limit (the caller closes them)."""
        cutoff = self._clock() - self._limits.idle_timeout_s
        return [sid for sid, e in self._entries.items() if e.last_used_s < cutoff]

    def expire_idle(self) -> list[str]:
        """Close sessions idle longer than the limit; return their ids."""
        stale = self.idle_sessions()
        for sid in stale:
            del self._entries[sid]
        self.note_expired(len(stale))
        return stale

    def note_expired(self, count: int) -> None:
        self._expired += count

    @property
    def bytes_reserved(self) -> int:
        return sum(e.reserved_bytes for e in self._entries.values())

    def statistics(self) -> KVStatistics:
        return KVStatistics(
            sessions=len(self._entries),
            bytes_used=sum(e.cache.nbytes for e in self._entries.values()),
            bytes_reserved=self.bytes_reserved,
            budget_bytes=self._limits.budget_bytes,
            rejected_busy=self._rejected_busy,
            expired=self._expired,
        )
