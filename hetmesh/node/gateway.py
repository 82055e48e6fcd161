"""The gateway: drives one request's session through a pipeline and survives its failures.

For every request the gateway keeps the token history (prompt + generated).
It opens the session on each stage of the pipeline the router picked
(control plane), sends token ids to the first stage (data plane) and waits
for each sampled token from the last stage. If a stage dies, stalls past the
step timeout, is declared dead by discovery (:meth:`Gateway.peer_gone`: at
once, not after the timeout) or answers with an internal error, the gateway
finds the peers
that no longer answer, picks another pipeline that avoids them, replays the
history as one prefill to rebuild the KV caches, and carries on: the caller
sees one continuous stream, with no token lost or repeated. Sampling is
seeded per step (``control.step_seed``), so a replayed seeded session draws
the same tokens as before.

Frames for a session are taken from its route only: its tokens from the last
stage, its errors from any of its stages. What another member sends for it is
dropped (and counted as ``foreign_frames``).

Migration: when a stage of a session's route is to go away while alive (a
re-plan gave its units to another peer, a standby took its place in the primary
pipeline, it drains: :meth:`Gateway.move_off`, :meth:`Gateway.move_replaced`),
the gateway, between two steps, moves the session's KV from the old peer to
the new one and carries on without replaying anything (see
:mod:`hetmesh.node.migration`). When the move fails — refused, the source or
the target gone — it replays, as for a stage that died. When no route with
the same stage boundaries is ready, the session finishes where it is.

Prefix cache: the gateway names the history's full blocks by their chained
hashes (:func:`~hetmesh.partition.prefix.block_hashes`) when it opens a
session; each stage answers how many tokens it holds cached, and the prefill
starts at the fewest of them (a block boundary; a stage that attached more
lets the rest go). On close it sends the hashes of the whole history, so a
conversation's next turn finds its earlier turns cached.

Chunked prefill: a long prefill (a prompt, or a replay's history) leaves as up
to four frames of one step (:mod:`hetmesh.partition.prefill`), so the second
stage computes the first chunk while the first stage computes the second, and
other sessions' decode steps share each stage's rounds with one chunk at a time
instead of waiting behind the whole prompt. Only the chunk that reaches the
end of the prompt samples a token. Each chunk attends to the KV of those before
it, as a cached prefix does: the greedy tokens are the one-process reference's,
and in int4 and int8 its logits are bit-identical to a whole prefill's (exact
attention, docs/weights.md "Exactness"; float formats to within rounding).

Speculative decoding (issue 48): a gateway given a drafter and a budget
(``speculation``; ``hetmesh node start --speculative-k N``) sends a decode step's
token with up to ``k`` drafts as one frame; the last stage draws every row as plain
decoding would and sends back the drafts it kept plus its own next token, which the
gateway delivers in order (:mod:`hetmesh.speculative.accept`). The next step's first
position tells every stage where its KV ends (the rejected drafts' tail is dropped).
The tokens are plain decoding's, greedy or seeded. No drafts go on a route whose
stage feeds itself, during a move or a split prefill, nor for a request with a
grammar or log-probabilities (those decode plainly). A replay drafts on.

No token twice: each token frame names its sequence position, and only the
awaited step at the awaited position is delivered; anything else (a stage that
resumed stale work, a frame overtaken by a replay) is dropped as stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import trio

from hetmesh.error_codec import error_from_wire
from hetmesh.errors import (
    InvalidRequest,
    MeshError,
    NoRoute,
    PeerUnreachable,
    Rejected,
    RequestTimeout,
    TransportError,
)
from hetmesh.node.control import (
    MAX_FEED_STEPS,
    MAX_STOP_IDS,
    CloseSession,
    MoveSession,
    OpenSession,
    Reply,
)
from hetmesh.node.gateway_lane import (
    Armed,
    GatewayLane,
    SendNow,
    gateway_lane_enabled,
    gateway_lane_many,
)
from hetmesh.node.gateway_records import Counters as _Counters
from hetmesh.node.gateway_records import GatewayStatistics as GatewayStatistics
from hetmesh.node.gateway_records import GatewayTimeouts as GatewayTimeouts
from hetmesh.node.hop import Hop
from hetmesh.node.migration import moves
from hetmesh.node.outcomes import MID_STEP, Verdict, classify
from hetmesh.node.split import split_prefill_default, split_requests
from hetmesh.partition.blocks import BLOCK_TOKENS
from hetmesh.partition.prefill import (
    prefill_chunk_default,
    prefill_chunks,
    prefill_schedule,
    route_chunk_tokens,
    token_count_env,
)
from hetmesh.partition.prefix import block_hashes
from hetmesh.protocol.generate import SamplingParams
from hetmesh.protocol.logprobs import token_of
from hetmesh.resources import PeerId
from hetmesh.scheduler.records import Plan
from hetmesh.scheduler.standby import standby_takeovers
from hetmesh.speculative.accept import MAX_DRAFTS, accepted
from hetmesh.speculative.drafter import Budget, Drafter
from hetmesh.transport.frames import Activations, Error, Frame, Tokens

log = logging.getLogger(__name__)

_T = TypeVar("_T")


Control = Callable[[PeerId, OpenSession | CloseSession | MoveSession], Awaitable[Reply]]
Send = Callable[[PeerId, Frame], Awaitable[None]]
"""Sends a data-plane frame to a peer (one's own id included); a ``TransportError`` if it cannot."""
Choose = Callable[[str, frozenset[PeerId], Sequence[int]], Awaitable[Sequence[Hop]]]
"""Picks the hops of a request: its id, the peers to avoid, its history's block hashes
(empty without the prefix cache; the router prefers where they are cached)."""
Ping = Callable[[PeerId], Awaitable[bool]]
ChunkCosts = Callable[[Sequence[Hop]], Sequence[float | None]]
"""What prefill chunks cost each hop, as that hop measured it (None: unknown)."""
Helper = Callable[[Sequence[Hop], frozenset[PeerId], Sequence[int]], "tuple[Hop, int, int] | None"]
"""An idle replica of a one-stage route's units, avoiding some peers, to split a long
prefill (its history's block hashes) with (:mod:`hetmesh.node.split`), the unit where
to cut, and the prompt tokens the route's stage holds cached; None when there is none."""


@dataclass(frozen=True, slots=True)
class _PeerGone:
    """Put in a session's inbox when a peer of its route is declared dead (internal)."""

    peer_id: PeerId


_Inbound = Tokens | Error | _PeerGone
# how long a move waits for a route: the stream pauses meanwhile, and the plan loop asks
# again every second while a stage is unready (e.g. its replacement still loading)
MOVE_ROUTE_WAIT_S = 0.05
# a stage may still be finishing the step whose token is back here (its device thread
# sends the token first): a move it refuses as mid-step is asked again this long
MOVE_MID_STEP_WAIT_S = 2.0
MOVE_MID_STEP_PAUSE_S = 0.02
# a session's inbox: a step's tokens (up to a feed's), an error; more are dropped
INBOX_FRAMES = MAX_FEED_STEPS + 4
# sessions that ended, remembered to read peers' announced loads (Gateway.sessions_during):
# an announcement is a second or two old, and this many end within that
ENDED_SESSIONS = 256
FEED_STEPS = 16  # tokens a stage holding the whole model generates from one step
FEED_STEPS_ENV = "HETMESH_FEED_STEPS"


class _Preempted(Exception):
    """A stage evicted the session's KV to make room: resume it by replay (internal)."""


class _SlowOpen(Exception):
    """A stage did not answer the open in time but answers pings: loaded, not gone.
    Open again, as a new try, avoiding nobody (internal)."""


# how an error reply made up by the gateway begins for a control call that got no reply
NO_ANSWER = "no answer in time: "


Speculation = Callable[[], "tuple[Drafter, Budget]"]
"""A drafter and a draft budget for one request (speculative decoding, issue 48)."""


@dataclass(frozen=True, slots=True)
class _Request:
    """What a session was opened with (internal): a migration opens it again elsewhere."""

    base: str
    max_tokens: int
    sampling: SamplingParams
    avoid: set[PeerId]
    order_s: float  # its place in the stages' admission queues (with ``base``)
    generated: list[int]  # the tokens it has yielded so far (the request's, all tries)
    # its drafter and budget (all tries: a replay drafts on); None: it decodes plainly
    speculation: tuple[Drafter, Budget] | None = None


@dataclass(slots=True)
class _Session:
    """One try of a request on one route: all the gateway keeps of it (internal).

    Made when the try is routed, dropped when it ends (its stages closed)."""

    session_id: str
    request: _Request
    inbox: trio.MemorySendChannel[_Inbound]  # its token and error frames (on_frame)
    route: tuple[Hop, ...]  # the hops it runs on (a move changes them)
    began: float  # when it was routed (wall clock): see Gateway.sessions_during
    helper: Hop | None = None  # its prefill's helper until the first token (split)
    leaving: frozenset[PeerId] = frozenset()  # peers to move off at its next step
    # the other peers of a move not yet confirmed by a step (its sources, targets)
    moving: tuple[Hop, ...] = ()
    # each moved stage of that move: its index, the peer that sent its KV, the new one
    handoffs: tuple[tuple[int, Hop, Hop], ...] = ()
    drafted: bool = False  # a step carried drafts (its stages' KV may end in a rejected one)

    def peers(self) -> tuple[Hop, ...]:
        """Every hop it may still hold KV on: its route, a move's other ends, its helper."""
        return self.route + self.moving + ((self.helper,) if self.helper else ())


class _Replay(Exception):
    """Move the session by replaying it on a new route (internal: migration is off)."""

    def __init__(self, leaving: frozenset[PeerId]) -> None:
        super().__init__(f"moving off {sorted(leaving)} by replay")
        self.leaving = leaving


@dataclass(slots=True)
class _InFlight:
    """A step sent to the first stage whose tokens have not all come back yet."""

    step: int  # the step of the next token
    started: float  # when that token's wait began
    hops: tuple[Hop, ...]
    tokens: int = 1  # tokens still to come from it (a fed session's: several)
    fed: int = 1  # token ids the next token's step took in (the first: the step's)
    drafts: tuple[int, ...] = ()  # a verify step's drafts (its tokens come in one frame)


def feed_steps_default() -> int:
    """Tokens per step when the caller does not say: ``HETMESH_FEED_STEPS`` (1: a
    step a token, as before issue 16), else :data:`FEED_STEPS`."""
    return min(max(1, token_count_env(FEED_STEPS_ENV, FEED_STEPS)), MAX_FEED_STEPS)


class _StepFailed(Exception):
    """A step did not complete on the current pipeline (internal to the gateway)."""

    def __init__(self, reason: str, suspects: frozenset[PeerId] = frozenset()) -> None:
        super().__init__(reason)
        self.suspects = suspects


def _mid_step(reply: Reply) -> bool:
    """Whether a stage refused a move only because the session's step is finishing."""
    return not reply.ok and (reply.message or "").startswith(MID_STEP)


def _refusals(hops: Sequence[Hop], replies: Sequence[Reply]) -> list[tuple[Hop, MeshError]]:
    """The hops whose reply is an error, each with that error."""
    return [
        (hop, reply.error() or MeshError("refused"))
        for hop, reply in zip(hops, replies, strict=True)
        if not reply.ok
    ]


def _kept(tokens: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """A verify step's tokens as far as they are consistent with its ``drafts``: each
    but the last equal to its draft, at most one more than the drafts (a last stage
    that says more is believed no further)."""
    kept: list[int] = []
    for i, token in enumerate(tokens[: len(drafts) + 1]):
        kept.append(int(token))
        if i == len(drafts) or token != drafts[i]:
            break
    return kept


class Gateway:
    """Runs sessions for requests that enter at this node."""

    def __init__(
        self,
        *,
        peer_id: PeerId,
        control: Control,
        send: Send,
        choose: Choose,
        ping: Ping,
        eos_token_ids: frozenset[int],
        max_context: int,
        timeouts: GatewayTimeouts | None = None,
        prefix_cache: bool = True,
        migrate: bool = True,
        prefill_chunk_tokens: int | None = None,
        chunk_costs: ChunkCosts | None = None,
        feed_steps: int | None = None,
        helper: Helper | None = None,
        split_prefill: bool | None = None,
        send_now: SendNow | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        """``prefill_chunk_tokens``: see :func:`~hetmesh.partition.prefill.prefill_chunks`
        (None: the ``HETMESH_PREFILL_CHUNK_TOKENS`` switch, else 96; 0: one frame a
        step). ``chunk_costs``: what chunks cost each hop of a route, as measured there;
        a route with a costly stage gets its prefills whole
        (:func:`~hetmesh.partition.prefill.route_chunk_tokens`; None: chunk every route).
        ``feed_steps``: tokens a route of one stage (the whole model on one peer)
        generates from each step sent, feeding itself between them (None: the
        ``HETMESH_FEED_STEPS`` switch, else 16; 1: a round trip a token). ``helper``
        finds an idle replica to split a long prefill with, on a route of one stage
        (:mod:`hetmesh.node.split`; ``split_prefill`` False, or the
        ``HETMESH_SPLIT_PREFILL=0`` switch, turns that off). ``send_now``: a reader
        thread sends a decode step's successor as the token comes in
        (:mod:`hetmesh.node.gateway_lane`; ``HETMESH_GATEWAY_LANE=0``: off).
        ``speculation``: a drafter and a budget for each request (None: no drafts);
        see :meth:`_drafts` for which steps carry them."""
        self.peer_id = peer_id
        self._control = control
        self._send = send
        self._choose = choose
        self._ping = ping
        self._eos = eos_token_ids
        self.max_context = max_context
        self.timeouts = timeouts or GatewayTimeouts()
        self.prefix_cache = prefix_cache
        self.migrate = migrate  # False: a session leaving a stage replays (for comparisons)
        self.prefill_chunk_tokens = (
            prefill_chunk_default() if prefill_chunk_tokens is None else prefill_chunk_tokens
        )
        self._chunk_costs = chunk_costs
        self.feed_steps = feed_steps_default() if feed_steps is None else feed_steps
        self._helper = helper
        self.split_prefill = split_prefill_default() if split_prefill is None else split_prefill
        if not 1 <= self.feed_steps <= MAX_FEED_STEPS:
            raise ValueError(f"feed_steps must be within [1, {MAX_FEED_STEPS}]")
        self._sessions: dict[str, _Session] = {}  # the tries running now, by session id
        # (began, ended, peers) of the latest sessions that ended: see sessions_during
        self._ended: deque[tuple[float, float, frozenset[PeerId]]] = deque(maxlen=ENDED_SESSIONS)
        self._counts = _Counters()
        self._step_s = 0.0  # moving average of decode step time
        self.lane = GatewayLane(send_now if gateway_lane_enabled() else None, peer_id)
        self._lane_many = gateway_lane_many()
        self._speculation = speculation
        # a blocking drafter's calls (a draft model's forwards) on one worker thread at
        # a time: they queue for the model's lock anyway, and trio's loop stays free
        self._drafting = trio.CapacityLimiter(1)

    # -- inbound ------------------------------------------------------------------

    def on_frame(self, frame: Tokens | Error, sender: PeerId | None = None) -> None:
        """Route a token or error frame from ``sender`` (None: this node) to its session;
        stale frames are dropped, and so are frames from a peer not on its route."""
        session = self._sessions.get(frame.session_id)
        if session is None:
            self._counts.stale_frames += 1
            return
        hops = session.route
        if sender is not None and hops:
            # tokens come from the last stage only; an error from any stage of the route
            # (or its prefill's helper)
            # (a move's sources too: one a step reached after it let the session go)
            allowed = (
                {hops[-1].peer_id}
                if isinstance(frame, Tokens)
                else {h.peer_id for h in session.peers()}
            )
            if sender not in allowed:
                self._counts.foreign_frames += 1
                log.warning(
                    "dropped a %s frame for session %s from %s, not on its route",
                    type(frame).__name__,
                    frame.session_id,
                    sender,
                )
                return
        try:
            session.inbox.send_nowait(frame)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._counts.stale_frames += 1

    def peer_gone(self, peer_id: PeerId) -> None:
        """``peer_id`` was declared dead: every session whose route uses it recovers now
        (replays on a route that avoids it) instead of waiting for its step timeout."""
        for session in list(self._sessions.values()):
            helper = session.helper
            # not the source of a move: a drained node leaves once its KV is sent (a
            # source dead before it sent the KV shows as a step that times out)
            ends = [h.peer_id for h in session.route] + ([helper.peer_id] if helper else [])
            if peer_id in ends:
                with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                    session.inbox.send_nowait(_PeerGone(peer_id))  # full: its timeout fires

    def move_off(self, peer_id: PeerId) -> int:
        """Sessions whose route uses ``peer_id`` (alive, but leaving: re-planned, draining)
        move off it at their next step, with their KV; returns how many were asked."""
        asked = 0
        for session in self._sessions.values():
            if any(h.peer_id == peer_id for h in session.route):
                session.leaving |= {peer_id}
                asked += 1
        return asked

    def move_replaced(self, old: Plan | None, new: Plan) -> int:
        """:meth:`move_off` every peer ``new`` demotes from the primary pipeline to a
        standby (:func:`~hetmesh.scheduler.standby.standby_takeovers`): alive but
        replaced, it keeps its stage, so the sessions on it move to the standby that
        took its place, KV and all. Returns the sessions asked to move."""
        return sum(self.move_off(peer) for peer in sorted(standby_takeovers(old, new)))

    def move_unready(self, ready: set[tuple[PeerId, int, int]]) -> int:
        """:meth:`move_off` every peer of a running route whose stage is not in ``ready``."""
        gone = {
            h.peer_id
            for session in self._sessions.values()
            for h in session.route
            if (h.peer_id, h.start, h.end) not in ready
        }
        return sum(self.move_off(peer) for peer in sorted(gone))

    def routes(self) -> list[tuple[Hop, ...]]:
        """The hops of every session running now (the router's view of its own load)."""
        return [session.route for session in self._sessions.values()]

    def session_ids(self) -> list[str]:
        """The ids of the sessions running now (one per request being served)."""
        return list(self._sessions)

    def sessions_during(self, windows: Mapping[PeerId, tuple[float, float]]) -> dict[PeerId, int]:
        """For each peer, this gateway's sessions that ran on it at some time in its window
        ``(since, until)`` (wall clock): what a load the peer sampled then may count of
        ours. The router subtracts them from the load the peer announced, so a stream
        of ours that has ended since does not linger there. One pass over the sessions.
        """
        counts = dict.fromkeys(windows, 0)
        spans = [
            (session.began, math.inf, {h.peer_id for h in session.route})
            for session in self._sessions.values()
        ]
        spans += [(began, end, set(peers)) for began, end, peers in self._ended]
        for began, end, peers in spans:
            for peer in peers:
                window = windows.get(peer)
                if window is not None and began <= window[1] and end >= window[0]:
                    counts[peer] += 1
        return counts

    # -- requests -----------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_context:
            raise InvalidRequest(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens "
                f"{params.max_new_tokens} exceeds the model's context of {self.max_context}"
            )

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[int, None]:
        """Yield generated token ids until an end-of-sequence id (not yielded) or
        ``max_new_tokens``, exactly as the local reference pipeline does.

        Raises ``InvalidRequest`` for impossible requests, ``Rejected`` when the
        mesh stays busy, ``NoRoute`` when no pipeline is left, ``RequestTimeout``
        after too many failed recoveries.
        """
        self.validate(prompt_ids, params)
        base = uuid.uuid4().hex
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        sampling = dataclasses.replace(params, seed=seed)  # every stage and replay draws alike
        history = [int(t) for t in prompt_ids]
        generated: list[int] = []
        avoid: set[PeerId] = set()
        counts = self._counts
        counts.sessions_started += 1
        finished = False
        recoveries = preemptions = slow_opens = 0
        split_failed = False
        # peers the next route should not use (a move by replay), still closed like any
        leaving: frozenset[PeerId] = frozenset()
        admission_s = self.timeouts.admission_s
        # its place in line on every stage, kept on every retry (a resume after a
        # preemption takes a new one): the same request heads every stage's queue
        # (no two requests each head one)
        order_s = time.time()
        # a grammar's draw advances on every row drawn, and a frame carries one token's
        # log-probabilities: such requests decode plainly
        plain = bool(params.grammar) or params.logprobs is not None
        speculation = None if plain or self._speculation is None else self._speculation()
        try:
            for attempt in itertools.count():
                session_id = f"{base}.{attempt}"
                hashes = block_hashes(history) if self.prefix_cache else []
                hops = tuple(await self._choose(base, frozenset(avoid) | leaving, hashes))
                leaving = frozenset()
                if not hops:
                    raise NoRoute("no pipeline serves the model")
                request = _Request(
                    base,
                    len(prompt_ids) + params.max_new_tokens,
                    sampling,
                    avoid,
                    order_s,
                    generated,
                    speculation,
                )
                inbox_send, inbox = trio.open_memory_channel[_Inbound](INBOX_FRAMES)
                session = _Session(session_id, request, inbox_send, hops, time.time())
                self._sessions[session_id] = session
                helper = None
                split = False  # this try's prefill split with a helper
                if not split_failed:  # a split that failed once: replay it whole
                    helper = self._split_helper(hops, frozenset(avoid) | leaving, history, hashes)
                try:
                    cached = await self._open(session, history, admission_s, helper)
                    split = session.helper is not None
                    counts.prefix_tokens_skipped += cached
                    async for token in self._run(
                        session, inbox, history, generated, params.max_new_tokens, cached
                    ):
                        yield token
                    finished = True
                    return
                except _Preempted as exc:
                    # not a fault: the pool was short. Resume later by replaying the
                    # history; the open waits (Rejected: busy) until blocks are free.
                    preemptions += 1
                    counts.preemptions += 1
                    # behind the requests already waiting: with its old place it would
                    # head every queue with its whole history and hold back smaller ones
                    order_s = time.time()
                    # its client is mid-stream: wait longer for room than a new request
                    admission_s = max(self.timeouts.admission_s, self.timeouts.resume_s)
                    log.info("session %s: %s; resumes after %d tokens", base, exc, len(generated))
                    if preemptions > self.timeouts.max_preemptions:
                        raise Rejected(
                            f"busy: the session was preempted {preemptions} times"
                        ) from None
                except _Replay as exc:
                    leaving = exc.leaving
                    counts.move_replays += 1
                    log.info("session %s: moved by replay after %d tokens", base, len(generated))
                except _SlowOpen as exc:
                    slow_opens += 1
                    counts.slow_steps += 1
                    if slow_opens > self.timeouts.max_extensions:
                        raise RequestTimeout(f"too slow to open the session: {exc}") from None
                    log.info("session %s: %s slow to open it (they answer pings); again", base, exc)
                except _StepFailed as exc:
                    if session.moving:  # a move that failed: replay instead
                        counts.migration_fallbacks += 1
                    split_failed |= split
                    recoveries += 1
                    if recoveries > self.timeouts.max_recoveries:
                        raise RequestTimeout(
                            f"session gave up after {self.timeouts.max_recoveries} recoveries"
                        ) from None
                    # the route it failed on (a move may have changed it) and a move's ends
                    current = session.route + session.moving
                    suspects = exc.suspects or await self._find_silent(current)
                    if not exc.suspects and not suspects:
                        await trio.sleep(self.timeouts.replan_pause_s)  # let the plan settle
                    avoid |= suspects
                    counts.recoveries += 1
                    log.warning(
                        "session %s: %s; recovering after %d tokens, avoiding %s",
                        base,
                        exc,
                        len(generated),
                        sorted(suspects) or "nobody",
                    )
                finally:
                    del self._sessions[session_id]
                    # the route it ended on, the other end of a move in progress, and its
                    # helper if it has not let go
                    hops = session.peers()
                    self._ended.append(
                        (session.began, time.time(), frozenset(h.peer_id for h in hops))
                    )
                    # not on a peer to avoid: dead or stuck, it would hold the recovery
                    alive = [h for h in hops if h.peer_id not in avoid]
                    with trio.CancelScope(shield=True):
                        # every stage's KV holds a prefix of the history: name its blocks
                        # (where drafts went, all but the last token's: the KV at its
                        # position may be a rejected draft's)
                        named = history[:-1] if session.drafted else history
                        hashes = block_hashes(named) if self.prefix_cache else []
                        await self._close(session_id, alive, tuple(hashes))
            raise AssertionError("unreachable: the loop returns or raises")
        finally:
            if speculation is not None:
                # after any propose of it (awaited even when cancelled): no KV of a
                # closed session is left in a draft model
                with trio.CancelScope(shield=True):
                    await self._drafter_call(speculation[0], speculation[0].close)
            if finished:
                counts.sessions_finished += 1
            else:
                counts.sessions_failed += 1

    async def _open(
        self,
        session: _Session,
        history: Sequence[int],
        admission_s: float,
        helper: tuple[Hop, int] | None = None,
    ) -> int:
        """Open the session on every stage, waiting (with back-off) while they are busy.

        With ``helper`` (a peer, the unit where it cuts), first try the prefill split
        with it (one stage's route, :mod:`hetmesh.node.split`); a helper that refuses
        leaves the prefill whole.
        Returns the prompt tokens every stage holds cached: the prefill starts there.
        """
        session_id, hops = session.session_id, session.route
        hashes = tuple(block_hashes(history)) if self.prefix_cache else ()
        requests = [
            self._opening(session, hops, i, len(history), prefix_hashes=hashes)
            for i in range(len(hops))
        ]
        if helper is not None and len(hops) == 1:
            pair = (hops[0], helper[0])
            replies = await self._ask_all(
                pair, split_requests(requests[0], hops[0].peer_id, helper[0].peer_id, helper[1])
            )
            if all(r.ok for r in replies):
                session.helper = helper[0]
                self._counts.split_prefills += 1
                cached = min(r.cached_tokens for r in replies)
                return max(0, min(cached, len(history) - 1)) // BLOCK_TOKENS * BLOCK_TOKENS
            declined = _refusals(pair, replies)
            why = "; ".join(f"{h.peer_id}: {error}" for h, error in declined)
            log.info("session %s: no split prefill (%s)", session_id, why)
            await self._close(session_id, pair)  # busy since it was chosen: prefill whole
        deadline = trio.current_time() + admission_s
        delay = 0.05
        while True:
            replies = await self._ask_all(hops, requests)
            refused = _refusals(hops, replies)
            if not refused:
                cached = min(r.cached_tokens for r in replies)
                # a block boundary short of the prompt's end (a stage could claim anything)
                return max(0, min(cached, len(history) - 1)) // BLOCK_TOKENS * BLOCK_TOKENS
            await self._close(session_id, hops)
            verdicts = [(hop, e, classify(e, data_plane=False)) for hop, e in refused]
            for _, error, verdict in verdicts:
                if verdict is Verdict.FATAL:
                    raise error
            unreachable = frozenset(
                hop.peer_id for hop, _, verdict in verdicts if verdict is Verdict.SUSPECT
            )
            if unreachable:
                await self._slow_or_failed(hops, verdicts)
                raise _StepFailed("a stage refused or did not answer the session", unreachable)
            if any(verdict is Verdict.REPLAN for _, _, verdict in verdicts):
                # a new plan moved a stage: route again once it is ready, avoid nobody for it
                raise _StepFailed("the plan changed under the session")
            # busy (or a session a stage let go at once): wait for room, ask again
            self._counts.rejected_busy += 1
            if trio.current_time() + delay > deadline:
                raise Rejected("busy: every pipeline is full; try again later")
            await trio.sleep(delay)  # back off while busy stages drain
            delay = min(delay * 2, 1.0)

    async def _slow_or_failed(
        self, hops: Sequence[Hop], verdicts: Sequence[tuple[Hop, MeshError, Verdict]]
    ) -> None:
        """``_SlowOpen`` when every suspect of a refused open only missed its deadline
        and answers a ping (a loaded node, seen in a loaded run: not a reason to avoid
        it, nor a recovery); returns otherwise (the caller recovers avoiding them)."""
        suspects = [(hop, error) for hop, error, verdict in verdicts if verdict is Verdict.SUSPECT]
        if any(not str(error).startswith(NO_ANSWER) for _, error in suspects):
            return  # a stage's own failure
        if await self._find_silent([hop for hop, _ in suspects]):
            return
        raise _SlowOpen(", ".join(sorted(hop.peer_id for hop, _ in suspects)))

    def _neighbours(self, hops: Sequence[Hop], i: int) -> tuple[PeerId, PeerId]:
        """The peers before and after stage ``i`` of ``hops``: this gateway at the ends."""
        before = hops[i - 1].peer_id if i > 0 else self.peer_id
        after = hops[i + 1].peer_id if i + 1 < len(hops) else self.peer_id
        return before, after

    def _opening(
        self,
        session: _Session,
        hops: Sequence[Hop],
        i: int,
        prompt_tokens: int,
        *,
        prefix_hashes: tuple[int, ...] = (),
        migrate_from: PeerId = "",
    ) -> OpenSession:
        """The ``OpenSession`` for stage ``i`` of ``hops`` (a try's route, or a move's
        new one), its first chunk ``prompt_tokens`` long."""
        request, hop = session.request, hops[i]
        previous_peer, next_peer = self._neighbours(hops, i)
        feed_steps, stop_ids = self._feeding(hops)
        return OpenSession(
            session_id=session.session_id,
            start=hop.start,
            end=hop.end,
            next_peer=next_peer,
            gateway=self.peer_id,
            previous_peer=previous_peer,
            max_tokens=request.max_tokens,
            prompt_tokens=prompt_tokens,
            sampling=request.sampling,
            prefix_hashes=prefix_hashes,
            migrate_from=migrate_from,
            order_s=request.order_s,
            order_id=request.base,
            feed_steps=feed_steps,
            stop_ids=stop_ids,
            # a constrained session's last stage rebuilds its grammar's state from these
            drawn=tuple(request.generated)
            if request.sampling.grammar and i == len(hops) - 1
            else (),
        )

    def _split_helper(
        self,
        hops: Sequence[Hop],
        avoid: frozenset[PeerId],
        history: Sequence[int],
        hashes: Sequence[int],
    ) -> tuple[Hop, int] | None:
        """An idle replica to split the prefill of ``history`` with and the unit where it
        cuts, or None: only for a route of one stage, and a prefill (past what it holds
        cached) long enough to cut into chunks."""
        if not self.split_prefill or self._helper is None or len(hops) != 1:
            return None
        found = self._helper(hops, avoid, hashes)
        if found is None:
            return None
        helper, unit, cached = found
        tokens = len(history) - min(cached, len(history) - 1)
        if len(prefill_chunks(tokens, self._chunk_tokens((*hops, helper)))) < 2:
            return None  # one chunk: nothing overlaps
        return helper, unit

    def _chunk_tokens(self, hops: Sequence[Hop]) -> int:
        """The chunk size of a prefill through ``hops`` (0: whole)."""
        if self._chunk_costs is None:
            return self.prefill_chunk_tokens
        return route_chunk_tokens(self._chunk_costs(hops), self.prefill_chunk_tokens)

    def _feeding(self, hops: Sequence[Hop]) -> tuple[int, tuple[int, ...]]:
        """Tokens a step and stop ids for the stages of ``hops``: a lone stage holds the
        whole model and feeds itself, stopping at an end-of-sequence id."""
        if len(hops) != 1 or len(self._eos) > MAX_STOP_IDS:
            return 1, ()
        return self.feed_steps, tuple(sorted(self._eos))

    async def _ask_all(
        self, hops: Sequence[Hop], requests: Sequence[OpenSession | MoveSession]
    ) -> list[Reply]:
        """Send each hop its request concurrently; a failure becomes an error reply."""
        replies = [Reply.failed(PeerUnreachable("no answer"))] * len(hops)

        async def ask(i: int) -> None:
            try:
                with trio.fail_after(self.timeouts.ping_s * 2):
                    replies[i] = await self._control(hops[i].peer_id, requests[i])
            except (MeshError, trio.TooSlowError) as exc:
                # whatever the failure, this stage did not take the session: suspect its peer
                replies[i] = Reply.failed(PeerUnreachable(f"{NO_ANSWER}{exc}"))

        async with trio.open_nursery() as nursery:
            for i in range(len(hops)):
                nursery.start_soon(ask, i)
        return replies

    async def _run(
        self,
        session: _Session,
        inbox: trio.MemoryReceiveChannel[_Inbound],
        history: list[int],
        generated: list[int],
        max_new_tokens: int,
        cached: int = 0,
    ) -> AsyncGenerator[int, None]:
        """The session's tokens, one step after another.

        Each step after the first leaves for the first stage *before* its token is
        handed on: the consumer (a client's stream over libp2p, an SSE response, the
        text decoder) then works while the pipeline computes, instead of in front of
        it. A step that cannot be sent fails only after its token has been yielded,
        so the replay that follows loses nothing. On a route of one stage a step
        brings up to ``feed_steps`` tokens (the stage feeds itself between them);
        the next step leaves once the last of them is in. A decode step may carry
        drafts (:meth:`_drafts`): its tokens come back in one frame, the drafts the
        last stage kept and its own next token, and the step after it starts right
        after them (each stage drops the rest of its KV there).
        """
        # the whole history (a first prefill or a replay) but what every stage holds cached
        feed = list(history[cached:])
        position = cached
        in_flight: _InFlight | None = None
        helper = session.helper  # the prompt goes through it (split)
        drafts: tuple[int, ...] = ()
        while len(generated) < max_new_tokens:
            if in_flight is None:
                if session.leaving and len(feed) == 1:  # nothing in flight
                    await self._migrate(session, position)
                if len(feed) == 1:
                    drafts = await self._drafts(session, history, len(generated), max_new_tokens)
                else:
                    drafts = ()
                in_flight = await self._send_step(
                    session, feed, position, len(generated), max_new_tokens, helper, drafts
                )
                helper = None
            # the step in flight, and its move's KV, once more
            again = functools.partial(
                self._move_again, session, tuple(feed), position, len(generated), max_new_tokens
            )  # the move's KV once more; its step too where the first stage moved
            # the next step's drafts are decided now (the budget asked once a step) where
            # the lane could send it: none, and the lane sends it as a plain step
            next_k: int | None = None
            if not in_flight.drafts and self._armable(
                session, in_flight, max_new_tokens - len(generated)
            ):
                next_k = self._next_k(session)
                if next_k == 0:
                    self._arm(session, in_flight, len(history))
            try:
                tokens = await self._await_token(
                    inbox,
                    in_flight.step,
                    in_flight.fed,
                    in_flight.hops,
                    session.moving,
                    position=len(history),
                    again=again if session.handoffs else None,
                    drafts=in_flight.drafts,
                )
            finally:
                sent = self.lane.claim(session.session_id)  # the next step, if it left
            session.moving = ()  # a step on the new route: the move is done
            if session.helper is not None:
                # a first token: the helper sent its part and let the session go
                session.helper = None
                in_flight.hops = session.route
            now = time.perf_counter()
            self._note_step(now - in_flight.started, in_flight.fed)
            if session.handoffs:  # its sources may let the KV they kept for it go
                await self._confirm(session)
            if in_flight.drafts:  # a verify step: the next input follows its last token
                position += len(tokens)
                self._note_verify(session, in_flight, tokens, now)
                in_flight = None
            else:
                speculation = session.request.speculation
                if speculation is not None and in_flight.fed == 1:  # a plain decode step
                    speculation[1].record(0, 0, now - in_flight.started)
                position += in_flight.fed
                in_flight.step, in_flight.started, in_flight.fed = in_flight.step + 1, now, 1
                in_flight.tokens -= 1
                if in_flight.tokens == 0:
                    in_flight = None
            delivered: list[int] = []
            ended = False  # an end-of-sequence token came
            for token in tokens:
                ended = token in self._eos
                if ended or len(generated) >= max_new_tokens:
                    break
                generated.append(token)
                history.append(token)
                delivered.append(token)
            if not delivered:
                return
            self._counts.tokens_out += len(delivered)
            feed = [delivered[-1]]
            failed: _StepFailed | None = None
            # a session leaving its peers moves between steps, with nothing in flight
            more = len(generated) < max_new_tokens and not session.leaving and not ended
            if in_flight is None and sent is not None:  # sent by the lane: in flight
                in_flight = _InFlight(sent.step + 1, sent.sent_at, session.route)
            elif in_flight is None and more:
                drafts = await self._drafts(
                    session, history, len(generated), max_new_tokens, next_k
                )
                try:
                    in_flight = await self._send_step(
                        session, feed, position, len(generated), max_new_tokens, None, drafts
                    )
                except _StepFailed as exc:
                    failed = exc
                else:
                    self._count_turn(session.session_id, in_flight.hops[0].peer_id)
            for token in delivered:
                yield token
            if ended:
                return
            if failed is not None:
                raise failed

    async def _drafts(
        self,
        session: _Session,
        history: Sequence[int],
        step: int,
        max_new: int,
        k: int | None = None,
    ) -> tuple[int, ...]:
        """The drafts the session's next decode step carries: its drafter's, ``k`` of
        them (None: as many as its budget says now), never past ``max_new`` tokens;
        none on a route whose stage feeds itself (it brings several tokens a step
        already), nor while a move or a split prefill's helper is under way. A
        blocking drafter (a draft model) proposes on a worker thread."""
        speculation = session.request.speculation
        if speculation is None or session.helper or session.leaving or session.moving:
            return ()
        if self._feeding(session.route)[0] != 1:
            return ()
        k = min(self._next_k(session) if k is None else k, max_new - step - 1, MAX_DRAFTS)
        if k <= 0:
            return ()
        drafter = speculation[0]
        # a worker thread reads a copy: never a list the event loop may touch
        seen = tuple(history) if getattr(drafter, "blocking", False) else history
        propose = functools.partial(drafter.propose, seen, k)
        proposed = await self._drafter_call(drafter, propose)
        drafts = tuple(int(t) for t in proposed[:k])
        if not drafts or any(t < 0 for t in drafts):
            # the drafter had none: a budget that backs off then hears of it (the plain
            # steps it chooses meanwhile keep the lane)
            no_drafts = getattr(speculation[1], "no_drafts", None)
            if no_drafts is not None:
                no_drafts()
            return ()
        session.drafted = True
        return drafts

    async def _drafter_call(self, drafter: Drafter, call: Callable[[], _T]) -> _T:
        """``call()``, one of ``drafter``'s methods: inline for a cheap drafter (prompt
        lookup), on a worker thread for a blocking one (a draft model's ``k`` forwards
        would hold every request of this node), awaited to its end even when
        cancelled."""
        if not getattr(drafter, "blocking", False):
            return call()
        return await trio.to_thread.run_sync(call, limiter=self._drafting)

    @staticmethod
    def _next_k(session: _Session) -> int:
        """Drafts the session's budget wants on its next step (asked once a step sent;
        0 without speculation)."""
        speculation = session.request.speculation
        return 0 if speculation is None else max(0, int(speculation[1].k()))

    def _note_verify(
        self, session: _Session, in_flight: _InFlight, tokens: Sequence[int], now: float
    ) -> None:
        """Count a verify step and tell the session's budget how it went."""
        kept = accepted(in_flight.drafts, tokens)
        counts = self._counts
        counts.verify_steps += 1
        counts.drafted += len(in_flight.drafts)
        counts.accepted += kept
        counts.verified_tokens += len(tokens)
        speculation = session.request.speculation
        if speculation is not None:
            speculation[1].record(len(in_flight.drafts), kept, now - in_flight.started)

    def _armable(self, session: _Session, in_flight: _InFlight, left: int) -> bool:
        """Whether a reader thread may send the step after the awaited token (the lane):
        a plain decode step, with another wanted after it and no move or helper, of any
        session here where the first stage gathers bursts by their groups, else of the
        one session here: steps sent one by one as their tokens come in could split the
        stages' batches (see :mod:`hetmesh.node.gateway_lane`)."""
        route = session.route
        if not self.lane.enabled or in_flight.tokens != 1 or left < 2 or in_flight.hops != route:
            return False
        if len(self._sessions) != 1 and not self._lane_many:
            return False
        if session.helper or session.leaving or session.moving or session.handoffs:
            return False
        return self._feeding(route)[0] == 1

    def _arm(self, session: _Session, in_flight: _InFlight, position: int) -> None:
        """Arm the lane with the step after the awaited token (see :meth:`_armable`)."""
        route = session.route
        armed = Armed(in_flight.step, position, route[-1].peer_id, route[0].peer_id, self._eos)
        self.lane.arm(session.session_id, armed)

    async def _send_step(
        self,
        session: _Session,
        feed: Sequence[int],
        position: int,
        step: int,
        max_new: int,
        helper: Hop | None = None,
        drafts: tuple[int, ...] = (),
    ) -> _InFlight:
        """Send one step's token ids to the session's first stage (a long prefill in
        chunks, see :func:`~hetmesh.partition.prefill.prefill_chunks`), or to its
        ``helper`` (a split prefill's); ``step`` tokens are out of ``max_new``. A
        decode step's ``drafts`` go with its token, as one frame (a verify step)."""
        session_id, route = session.session_id, session.route
        hops = (helper, *route) if helper is not None else route
        first = hops[0].peer_id
        started = time.perf_counter()
        if drafts and len(feed) == 1 and helper is None:
            frame = Activations(
                session_id=session_id,
                step=step,
                positions=tuple(range(position, position + 1 + len(drafts))),
                tensors=(torch.tensor([feed[0], *drafts], dtype=torch.int64),),
                drafts=drafts,
            )
            await self._send_first(first, frame)
            return _InFlight(step, started, hops, drafts=drafts)
        ids = torch.tensor(list(feed), dtype=torch.int64)
        chunk_tokens = self._chunk_tokens(hops) if len(feed) > 1 else self.prefill_chunk_tokens
        # a route of several stages tapers them (fill and drain); a split's helper's
        # cut is chosen for even chunks
        stages = len(route) if helper is None else 1
        sizes = prefill_schedule(len(feed), chunk_tokens, stages=stages)
        for chunk in torch.split(ids, sizes):
            frame = Activations(
                session_id=session_id,
                step=step,
                positions=tuple(range(position, position + chunk.shape[0])),
                tensors=(chunk,),
            )
            position += chunk.shape[0]
            await self._send_first(first, frame)
        tokens = min(self._feeding(route)[0], max_new - step)
        return _InFlight(step, started, hops, tokens, len(feed))

    async def _send_first(self, first: PeerId, frame: Activations) -> None:
        """Send a step's frame to its first stage; a failure is the step's."""
        try:
            await self._send(first, frame)
        except TransportError as exc:
            raise _StepFailed(f"cannot reach the first stage: {exc}", frozenset({first})) from exc

    async def _migrate(self, session: _Session, position: int) -> None:
        """Move the session's stages off the peers it is leaving, KV and all, or
        raise ``_StepFailed`` (the caller replays). Keeps the route when no ready
        route cuts the model the same way (the session finishes where it is)."""
        session_id, request = session.session_id, session.request
        leaving, session.leaving = session.leaving, frozenset()
        old = session.route
        new: tuple[Hop, ...] = ()
        # a ready route is found at once; none now: stay (asked again at the next re-plan)
        with trio.move_on_after(MOVE_ROUTE_WAIT_S):
            with contextlib.suppress(MeshError):
                new = tuple(
                    await self._choose(request.base, frozenset(request.avoid | leaving), ())
                )
        changes = moves(old, new) if new else None
        if changes is None:
            log.info(
                "session %s: no route to move to off %s; it stays", session_id, sorted(leaving)
            )
            return
        if not self.migrate:
            raise _Replay(leaving)
        targets = [new[i] for i, _, _ in changes]
        session.moving = tuple(targets)
        opens = [
            self._opening(session, new, i, position, migrate_from=source)
            for i, source, _ in changes
        ]
        self._check_replies(targets, await self._ask_all(targets, opens), "open on")
        session.moving = tuple(targets) + tuple(old[i] for i, _, _ in changes)
        moved = {i: target for i, _, target in changes}
        requests = [
            MoveSession(
                session_id=session_id,
                kv_to=moved.get(i, ""),
                next_peer=self._neighbours(new, i)[1],
                previous_peer=self._neighbours(new, i)[0],
            )
            for i in range(len(old))
        ]
        replies = await self._ask_between_steps(old, requests)
        self._check_replies(old, replies, "move from")
        session.route = new
        session.handoffs = tuple((i, old[i], new[i]) for i in moved)
        self._counts.migrations += 1
        log.info(
            "session %s: moved at %d tokens from %s to %s",
            session_id,
            position,
            [old[i].peer_id for i in moved],
            [new[i].peer_id for i in moved],
        )

    async def _ask_between_steps(
        self, hops: Sequence[Hop], requests: Sequence[MoveSession]
    ) -> list[Reply]:
        """:meth:`_ask_all`, asking again for ``MOVE_MID_STEP_WAIT_S`` the stages that
        refuse because the session's last step is still finishing there."""
        replies = await self._ask_all(hops, requests)
        with trio.move_on_after(MOVE_MID_STEP_WAIT_S):
            while busy := [i for i, reply in enumerate(replies) if _mid_step(reply)]:
                await trio.sleep(MOVE_MID_STEP_PAUSE_S)
                again = await self._ask_all([hops[i] for i in busy], [requests[i] for i in busy])
                for i, reply in zip(busy, again, strict=True):
                    replies[i] = reply
        return replies

    @staticmethod
    def _check_replies(hops: Sequence[Hop], replies: Sequence[Reply], what: str) -> None:
        """``_StepFailed`` when a stage refused or did not answer its part of a move."""
        failed = _refusals(hops, replies)
        if not failed:
            return
        # refused (busy, full, the plan changed, the session let go): a replay; a suspect
        # (failed, silent): avoid the peer too
        silent = frozenset(
            hop.peer_id
            for hop, error in failed
            if classify(error, data_plane=False) is Verdict.SUSPECT
        )
        reasons = "; ".join(f"{hop.peer_id}: {error}" for hop, error in failed)
        raise _StepFailed(f"the move failed to {what} a stage ({reasons})", silent)

    async def _move_again(
        self,
        session: _Session,
        feed: Sequence[int],
        position: int,
        step: int,
        max_new: int,
        moved: bool = False,
    ) -> bool:
        """What a move sent may be lost: ask each source of the move to send the KV it
        kept once more (a target that has it already drops the copy). ``moved``: a
        stage the session left answered its step (the step went to the old peer):
        send the step again when that is where it came from, the first stage (any
        other stage computed it already, and a stage computes a position once).
        Returns whether the step went again."""
        session_id = session.session_id
        sources = [source for _, source, _ in session.handoffs]
        requests = [
            MoveSession(
                session_id=session_id,
                kv_to=target.peer_id,
                next_peer=self._neighbours(session.route, i)[1],
                previous_peer=self._neighbours(session.route, i)[0],
            )
            for i, _, target in session.handoffs
        ]
        for hop, reply in zip(sources, await self._ask_all(sources, requests), strict=True):
            if not reply.ok:
                log.info("session %s: %s sent no KV again: %s", session_id, hop.peer_id, reply)
        if not moved or all(i != 0 for i, _, _ in session.handoffs):
            return False
        try:
            await self._send_step(session, feed, position, step, max_new)
        except _StepFailed:
            return False  # the wait finds out
        return True

    async def _confirm(self, session: _Session) -> None:
        """A step ran on the new route: the move's sources let go of the KV they kept
        for it (a drained node waits for that before it leaves)."""
        sources = [source for _, source, _ in session.handoffs]
        session.handoffs = ()
        close = CloseSession(session_id=session.session_id)

        async def confirm(peer: PeerId) -> None:
            with trio.move_on_after(self.timeouts.ping_s), contextlib.suppress(MeshError):
                await self._control(peer, close)

        async with trio.open_nursery() as nursery:
            for hop in sources:
                nursery.start_soon(confirm, hop.peer_id)

    async def _await_token(
        self,
        inbox: trio.MemoryReceiveChannel[_Inbound],
        step: int,
        fed: int,
        hops: Sequence[Hop],
        moving: Sequence[Hop] = (),
        *,
        position: int,
        again: Callable[..., Awaitable[bool]] | None = None,
        drafts: Sequence[int] = (),
    ) -> list[int]:
        """The token of ``step``, at sequence ``position`` (a verify step's: its tokens,
        :func:`_kept`); ``_StepFailed`` when a stage is gone or stuck.

        A token frame for another step or position is dropped (``stale_frames``): one
        at a position already delivered (a stage that resumed after a freeze, a
        frame overtaken by its replay) is never delivered twice.

        A step slower than its timeout is not failed at once: if every stage
        still answers a ping, the mesh is merely busy and the wait goes on (up
        to ``max_extensions`` times); a silent stage fails the step at once.

        ``again``: the first step after a move (its KV sent from a peer that may
        exit right after, over a link opened for it) that times out with every
        stage answering has the move's KV sent once more (:meth:`_move_again`): a
        KV lost on the way costs a timeout, not a replay. A stage that has handed
        the session over answers a step that still reaches it with a "moved
        session" error: sent again to the new first stage, or else a recovery.
        """
        t = self.timeouts
        if fed > 1:
            timeout = max(t.prefill_floor_s, fed * t.prefill_per_token_s, t.factor * self._step_s)
        else:
            timeout = max(t.step_floor_s, t.factor * self._step_s)
        for _ in range(t.max_extensions + 1):
            with trio.move_on_after(timeout) as waiting:
                while True:
                    frame = await inbox.receive()
                    if isinstance(frame, _PeerGone):
                        # one ping confirms it (a killed peer refuses at once): a peer
                        # declared dead by a loaded discovery but still answering is kept
                        gone = await self._find_silent(
                            [h for h in hops if h.peer_id == frame.peer_id]
                        )
                        if not gone:
                            log.info("stage %s declared dead but answers: kept", frame.peer_id)
                            continue
                        self._counts.early_recoveries += 1
                        left_s = waiting.deadline - trio.current_time()
                        self._counts.early_recovery_s += max(0.0, left_s)
                        raise _StepFailed(f"stage {frame.peer_id} was declared dead", gone)
                    if isinstance(frame, Error):
                        error = error_from_wire(frame.code, frame.message)
                        verdict = classify(error, data_plane=True)
                        moved = verdict is Verdict.MOVED and again is not None
                        if moved and again is not None and await again(moved=True):
                            log.info("step %d reached the stage it left: sent again", step)
                            again = None
                            continue
                        if verdict is Verdict.PREEMPTED:  # resume by replay, later
                            raise _Preempted(frame.message)
                        if verdict is Verdict.FATAL:
                            raise error
                        # the sender is not known here: the recovery pings the route
                        raise _StepFailed(f"a stage failed: {frame.message}")
                    if frame.step == step and frame.position == position and frame.token_ids:
                        if len(frame.token_ids) == 1:
                            return [token_of(frame.token_ids[0], frame.logprobs)]
                        return _kept(frame.token_ids, drafts)
                    self._counts.stale_frames += 1
            silent = await self._find_silent([*hops, *moving])  # a move's source too
            if silent & {h.peer_id for h in hops}:
                raise _StepFailed(f"no token for step {step} within {timeout:.1f} s", silent)
            if silent:
                # only a move's source is gone: it had its KV on the way when it answered
                # the move (a drain waits for that before the node exits), so the new
                # route is waited on like a slow one; a KV lost with it ends as a stall
                log.info("step %d: the move's source %s is gone; waiting on", step, sorted(silent))
                moving = ()
            if again is not None:  # the move's KV may be lost: once more
                log.info("step %d after a move: none in %.1f s; its KV once more", step, timeout)
                await again()
                again = None
            self._counts.slow_steps += 1
        raise _StepFailed(f"step {step} stalled although every stage answers pings")

    def _count_turn(self, session_id: str, first: PeerId) -> None:
        """A next step trio sent to ``first``: its turn since the token came in (the
        lane's are counted by the lane; one to this node's own first stage is not a turn
        either way, see :class:`GatewayLane`)."""
        arrived = self.lane.arrival(session_id)
        if arrived is not None and first != self.peer_id:
            self._counts.trio_turns += 1
            self._counts.trio_turn_s += time.perf_counter() - arrived

    def _note_step(self, elapsed: float, fed: int) -> None:
        if fed == 1:
            self._step_s = elapsed if self._step_s == 0 else 0.8 * self._step_s + 0.2 * elapsed

    async def _find_silent(self, hops: Sequence[Hop]) -> frozenset[PeerId]:
        """The peers of ``hops`` that do not answer a ping in time."""
        silent: set[PeerId] = set()

        async def check(peer: PeerId) -> None:
            ok = False
            with trio.move_on_after(self.timeouts.ping_s):
                try:
                    ok = await self._ping(peer)
                except MeshError:
                    ok = False
            if not ok:
                silent.add(peer)

        async with trio.open_nursery() as nursery:
            for peer in {h.peer_id for h in hops}:
                nursery.start_soon(check, peer)
        return frozenset(silent)

    async def _close(
        self, session_id: str, hops: Sequence[Hop], hashes: tuple[int, ...] = ()
    ) -> None:
        async def close_one(peer: PeerId) -> None:
            with trio.move_on_after(self.timeouts.close_s):
                try:
                    await self._control(
                        peer, CloseSession(session_id=session_id, block_hashes=hashes)
                    )
                except MeshError as exc:
                    log.debug("closing %s on %s: %s", session_id, peer, exc)

        async with trio.open_nursery() as nursery:
            for peer in {h.peer_id for h in hops}:
                nursery.start_soon(close_one, peer)

    def statistics(self) -> GatewayStatistics:
        return GatewayStatistics(
            active_sessions=len(self._sessions),
            lane_turns=self.lane.turns,
            lane_turn_s=self.lane.turn_s,
            **dataclasses.asdict(self._counts),
        )
