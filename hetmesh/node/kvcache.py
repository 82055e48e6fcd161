"""Admission control, preemption and bookkeeping for the KV caches a stage holds.

A stage's KV budget is one pool of fixed-size blocks
(:mod:`hetmesh.partition.blocks`). A session is admitted by the blocks it
needs *now* — its prompt, plus a small reserve left free for the sessions
already running (1/32 of the pool by default) — not by the worst case of
``prompt + max_tokens``; it gets more blocks as its tokens arrive
(:meth:`KVManager.grow`). When the pool runs out mid-generation, the newest
session holding blocks is preempted: its blocks are freed and the stage
server tells its gateway, which resumes it later by replaying its token
history. With ``reserve_whole`` the old policy is kept (every session holds
``max_tokens`` up front), for comparison.

Refusals: :class:`~hetmesh.errors.InvalidRequest` for a session no pool of
this stage could ever hold (named against the KV limit), and
:class:`~hetmesh.errors.Rejected` ("busy") when the stage is merely full
right now — the gateway waits and retries.

First come, first served: a session refused for want of blocks or of a
session slot keeps its place in a bounded wait queue (at most
:data:`MAX_WAITERS`), and a session is admitted only if it leaves free the
blocks and slots of every waiter ahead of it — so small requests cannot
overtake and starve a large one, as the gateway retries them all. The queue
is ordered by the request's :class:`Stamp`, not by arrival here: the gateway
stamps a request once (the wall time of its first attempt and a tie-break
id) and sends the same stamp to every stage on every try, so every stage of
a pipeline puts the same request first. Ordered by arrival, two requests
opened at once on two stages could each head one stage's queue and wait on
the other, round after round (a livelock). A stamped session its gateway
closes before it ever ran (another stage refused it) keeps its place here
too: else the two could swap stages each round instead. A stamp cannot buy a place
without bound: one from the future (beyond :data:`STAMP_SLACK_S`) counts as
now, one older than ``stamp_max_age_s`` as that old. A waiter cannot wedge
the stage: it leaves the queue when admitted, when its gateway stops
retrying (not seen for ``waiter_stale_s``), or after ``waiter_max_s`` in
line (the gateway's admission wait) — after which it queues again as a
newcomer, its stamp ignored.

Pure bookkeeping: the caches come from a factory (the stage's ``SessionKV``
over its pool), the clock is injected, nothing here does I/O. Called from the
trio thread only.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hetmesh.errors import InvalidRequest, Rejected
from hetmesh.partition.blocks import BLOCK_TOKENS, blocks_for


class PagedCache(Protocol):
    """What the manager needs of a session's cache (``SessionKV``)."""

    @property
    def length(self) -> int: ...

    scope: str  # whose sessions share its blocks (its gateway's peer id)

    def attach(self, hashes: Sequence[int], max_tokens: int) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def reserve(self, tokens: int) -> bool: ...

    def free(self) -> None: ...


class BlockPool(Protocol):
    """What the manager needs of the pool (``KVPool``)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def block_tokens(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def cached_blocks(self) -> int: ...


KV = TypeVar("KV", bound=PagedCache)


@dataclass(frozen=True, slots=True)
class KVLimits:
    max_sessions: int
    max_tokens_per_session: int
    budget_bytes: int
    idle_timeout_s: float = 300.0
    # left free at admission for running sessions to grow into; None: 1/32 of the pool
    # (at least one block), which cut preemptions 6x for 2 % fewer sessions (bench/kv.py)
    reserve_blocks: int | None = None
    reserve_whole: bool = False  # the old policy: hold prompt + max_tokens up front
    # first come, first served: a refused session's place is kept while its gateway
    # retries (it backs off to 1 s between tries) and for the gateway's admission wait
    waiter_stale_s: float = 5.0
    waiter_max_s: float = 30.0
    # the oldest a request's stamp counts as: past the gateway's wait to resume a
    # preempted session (300 s), so only a forged stamp is clamped
    stamp_max_age_s: float = 600.0
    # first come, first served across retries, in the order of the gateway's stamps
    # (False: no wait queue, a later request may overtake a waiting one)
    fcfs: bool = True


MAX_WAITERS = 64  # refused sessions whose place is kept, per stage
STAMP_SLACK_S = 1.0  # how far a stamp may lie in the future (clock skew) before it is now


@dataclass(frozen=True, slots=True)
class Stamp:
    """A request's place in every stage's queue: when its gateway first tried it
    (wall-clock seconds) and a tie-break id, the same on every open and retry."""

    at_s: float
    ticket: str


def stage_kv_limits(
    *,
    max_context_tokens: int,
    max_sessions: int | None,
    planned_sessions: int,
    pool_tokens: int | None,
    kv_bytes_per_token: int,
    idle_timeout_s: float,
    block_tokens: int = BLOCK_TOKENS,
) -> KVLimits:
    """The KV limits of one stage from a node's settings.

    The pool is ``pool_tokens`` when given, else the KV memory the planner
    budgets for the stage: ``max_context_tokens`` for each of ``max_sessions``
    (or ``planned_sessions`` when that is not set) sessions. ``max_sessions``
    caps the sessions open at once; without it the only bound is the pool's
    blocks, so many short sessions fit where few long ones would (admission by use).
    """
    tokens = pool_tokens or max_context_tokens * (max_sessions or planned_sessions)
    cap = max_sessions or max(1, blocks_for(tokens, block_tokens))
    return KVLimits(
        max_sessions=cap,
        max_tokens_per_session=max_context_tokens,
        budget_bytes=tokens * max(1, kv_bytes_per_token),
        idle_timeout_s=idle_timeout_s,
    )


@dataclass(frozen=True, slots=True)
class KVStatistics:
    sessions: int
    bytes_used: int
    bytes_reserved: int
    budget_bytes: int
    rejected_busy: int
    expired: int
    blocks_total: int = 0
    blocks_free: int = 0  # free, or cached and held by no session (reusable)
    preempted: int = 0
    blocks_cached: int = 0  # named in the prefix cache (held by sessions or idle)
    prefix_queried_tokens: int = 0  # prompt tokens new sessions looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, found cached (their prefill skipped)
    migrations: int = 0  # sessions whose KV moved here from another stage (no replay)
    migrated_bytes: int = 0  # bytes of KV those migrations brought
    migrations_out: int = 0  # sessions whose KV this stage sent to another
    waiting: int = 0  # refused sessions keeping their place in the admission queue

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by sessions (free and idle cached ones excluded)."""
        return self.blocks_total - self.blocks_free

    @property
    def prefix_hit_rate(self) -> float:
        queried = self.prefix_queried_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0


KV_COUNTERS = (
    "blocks_total",
    "blocks_in_use",
    "blocks_free",
    "blocks_cached",
    "prefix_queried_tokens",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "preempted",
    "migrations",
    "migrated_bytes",
    "migrations_out",
    "waiting",
)


def kv_counters(stats: KVStatistics) -> dict[str, float]:
    """A stage's KV figures as flat ``kv_*`` counters (announced, shown by status, /metrics)."""
    return {f"kv_{name}": getattr(stats, name) for name in KV_COUNTERS}


@dataclass(slots=True)
class _Entry(Generic[KV]):
    cache: KV
    last_used_s: float
    # its request's place in line (stamped requests only) and the fresh blocks it
    # needed, kept should its gateway close it before it ever runs (see close)
    place: _Waiter | None = None
    used: bool = False  # a step has read it (``get``)


@dataclass(slots=True)
class _Waiter:
    blocks: int  # fresh blocks it needed when last refused
    first_s: float
    last_s: float
    key: tuple[float, int, str]  # its place: the stamp as this stage bounds it


LAPSED_MEMORY = 4 * MAX_WAITERS  # tickets that waited out waiter_max_s, remembered


class KVManager(Generic[KV]):
    """Sessions' caches on one stage: bounded in count, admitted and grown by blocks."""

    def __init__(
        self,
        limits: KVLimits,
        *,
        pool: BlockPool,
        factory: Callable[[], KV],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._limits = limits
        self._pool = pool
        self._factory = factory
        self._clock = clock
        self._wall = wall  # the clock stamps are read against (gateways' wall clocks)
        self._entries: dict[str, _Entry[KV]] = {}  # in admission order: oldest first
        self._waiters: dict[str, _Waiter] = {}  # refused requests by ticket
        # tickets whose place lapsed after waiter_max_s: they queue again as newcomers
        self._lapsed: OrderedDict[str, None] = OrderedDict()
        self._arrivals = 0  # orders unstamped requests first seen in the same instant
        self._rejected_busy = 0
        self._expired = 0
        self._preempted = 0
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._migrations = self._migrated_bytes = self._migrations_out = 0

    @property
    def reserve_blocks(self) -> int:
        """Blocks a new session must leave free (the running ones grow into them)."""
        if self._limits.reserve_blocks is not None:
            return self._limits.reserve_blocks
        return max(1, self._pool.num_blocks // 32)

    @property
    def pool_tokens(self) -> int:
        return self._pool.num_blocks * self._pool.block_tokens

    def open(
        self,
        session_id: str,
        max_tokens: int,
        prompt_tokens: int = 0,
        prefix_hashes: Sequence[int] = (),
        stamp: Stamp | None = None,
        scope: str = "",
    ) -> KV:
        """Admit a session of ``prompt_tokens`` that will hold at most ``max_tokens``.

        ``stamp`` is the request's place in line (the same on every stage and
        retry); without one it is the session id, first seen now.

        Holds the prompt's blocks at once: first the cached blocks its
        ``prefix_hashes`` (:func:`~hetmesh.partition.prefix.block_hashes` of
        the prompt) find, never all of the prompt (one token at least is fed),
        then fresh ones for the rest; ``cache.length`` is where its prefill
        starts. ``scope`` (its gateway's peer id) is whose sessions share its
        blocks (:func:`~hetmesh.partition.prefix.scoped`). Raises
        ``InvalidRequest`` for an impossible request (more tokens than a
        session may ever hold or than the whole pool, a
        duplicate id) and ``Rejected`` when the stage is merely full right
        now (retry later).
        """
        if session_id in self._entries:
            raise InvalidRequest(f"session {session_id} is already open on this stage")
        if max_tokens <= 0 or max_tokens > self._limits.max_tokens_per_session:
            raise InvalidRequest(
                f"session needs {max_tokens} tokens; this stage allows 1 to "
                f"{self._limits.max_tokens_per_session}"
            )
        if not 0 <= prompt_tokens <= max_tokens:
            raise InvalidRequest(f"prompt of {prompt_tokens} tokens outside [0, {max_tokens}]")
        if max_tokens > self.pool_tokens:
            raise InvalidRequest(
                f"session may need {max_tokens} tokens of KV cache, more than the stage's "
                f"whole KV pool of {self.pool_tokens} tokens ({self._pool.num_blocks} blocks "
                f"of {self._pool.block_tokens}; KV budget {self._limits.budget_bytes} bytes)"
            )
        if len(prefix_hashes) > blocks_for(max_tokens, self._pool.block_tokens):
            raise InvalidRequest(f"{len(prefix_hashes)} prefix hashes for {max_tokens} tokens")
        now = max_tokens if self._limits.reserve_whole else prompt_tokens
        cache = self._factory()
        cache.scope = scope
        cached = 0
        if prefix_hashes and not self._limits.reserve_whole:
            cached = cache.attach(prefix_hashes, prompt_tokens - 1)
        # attached blocks are held already (and no longer counted free)
        size = self._pool.block_tokens
        need = blocks_for(now, size) - blocks_for(cached, size)
        reserve = 0 if self._limits.reserve_whole else self.reserve_blocks
        ticket = stamp.ticket if stamp is not None else session_id
        if self._limits.fcfs:
            self._purge()
        key = self._key(ticket, stamp)
        ahead_blocks, ahead_sessions = self._ahead_of(ticket, key)
        if (
            len(self._entries) + ahead_sessions >= self._limits.max_sessions
            or need + reserve + ahead_blocks > self._pool.free_blocks
        ):
            cache.free()
            self._rejected_busy += 1
            self._wait(ticket, key, need + reserve <= self._pool.num_blocks, need)
            raise Rejected(
                f"busy: {len(self._entries)} sessions hold "
                f"{self._pool.num_blocks - self._pool.free_blocks} of "
                f"{self._pool.num_blocks} KV blocks"
            )
        if prefix_hashes and not self._limits.reserve_whole:
            self._queried_tokens += min(len(prefix_hashes), (prompt_tokens - 1) // size) * size
            self._hit_tokens += cached
        if not cache.reserve(now):  # cannot happen: the blocks were counted free above
            cache.free()
            raise Rejected("busy: the KV pool is full")
        waited = self._waiters.pop(ticket, None)
        place = None
        if stamp is not None and self._limits.fcfs:
            first_s = waited.first_s if waited is not None else self._clock()
            place = _Waiter(need, first_s, first_s, key)
        self._entries[session_id] = _Entry(cache, self._clock(), place)
        return cache

    def _key(self, ticket: str, stamp: Stamp | None) -> tuple[float, int, str]:
        """The place in line of ``ticket``: kept if it waits already, else its stamp
        bounded to [now - stamp_max_age_s, now + STAMP_SLACK_S] (now when unstamped,
        forged beyond the slack, not a number, or its earlier place lapsed)."""
        waiter = self._waiters.get(ticket)
        if waiter is not None:
            return waiter.key
        now = self._wall()
        if stamp is None or ticket in self._lapsed:
            self._arrivals += 1
            return now, self._arrivals, ticket
        at = stamp.at_s
        if not math.isfinite(at) or at > now + STAMP_SLACK_S:
            at = now
        return max(at, now - self._limits.stamp_max_age_s), 0, ticket

    def _purge(self) -> None:
        """Drop the places of waiters not retried lately or in line too long."""
        now = self._clock()
        for sid, waiter in list(self._waiters.items()):
            if now - waiter.last_s > self._limits.waiter_stale_s:
                del self._waiters[sid]
            elif now - waiter.first_s > self._limits.waiter_max_s:
                del self._waiters[sid]
                self._lapsed[sid] = None
                if len(self._lapsed) > LAPSED_MEMORY:
                    self._lapsed.popitem(last=False)

    def _ahead_of(self, ticket: str, key: tuple[float, int, str]) -> tuple[int, int]:
        """Blocks and session slots kept for the live waiters ahead of ``key``."""
        if not self._limits.fcfs:
            return 0, 0
        blocks = sessions = 0
        for sid, waiter in self._waiters.items():
            if sid != ticket and waiter.key < key:
                blocks += waiter.blocks
                sessions += 1
        return blocks, sessions

    def _wait(
        self,
        ticket: str,
        key: tuple[float, int, str],
        admissible: bool,
        blocks: int,
        first_s: float | None = None,
    ) -> None:
        """Keep (or refresh) a refused request's place, if it could ever be admitted;
        a full queue keeps the places that come first. ``first_s``: when it first
        queued here (default now)."""
        if not self._limits.fcfs or not admissible:
            return
        now = self._clock()
        waiter = self._waiters.get(ticket)
        if waiter is not None:
            waiter.blocks, waiter.last_s = blocks, now
            return
        if len(self._waiters) >= MAX_WAITERS:
            last = max(self._waiters, key=lambda sid: self._waiters[sid].key)
            if self._waiters[last].key < key:
                return
            del self._waiters[last]
        self._waiters[ticket] = _Waiter(blocks, now if first_s is None else first_s, now, key)

    @property
    def waiting(self) -> int:
        """Refused sessions whose place in line is kept now (lapsed ones not counted)."""
        now = self._clock()
        return sum(
            1
            for w in self._waiters.values()
            if now - w.last_s <= self._limits.waiter_stale_s
            and now - w.first_s <= self._limits.waiter_max_s
        )

    def grow(self, session_id: str, tokens: int) -> list[str]:
        """Give ``session_id`` blocks for ``tokens`` tokens in all, preempting others if needed.

        Newest first: while the pool is short, the most recently admitted
        session holding blocks is closed here (its blocks freed) — the
        grower itself when it is the newest. Returns the preempted ids (the
        caller tells their gateways); ``session_id`` among them means it did
        not grow. Raises ``InvalidRequest`` when it is the only session and
        the pool still cannot hold it (the KV limit), ``KeyError`` for an
        unknown id.
        """
        entry = self._entries[session_id]
        preempted: list[str] = []
        while not entry.cache.reserve(tokens):
            victim = next(
                (sid for sid in reversed(self._entries) if self._entries[sid].cache.capacity),
                session_id,
            )
            if victim == session_id and len(self._entries) == 1:
                raise InvalidRequest(
                    f"session needs {tokens} tokens of KV cache, more than the stage's "
                    f"whole KV pool of {self.pool_tokens} tokens"
                )
            self._entries.pop(victim).cache.free()
            self._preempted += 1
            preempted.append(victim)
            if victim == session_id:
                break
        return preempted

    def get(self, session_id: str) -> KV:
        """The session's cache, marked as used now: idle time counts from the last call."""
        entry = self._entries.get(session_id)
        if entry is None:
            raise InvalidRequest(f"unknown session {session_id}")
        entry.last_used_s = self._clock()
        entry.used = True
        return entry.cache

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def close(self, session_id: str, *, requeue: bool = False) -> bool:
        """Free a session's blocks at once; False if it was not open.

        With ``requeue`` (its gateway closed it), a stamped session that never ran
        a step keeps its request's place in line, as if it had been refused here:
        its gateway gave it back because another stage refused it, and will try
        again. Without that, a younger request that reached this stage first on
        the next try would be admitted here while the older one waits on the
        other stage, and the two would swap stages round after round (a livelock
        the stamps alone do not stop). A place its gateway never claims again
        goes stale after ``waiter_stale_s``.
        """
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return False
        entry.cache.free()
        place = entry.place
        if requeue and place is not None and not entry.used:
            self._wait(place.key[2], place.key, True, place.blocks, first_s=place.first_s)
        return True

    def idle_sessions(self) -> list[str]:
        """Sessions idle longer than the limit (the caller closes them)."""
        cutoff = self._clock() - self._limits.idle_timeout_s
        return [sid for sid, e in self._entries.items() if e.last_used_s < cutoff]

    def expire_idle(self) -> list[str]:
        """Close sessions idle longer than the limit; return their ids."""
        stale = self.idle_sessions()
        for sid in stale:
            self.close(sid)
        self.note_expired(len(stale))
        return stale

    def note_expired(self, count: int) -> None:
        self._expired += count

    def note_migration_in(self, nbytes: int) -> None:
        """A session's KV of ``nbytes`` arrived here from another stage (a migration)."""
        self._migrations += 1
        self._migrated_bytes += nbytes

    def note_migration_out(self) -> None:
        """A session's KV left this stage for another one."""
        self._migrations_out += 1

    @property
    def bytes_reserved(self) -> int:
        """Bytes of the blocks sessions hold."""
        return (self._pool.num_blocks - self._pool.free_blocks) * self._pool.block_bytes

    def statistics(self) -> KVStatistics:
        return KVStatistics(
            sessions=len(self._entries),
            bytes_used=sum(e.cache.nbytes for e in self._entries.values()),
            bytes_reserved=self.bytes_reserved,
            budget_bytes=self._limits.budget_bytes,
            rejected_busy=self._rejected_busy,
            expired=self._expired,
            blocks_total=self._pool.num_blocks,
            blocks_free=self._pool.free_blocks,
            preempted=self._preempted,
            blocks_cached=self._pool.cached_blocks,
            prefix_queried_tokens=self._queried_tokens,
            prefix_hit_tokens=self._hit_tokens,
            migrations=self._migrations,
            migrated_bytes=self._migrated_bytes,
            migrations_out=self._migrations_out,
            waiting=self.waiting,
        )
