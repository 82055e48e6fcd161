"""A stage server: one loaded :class:`~hetmesh.partition.stage.StageModule`, its sessions' KV
caches, and a continuous-batching loop.

Activations arrive from the data plane (token ids on the first stage, hidden
states elsewhere), wait in an inbox, and every round the loop takes all that
is pending — any mix of prefill chunks and decode steps of different sessions
— and runs them as one forward on the device thread. Outputs go straight to
the next stage, or, on the last stage, are sampled and sent to the session's
gateway as a token; a prefill chunk that ends short of the prompt
(``OpenSession.prompt_tokens``) samples nothing, since its next chunk follows
(see the gateway's chunked prefill). Sessions join and leave between rounds; a
bad item fails alone (its gateway gets an ``Error`` frame) while the rest of the
batch runs.
A round takes at most half of the open sessions (``micro_batches``): many
sessions then cycle through the pipeline as two micro-batches, and while the
next stage computes one, this stage computes the other (one batch of all of
them would leave every stage but one idle). A stage holding the whole model
has no next stage: its rounds take every waiting session. Each micro-batch
still shares one forward, and one frame per session and hop. A round's frames leave one after
another, so a stage gathers a burst before it starts (frames no more than
``GATHER_S`` apart, until its share is in, or until every session of the
waiting sessions' last rounds here is in: :mod:`hetmesh.node.stage_groups`):
otherwise it would start on the first frame of a micro-batch and the groups would
crumble into single steps. A burst of decode steps too small for the micro-batches (more
groups circulate than ``micro_batches``) waits for the next group, at most two of the
stage's recent rounds (and ``MERGE_S``), and runs with it, so the groups settle as
``micro_batches`` rounds of the share.

A stage holding the whole model can feed a session itself
(``OpenSession.feed_steps``): from one step its gateway sends, it generates
several tokens, each sampled token the input of the next step, with no round
trip through the gateway between them. Such a step runs on in the device
thread, round after round, while every session of the round feeds itself, its
KV blocks hold the next token, and nothing new waits on trio (a frame, a close,
a move); its tokens leave from the device thread as they come.

A stage of a cut serving one stream computes that session's next decode step on
the link's reader thread that reads it (:mod:`hetmesh.node.stage_lane`): after a
round of the one session's decode step whose output left at once, the device
thread parks instead of returning to trio, and the reader thread computes the next
step and sends its output on, the device thread still parked; anything that needs
trio (another session, a prefill chunk, a control request) wakes it back to the
batching loop. A step that starts a new KV block takes it on the reader thread
from the pool's free blocks (``SessionKV.extend``); only with none free does it go
to trio, whose ``_grow`` may evict cached blocks or preempt a session. Each decode
step of a session here that the lane does not take is counted by its reason
(``StageStatistics.lane_refused``).

A verify step (speculative decoding, issue 48) carries a session's last token and
its drafts (``Activations.drafts``), which every stage passes on: the head stage
computes the head on all of its rows, draws each as plain decoding would, and sends
the drafts its draws agree with plus its own next token in one ``Tokens`` frame. A
step whose first position is below the session's cached length drops the tail
there first (a rejected draft's KV: ``SessionKV.truncate``, no copy).

A session can move here from another peer with its KV (see
:mod:`hetmesh.node.migration`): it is opened with ``migrate_from``, holds its
activations until the KV arrives from that peer, and then runs like any other.
The peer it moved off keeps the KV frame it sent until the gateway confirms the
move (its ``CloseSession`` once a step ran on the new route; at most
:data:`HANDED_S`): the gateway of a first step that stalls asks for it once more
(a frame lost as a drained node leaves), and a step that still reaches it is
answered with ``NoRoute("moved session …")``, which the gateway sends again on
its new route. A draining node leaves only once its moves are confirmed.

A long prompt's prefill can be split with an idle replica (see
:mod:`hetmesh.node.split`): the session's stage then runs its prompt's chunks
from the helper's hidden states through the later units only, samples the
first token as usual, and holds the next step until the helper's KV of the
earlier units is in; the helper's own session runs the earlier units, sends on
to the stage, hands its KV over after the last chunk and lets go.

A session belongs to the peers of its route: only its gateway (the peer that
opened it) may close it, and only the stage before this one (the gateway, for
the first stage) may feed it. A member sending anything else for it gets
``InvalidRequest`` and the session is untouched.

Outputs leave from the device thread itself as soon as the forward ends
(``send_now``: a link write that cannot wait on the peer), with no hop through
trio on the way; what cannot go at once — a busy or full link, a hop to this
node — goes through one outbox per destination peer, drained by its own task.
The batching loop never waits on a send, so a frozen next hop holds up only
the sessions routed through it (their frames wait, then fail), never the
others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import trio

from hetmesh.error_codec import error_code
from hetmesh.errors import ComputeError, InvalidRequest, MeshError, NoRoute, Rejected
from hetmesh.node.control import CloseSession, MoveSession, OpenSession, Reply
from hetmesh.node.gateway import Send
from hetmesh.node.kvcache import KVLimits, KVManager, KVStatistics, Stamp
from hetmesh.node.migration import check_kv, kv_frame
from hetmesh.node.outcomes import MID_STEP, MOVED_SESSION
from hetmesh.node.split import is_helped_chunk, span_of, split_role
from hetmesh.node.stage_groups import GATHER_S as DEFAULT_GATHER_S
from hetmesh.node.stage_groups import (
    Groups,
    gather_seconds,
    groups_enabled,
    merge_seconds,
    micro_batches_env,
)
from hetmesh.node.stage_lane import PARK_S, Lane
from hetmesh.partition.blocks import BLOCK_TOKENS, blocks_for
from hetmesh.partition.grammar import Grammars
from hetmesh.partition.kv import SessionKV
from hetmesh.partition.prefill import MAX_PREFILL_CHUNKS, max_prefill_chunks
from hetmesh.partition.sampling import Sampler
from hetmesh.partition.stage import StageModule
from hetmesh.protocol.logprobs import wire_of
from hetmesh.resources import PeerId
from hetmesh.speculative.accept import accepted, verify
from hetmesh.transport.frames import MAX_DRAFTS, Activations, Error, Frame, KVBlock, Tokens
from hetmesh.transport.priority import data_path_thread

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

# activations of one session waiting here: a gateway sends one step at a time, a long
# prefill in up to this many chunks
QUEUED_PER_SESSION = MAX_PREFILL_CHUNKS
OUTBOX_FRAMES = 64  # frames waiting for one peer; past that its sessions fail here
OUTBOX_IDLE_S = 60.0  # an outbox's task ends after this long without a frame
# the longest gap between two frames of one burst (a round's outputs upstream), by
# default (HETMESH_STAGE_GATHER_MS sets a stage server's: stage_groups.gather_seconds)
GATHER_S = DEFAULT_GATHER_S
# how long a stage keeps a moved session's KV frame for its gateway to confirm the move
HANDED_S = 30.0
# rounds a stage ran before their times bound a small group's wait to merge (_merge_wait)
MERGE_ROUNDS_SEEN = 4


@dataclass(slots=True)
class _Awaiting:
    """A session waiting for KV it does not compute: a migration's (all of its layers,
    every position) or a split prefill's (the helper's layers, the prompt's positions)."""

    source: PeerId
    layers: slice  # the stage's layers the KV fills
    held: list[_Item] = field(default_factory=list)  # activations that must wait for it
    # a split prefill's KV that came while the session was in a batch: loaded after it
    deferred: tuple[KVBlock, Callable[[], None]] | None = None


@dataclass(slots=True)
class _Handed:
    """A session this stage moved away, its KV frame kept until the gateway confirms
    the move (or asks for the frame again), or until ``until`` (monotonic clock)."""

    kv_to: PeerId
    gateway: PeerId
    frame: KVBlock
    until: float


@dataclass(slots=True)
class _Session:
    request: OpenSession
    kv: SessionKV
    sampler: Sampler | None
    awaiting: _Awaiting | None = None
    feed_left: int = 0  # tokens this stage still generates from its gateway's last step
    prompt_from: int | None = None  # a split prefill's first position (its first chunk's)

    @property
    def publishable(self) -> bool:
        """Whether its blocks hold every layer's KV (the prefix cache may name them):
        not while it waits for KV, never on a split prefill's helper (its own units only)."""
        return self.awaiting is None and split_role(self.request) != "helper"


@dataclass(slots=True)
class _Item:
    session_id: str
    step: int
    positions: tuple[int, ...]
    inputs: torch.Tensor
    release: Callable[[], None]
    # a verify step's drafts: its inputs at positions[1:] (speculative decoding, issue 48)
    drafts: tuple[int, ...] = ()


@dataclass(slots=True)
class _Outcome:
    item: _Item
    session: _Session | None = None
    # hidden states; a sampled token; a verify step's tokens (a tuple)
    output: torch.Tensor | int | tuple[int, ...] | None = None
    error: MeshError | None = None
    sent: bool = False  # its frame already left from the device thread
    follow: bool = False  # its token is the session's next input here (a fed session)


def _no_release() -> None:
    """A step this stage fed itself holds no link buffer."""


SendNow = Callable[[PeerId, Frame], bool]
"""Writes a frame to a peer at once from any thread if that cannot wait (True), or
does nothing (False: it goes through the outbox); raises ``TransportError``."""


@dataclass(frozen=True, slots=True)
class StageStatistics:
    start: int
    end: int
    rounds: int
    items: int
    tokens: int
    errors: int
    queue_depth: int
    recent_step_s: tuple[float, ...]
    kv: KVStatistics
    device_rounds: int = 0  # rounds run on in the device thread (fed sessions, no trio)
    helped: int = 0  # split prefills whose first units this stage ran for another peer
    lane_steps: int = 0  # steps taken from a link's reader thread (hetmesh.node.stage_lane)
    # decode steps of a session here the lane did not take, by reason (see StageServer.offer)
    lane_refused: tuple[tuple[str, int], ...] = ()
    lane_blocks: int = 0  # KV blocks the lane's steps took (no trio _grow for them)
    # a head stage's verify steps (speculative decoding): steps, drafts they carried,
    # drafts kept, tokens they sent
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0


@dataclass(slots=True)
class _Counters:
    rounds: int = 0
    items: int = 0
    tokens: int = 0
    errors: int = 0
    device_rounds: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=32))

    def note_round(self, items: int, tokens: int, elapsed_s: float) -> None:
        self.rounds += 1
        self.items += items
        self.tokens += tokens
        self.recent.append(elapsed_s)


class StageServer:
    """Serves ``stage`` to many sessions; see the module docstring."""

    def __init__(
        self,
        stage: StageModule,
        *,
        limits: KVLimits,
        send: Send,
        max_batch: int = 32,
        device_limiter: trio.CapacityLimiter | None = None,
        threads: int | None = None,
        send_now: SendNow | None = None,
        micro_batches: int | None = None,
        grammars: Grammars | None = None,
        lane: bool = False,
    ) -> None:
        """``send``: a frame to a peer, from trio; ``send_now``: the fast path from the
        device thread (None: every frame goes through trio); ``micro_batches``: the
        share of the open sessions one round may take (1: all of them at once;
        None: 1 for a stage holding the whole model, which has no next stage to
        overlap with, else ``HETMESH_STAGE_MICRO_BATCHES`` or 2); ``grammars``: the
        model's grammar engine (api, issue 49);
        ``lane``: whether the device thread parks for its session's next step, offered
        from a link's reader thread (:meth:`offer`): only where the links offer it
        frames (a stage nobody offers to must not park: each step would then wait
        for trio to wake it first)."""
        self.stage = stage
        self._grammars = grammars
        self._threads = threads or torch.get_num_threads()
        self.pool = stage.new_pool(_pool_blocks(stage, limits))
        self.kv = KVManager(limits, pool=self.pool, factory=lambda: stage.new_kv(self.pool))
        self._send = send
        self._send_now = send_now
        self._max_batch = max_batch
        if micro_batches is None:
            whole = stage.has_embed and stage.has_head
            micro_batches = 1 if whole else (micro_batches_env() or 2)
        self._micro_batches = max(1, micro_batches)
        # each session's last round here: a gather ends once its burst is in
        self._groups = Groups() if groups_enabled() else None
        self._gather_s = gather_seconds()  # a burst's longest gap between frames
        self._merge_s = merge_seconds()  # a burst too small for a round: its wait to merge
        self._limiter = device_limiter or trio.CapacityLimiter(1)
        self._sessions: dict[str, _Session] = {}
        # bounded: at most QUEUED_PER_SESSION items of each session it admitted (as
        # many as a gateway's prefill chunks where HETMESH_PREFILL_MAX_CHUNKS says more)
        self._queued_cap = max(QUEUED_PER_SESSION, _chunks_cap())
        inbox_items = self._queued_cap * max(limits.max_sessions, 1)
        self._inbox_send, self._inbox = trio.open_memory_channel[_Item](inbox_items)
        self._queued: dict[str, int] = {}  # session id -> its items in the inbox or pending
        self._pending: deque[_Item] = deque()
        self._inflight: set[str] = set()  # sessions in the batch on the device thread
        # closed while in flight, with its block hashes: freed after the batch
        self._closing: dict[str, tuple[int, ...]] = {}
        self._counters = _Counters()
        self._outboxes: dict[PeerId, trio.MemorySendChannel[Frame]] = {}
        self._senders: trio.Nursery | None = None
        self._sending = 0  # frames being sent by the outbox tasks right now
        self._unsent: dict[str, int] = {}  # session id -> its frames in an outbox, unsent
        # set on trio when something waits for the batching loop: a step running on in
        # the device thread then returns after its round
        self._lane: Lane[_Item] = Lane()
        self._lane_on = lane
        self._lane_refused: Counter[str] = Counter()  # by reason; from the reader threads
        self._lane_count = threading.Lock()
        self._lane_blocks = 0
        self._parked_ready: list[_Outcome] = []  # the last round run while parked
        self._wants_trio = False
        self._parked_s = 0.0  # of the batch on the device thread: time parked, not computing
        self._trio_token: trio.lowlevel.TrioToken | None = None
        # (items, tokens, seconds) of each round of the batch on the device thread
        self._rounds: list[tuple[int, int, float]] = []
        self._helped = 0  # split prefills this stage helped with (its part sent on)
        self._handed: dict[str, _Handed] = {}  # sessions moved away, not confirmed yet

    @property
    def _interrupt(self) -> bool:
        """Set on trio when something waits for the batching loop: a step running on in
        the device thread then returns after its round, a parked one at once."""
        return self._wants_trio

    @_interrupt.setter
    def _interrupt(self, value: bool) -> None:
        self._wants_trio = value
        if value:
            self._lane.wake()

    # -- control ----------------------------------------------------------------

    def handle(
        self, request: OpenSession | CloseSession | MoveSession, sender: PeerId | None = None
    ) -> Reply:
        """Apply a control request from ``sender`` (None: this node itself); never raises
        for the peer's mistakes.

        Only a session's gateway may close or move it, and a peer opens sessions for
        itself only.
        """
        if isinstance(request, MoveSession):
            return self.move(request, sender)
        if isinstance(request, CloseSession):
            try:
                self.check_control(request.session_id, sender)
            except InvalidRequest as exc:
                return Reply.failed(exc)
            handed = self._handed.get(request.session_id)
            if handed is not None and sender in (None, handed.gateway):
                del self._handed[request.session_id]  # its move is confirmed
            # its gateway's close: one it could not open everywhere keeps its place
            self.close(request.session_id, request.block_hashes, requeue=True)
            return Reply(ok=True)
        if sender is not None and sender != request.gateway:
            return Reply.failed(
                InvalidRequest(
                    f"peer {sender} may not open session {request.session_id} "
                    f"for gateway {request.gateway}"
                )
            )
        if (request.start, request.end) != (self.stage.start, self.stage.end):
            return Reply.failed(
                NoRoute(
                    f"this node serves units [{self.stage.start}, {self.stage.end}), "
                    f"not [{request.start}, {request.end})"
                )
            )
        if request.feed_steps > 1 and not (self.stage.has_embed and self.stage.has_head):
            return Reply.failed(
                InvalidRequest("only a stage holding the whole model feeds a session itself")
            )
        migrating = bool(request.migrate_from)
        if migrating and request.split:
            return Reply.failed(InvalidRequest("a migrating session's prefill is not split"))
        # its place in line is its gateway's to give: one gateway cannot take another's
        stamp = (
            Stamp(request.order_s, f"{request.gateway}/{request.order_id}")
            if request.order_id
            else None
        )
        try:
            kv = self.kv.open(
                request.session_id,
                request.max_tokens,
                request.prompt_tokens,
                () if migrating else request.prefix_hashes,  # its KV comes whole
                stamp=stamp,
                scope=request.gateway,  # its blocks are shared with its gateway's only
            )
        except (Rejected, InvalidRequest) as exc:  # busy, or a session it can never hold
            return Reply.failed(exc)
        helping = split_role(request) == "helper"  # runs the prompt's first units only
        sampler = _sampler(request, self._grammars) if self.stage.has_head and not helping else None
        awaiting = None
        if migrating:
            awaiting = _Awaiting(request.migrate_from, slice(None))
        elif request.helper:  # the helper computes the prompt's first units' KV
            first_units = self.stage.layer_slice(self.stage.start, request.split)
            awaiting = _Awaiting(request.helper, first_units)
        self._sessions[request.session_id] = _Session(request, kv, sampler, awaiting)
        # the gateway starts the prompt at the fewest tokens any stage has cached
        return Reply(ok=True, cached_tokens=kv.length)

    def move(self, request: MoveSession, sender: PeerId | None = None) -> Reply:
        """Send the session's KV to ``request.kv_to`` and let it go, or (without
        ``kv_to``) take its new neighbours; from its gateway only, between steps."""
        sid = request.session_id
        session = self._sessions.get(sid)
        if session is None:
            return self._move_again(request, sender)
        try:
            self.check_control(sid, sender)
        except InvalidRequest as exc:
            return Reply.failed(exc)
        # a batch parked after its step (hetmesh.node.stage_lane) is not mid-step: asked
        # first, while the parked thread still waits (the interrupt below sends it back)
        in_step = sid in self._inflight and not self._lane.call_off()
        self._interrupt = True
        if not request.kv_to:
            session.request = dataclasses.replace(
                session.request,
                next_peer=request.next_peer or session.request.next_peer,
                previous_peer=request.previous_peer or session.request.previous_peer,
            )
            return Reply(ok=True)
        if in_step or self._queued.get(sid) or session.awaiting is not None:
            # mid-step (or still arriving itself): the gateway asks again, then replays
            return Reply.failed(Rejected(f"{MID_STEP}session {sid} is mid-step here"))
        keys, values = session.kv.export()  # a copy: the blocks are freed below
        frame = kv_frame(sid, keys, values)
        if not self._post(request.kv_to, frame):
            return Reply.failed(Rejected(f"busy: the link to {request.kv_to} is full"))
        self._sessions.pop(sid)
        self.kv.close(sid)
        self.kv.note_migration_out()
        gateway = session.request.gateway
        self._handed[sid] = _Handed(request.kv_to, gateway, frame, time.monotonic() + HANDED_S)
        log.info("session %s: %d tokens of KV sent to %s", sid, keys.shape[2], request.kv_to)
        return Reply(ok=True)

    def _move_again(self, request: MoveSession, sender: PeerId | None) -> Reply:
        """A move of a session handed over already: its gateway asks for the KV frame
        once more (to the same peer), or ``InvalidRequest("unknown session …")``."""
        sid = request.session_id
        handed = self._handed.get(sid)
        if handed is None or request.kv_to != handed.kv_to or sender not in (None, handed.gateway):
            return Reply.failed(InvalidRequest(f"unknown session {sid}"))
        if not self._post(handed.kv_to, handed.frame):
            return Reply.failed(Rejected(f"busy: the link to {handed.kv_to} is full"))
        log.info("session %s: its KV sent to %s once more", sid, handed.kv_to)
        return Reply(ok=True)

    def handed_to(self, session_id: str) -> tuple[PeerId, PeerId] | None:
        """``(gateway, new peer)`` of a session this stage moved away and whose move is
        not confirmed yet; None for any other."""
        handed = self._handed.get(session_id)
        return None if handed is None else (handed.gateway, handed.kv_to)

    def tell_moved(self, session_id: str) -> None:
        """A step of a session moved away reached this stage: tell its gateway (a
        ``NoRoute("moved session …")``: it sends the step again on the new route)."""
        handed = self._handed.get(session_id)
        if handed is None:
            return
        error = NoRoute(f"{MOVED_SESSION}{session_id}: it moved to {handed.kv_to}")
        frame = Error(code=error_code(error), message=str(error), session_id=session_id)
        self._post(handed.gateway, frame)

    def handing(self) -> bool:
        """Whether a moved session's KV is kept here for its gateway to confirm (a
        draining node waits for that, a retiring stage too)."""
        now = time.monotonic()
        for sid in [sid for sid, handed in self._handed.items() if handed.until <= now]:
            del self._handed[sid]
        return bool(self._handed)

    def receive_kv(
        self, frame: KVBlock, release: Callable[[], None], sender: PeerId | None = None
    ) -> None:
        """Load KV sent by ``sender`` (None: this node) for a session waiting for it (a
        migration's, or a split prefill's from its helper) and let its held
        activations run; ``InvalidRequest`` when it was not expected from that peer.

        A bad frame from the session's source fails the session (its gateway
        replays it); one from any other peer leaves the session untouched. A split
        prefill's KV that comes while the session is in a batch loads after it.
        """
        sid = frame.session_id
        session = self._sessions.get(sid)
        awaiting = session.awaiting if session is not None else None
        try:
            if session is None or awaiting is None or awaiting.deferred is not None:
                raise InvalidRequest(f"no KV of session {sid} is expected here")
            if sender is not None and sender != awaiting.source:
                raise InvalidRequest(
                    f"session {sid} takes its KV from {awaiting.source} only, not {sender}"
                )
        except InvalidRequest:
            release()
            raise
        if sid in self._inflight:  # its own layers are being written: after the batch
            awaiting.deferred = (frame, release)
            self._interrupt = True
            return
        self._load_kv(sid, session, awaiting, frame, release)

    def _load_kv(
        self,
        sid: str,
        session: _Session,
        awaiting: _Awaiting,
        frame: KVBlock,
        release: Callable[[], None],
    ) -> None:
        request = session.request
        migrating = bool(request.migrate_from)
        try:
            start = 0 if migrating else session.prompt_from
            try:
                if start is None:
                    raise InvalidRequest("the KV came before the prompt's first chunk")
                length = request.prompt_tokens - start
                keys, values = check_kv(
                    frame,
                    num_layers=len(range(self.pool.num_layers)[awaiting.layers]),
                    kv_heads=self.pool.kv_heads,
                    head_dim=self.pool.head_dim,
                    dtype=self.pool.dtype,
                    length=_migrated_length(frame, length) if migrating else length,
                    start=start,
                )
                if migrating:  # a rejected drafts' tail stays behind
                    session.kv.load(keys[:, :, :length], values[:, :, :length])
                else:
                    if not session.kv.reserve(request.prompt_tokens):
                        raise Rejected("the stage's KV pool is full")
                    session.kv.fill(awaiting.layers.start or 0, start, keys, values)
            except (InvalidRequest, Rejected) as exc:
                log.warning("session %s: KV refused: %s", sid, exc)
                if migrating:  # its sender hears it too (an Error frame from the caller)
                    self._fail(session, sid, InvalidRequest(f"migrated KV refused: {exc}"))
                    self.close(sid)
                    raise
                # not its client's fault: its gateway replays it whole. Nothing is raised:
                # the caller would tell the sender, and where the helper shares the
                # gateway's node that Error could reach the gateway before this ComputeError
                # and end the stream (seen once under load)
                self._fail(session, sid, ComputeError(f"the helper's KV refused: {exc}"))
                self.close(sid)
                return
        finally:
            release()  # loaded (copied into the pool) or refused
        session.awaiting = None
        if migrating:
            self.kv.note_migration_in(keys.nbytes + values.nbytes)
        self.kv.get(sid)
        for item in awaiting.held:
            self._enqueue(item)

    def kv_frame_bytes(self, session_id: str) -> int | None:
        """The most payload bytes a KVBlock of ``session_id`` may carry here (None: no KV
        of it is awaited); asked from a link's reader thread, before allocation."""
        session = self._sessions.get(session_id)
        if session is None or (session.awaiting is None and not session.request.migrate_from):
            return None
        # a migrated session's KV sent again when it is in already (its gateway asked its
        # source once more): read and refused here, not on the link (that would close it)
        span = session.awaiting.layers if session.awaiting is not None else slice(None)
        pool, layers = self.pool, len(range(self.pool.num_layers)[span])
        per_token = 2 * layers * pool.kv_heads * pool.head_dim * pool.dtype.itemsize
        # a migrated KV may hold a verify step's rejected drafts past its length
        tail = MAX_DRAFTS if session.request.migrate_from else 0
        return per_token * (session.request.prompt_tokens + tail)

    def check_control(self, session_id: str, sender: PeerId | None) -> None:
        """``InvalidRequest`` unless ``sender`` (None: this node) may close or cancel the
        session: its gateway. An unknown session has nothing to protect."""
        session = self._sessions.get(session_id)
        if session is None or sender is None or sender == session.request.gateway:
            return
        raise InvalidRequest(
            f"session {session_id} belongs to gateway {session.request.gateway}, not {sender}"
        )

    def check_feed(self, session_id: str, sender: PeerId | None) -> None:
        """``InvalidRequest`` unless ``sender`` (None: this node) is the peer that feeds
        the session here: the previous stage, or the gateway for the first stage."""
        session = self._sessions.get(session_id)
        if session is None or sender is None:
            return
        feeder = session.request.previous_peer or session.request.gateway
        if sender != feeder and sender != session.request.helper:
            raise InvalidRequest(
                f"session {session_id} takes activations from {feeder} only, not {sender}"
            )

    def close(
        self, session_id: str, block_hashes: tuple[int, ...] = (), *, requeue: bool = False
    ) -> None:
        """Free a session's KV cache at once, or right after the batch computing it
        (unknown ids are ignored). ``block_hashes`` name its full blocks for the
        prefix cache first; ``requeue``: see :meth:`KVManager.close`."""
        if session_id in self._inflight:
            self._closing[session_id] = block_hashes
            self._interrupt = True
            return
        session = self._sessions.pop(session_id, None)
        if session is not None and session.awaiting is not None:
            for item in session.awaiting.held:  # the KV never came
                item.release()
            if session.awaiting.deferred is not None:
                session.awaiting.deferred[1]()
        elif session is not None and block_hashes and session.publishable:
            session.kv.publish(block_hashes)
        # its blocks return to the pool (named ones stay cached)
        self.kv.close(session_id, requeue=requeue)

    def expire_idle(self) -> list[str]:
        expired = [sid for sid in self.kv.idle_sessions() if sid not in self._inflight]
        for sid in expired:
            self.close(sid)
        self.kv.note_expired(len(expired))
        return expired

    # -- data -------------------------------------------------------------------

    def submit(
        self, frame: Activations, release: Callable[[], None], sender: PeerId | None = None
    ) -> None:
        """Queue an activation frame from ``sender`` (None: this node); ``InvalidRequest``
        for an unknown session or a sender that does not feed it. A session whose KV is
        still on its way here holds the frame until it arrives."""
        session = self._sessions.get(frame.session_id)
        if session is None:
            release()
            raise InvalidRequest(f"unknown session {frame.session_id}")
        try:
            self.check_feed(frame.session_id, sender)
            if len(frame.tensors) != 1:
                raise InvalidRequest(
                    f"expected one tensor per activation, got {len(frame.tensors)}"
                )
            if frame.drafts and len(frame.drafts) != len(frame.positions) - 1:
                raise InvalidRequest(
                    f"{len(frame.drafts)} drafts for a step of {len(frame.positions)} positions"
                )
            queued = self._queued.get(frame.session_id, 0)
            prompt = is_helped_chunk(frame.positions, session.request)  # its helper's chunk
            if session.awaiting is not None and not prompt:
                queued = len(session.awaiting.held)
            if queued >= self._queued_cap:  # one step at a time: this is a flood
                raise InvalidRequest(
                    f"session {frame.session_id} already has {queued} activations waiting here"
                )
        except InvalidRequest:
            release()
            raise
        item = _Item(
            frame.session_id, frame.step, frame.positions, frame.tensors[0], release, frame.drafts
        )
        session.feed_left = session.request.feed_steps  # a step from its feeder: a new feed
        if session.request.split and session.prompt_from is None and item.positions:
            session.prompt_from = item.positions[0]
        if session.awaiting is not None and not prompt:
            session.awaiting.held.append(item)
            return
        self._enqueue(item)

    def _enqueue(self, item: _Item) -> None:
        try:
            self._inbox_send.send_nowait(item)
        except trio.WouldBlock:  # not reached while each session keeps to its share
            item.release()
            raise Rejected(
                f"busy: stage [{self.stage.start}, {self.stage.end}) inbox is full"
            ) from None
        self._queued[item.session_id] = self._queued.get(item.session_id, 0) + 1
        self.kv.get(item.session_id)  # marks it in use: a generating session is never idle
        self._interrupt = True

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The batching loop; never returns, whatever one batch does."""
        self._trio_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as senders:
            self._senders = senders
            task_status.started()
            await self._batches()

    async def _batches(self) -> None:
        while True:
            batch = await self._grow(await self._next_batch())
            if not batch:
                continue
            outcomes = [_Outcome(item, self._sessions.get(item.session_id)) for item in batch]
            self._inflight = {item.session_id for item in batch}
            # items left for the next round: a fed round must not run on past them
            self._interrupt = bool(self._pending) or bool(
                self._inbox.statistics().current_buffer_used
            )
            self._rounds = []
            self._parked_s = 0.0
            started = time.perf_counter()
            try:
                await trio.to_thread.run_sync(self._compute, outcomes, limiter=self._limiter)
            except Exception as exc:  # a bug must not take the stage down: fail this batch
                log.exception("stage [%d, %d) batch failed", self.stage.start, self.stage.end)
                for outcome in outcomes:
                    outcome.error = outcome.error or ComputeError(f"stage failed: {exc!r}")
            finally:
                for sid in self._inflight:  # idle time counts from the end of its last step
                    if sid in self.kv:
                        self.kv.get(sid)
                    session = self._sessions.get(sid)
                    # prompt blocks now full join the prefix cache (all layers written)
                    if session is not None and session.publishable:
                        session.kv.publish(session.request.prefix_hashes)
                self._inflight = set()
                for sid, hashes in sorted(self._closing.items()):
                    self.close(sid, hashes)
                self._closing.clear()
                self._load_deferred()
            rounds = self._rounds or [
                (len(batch), sum(item.inputs.shape[0] for item in batch), 0.0)
            ]
            # the first round's time counts the hand-off to the device thread and back
            handoff = time.perf_counter() - started - sum(r[2] for r in rounds) - self._parked_s
            for i, (items, tokens, elapsed) in enumerate(rounds):
                self._counters.note_round(items, tokens, elapsed + (handoff if i == 0 else 0.0))
            self._counters.device_rounds += len(rounds) - 1
            for outcome in outcomes:  # the batch's last round (see _compute)
                self._deliver(outcome)

    def _load_deferred(self) -> None:
        """Load the split prefills' KV that came while their sessions were in a batch."""
        for sid, session in list(self._sessions.items()):
            awaiting = session.awaiting
            if awaiting is None or awaiting.deferred is None:
                continue
            frame, release = awaiting.deferred
            awaiting.deferred = None
            with contextlib.suppress(InvalidRequest, Rejected):  # failed and closed
                self._load_kv(sid, session, awaiting, frame, release)

    async def _grow(self, batch: list[_Item]) -> list[_Item]:
        """Give the batch's sessions blocks for their new tokens, oldest session first.

        On the trio thread, before the forward: the pool's bookkeeping never
        races the device thread. Sessions preempted to make room (newest
        first, see :meth:`KVManager.grow`) leave the stage; their gateways get
        a ``Rejected`` error and resume them later by replaying their history.
        """
        failed: list[tuple[str, _Session, MeshError]] = []
        order = {sid: i for i, sid in enumerate(self._sessions)}
        for item in sorted(batch, key=lambda it: order.get(it.session_id, -1)):
            session = self._sessions.get(item.session_id)
            if session is None:
                continue  # closed, or preempted just now
            start = item.positions[0] if item.positions else session.kv.length
            if start < session.kv.length:
                with contextlib.suppress(InvalidRequest):  # else the forward reports it
                    if start % BLOCK_TOKENS == 0:  # the pipeline agreed on a shorter prefix
                        session.kv.rewind(start)
                    else:  # a verify step's rejected drafts: drop the tail, keep its blocks
                        session.kv.truncate(start)
            try:
                preempted = self.kv.grow(
                    item.session_id, session.kv.length + int(item.inputs.shape[0])
                )
            except InvalidRequest as exc:  # more than the whole pool: no preemption helps
                failed.append((item.session_id, session, exc))
                self.close(item.session_id)
                continue
            for sid in preempted:
                log.info("session %s preempted on [%d, %d): KV pool full", sid, *self._units)
                error: MeshError = Rejected(
                    f"preempted: the KV pool of stage [{self._units[0]}, {self._units[1]}) is full"
                )
                failed.append((sid, self._sessions.pop(sid), error))
            if item.session_id in self._sessions and session.feed_left > 1:
                # blocks for the rest of its feed too, where they are free (no one is
                # preempted for them): the device thread then feeds it on across a
                # block's end instead of handing the round back here for one
                ahead = session.kv.length + int(item.inputs.shape[0]) + session.feed_left - 1
                session.kv.reserve(min(ahead, session.request.max_tokens))
        kept = []
        for item in batch:
            if item.session_id in self._sessions:
                kept.append(item)
            else:
                item.release()
        for sid, session, error in failed:
            self._fail(session, sid, error)
        return kept

    def _fail(self, session: _Session, session_id: str, error: MeshError) -> None:
        """Tell the session's gateway it failed here (a lost gateway is its own timeout)."""
        self._counters.errors += 1
        error_frame = Error(code=error_code(error), message=str(error), session_id=session_id)
        if not self._post(session.request.gateway, error_frame):
            log.warning("session %s: cannot report %s: its gateway is stuck", session_id, error)

    def _post(self, peer: PeerId, frame: Frame) -> bool:
        """Queue ``frame`` for ``peer`` without waiting; False when that peer's outbox is
        full (it takes nothing: frozen, or too slow for what it is sent)."""
        outbox = self._outboxes.get(peer)
        if outbox is None:
            assert self._senders is not None, "serve() is not running"
            outbox, frames = trio.open_memory_channel[Frame](OUTBOX_FRAMES)
            self._outboxes[peer] = outbox
            self._senders.start_soon(self._drain, peer, frames)
        try:
            outbox.send_nowait(frame)
        except trio.WouldBlock:
            return False
        self._unsent[_session_of(frame)] = self._unsent.get(_session_of(frame), 0) + 1
        return True

    async def _drain(self, peer: PeerId, frames: trio.MemoryReceiveChannel[Frame]) -> None:
        """Send ``peer``'s frames in order; ends (and forgets the outbox) once idle."""
        while True:
            frame: Frame | None = None
            with trio.move_on_after(OUTBOX_IDLE_S):
                frame = await frames.receive()
            if frame is None:
                try:  # nothing awaits between this check and forgetting the outbox
                    frame = frames.receive_nowait()
                except trio.WouldBlock:
                    del self._outboxes[peer]
                    return
            self._sending += 1
            try:
                await self._send(peer, frame)  # the link gives each send a deadline
            except MeshError as exc:  # the gateway recovers the session (death or timeout)
                session = _session_of(frame)
                log.warning("session %s: cannot send to %s: %s", session, peer, exc)
            finally:
                self._sending -= 1
                left = self._unsent.pop(_session_of(frame), 1) - 1
                if left > 0:
                    self._unsent[_session_of(frame)] = left

    def sending(self) -> bool:
        """Whether frames wait in an outbox or are being sent (a migration's KV among them)."""
        queued = any(o.statistics().current_buffer_used for o in self._outboxes.values())
        return queued or self._sending > 0

    @property
    def _units(self) -> tuple[int, int]:
        return self.stage.start, self.stage.end

    async def _next_batch(self) -> list[_Item]:
        if not self._pending:
            self._pending.append(await self._inbox.receive())
        # micro-batches: a round takes a share of the open sessions, so while the
        # next stage computes this round's outputs, this stage computes the rest
        share = -(-len(self._sessions) // self._micro_batches)
        limit = min(self._max_batch, max(1, share))
        await self._gather(limit)
        batch: list[_Item] = []
        seen: set[str] = set()
        deferred: deque[_Item] = deque()
        while self._pending and len(batch) < limit:
            item = self._pending.popleft()
            if item.session_id in seen:  # a session's next step waits for the next round
                deferred.append(item)
            else:
                seen.add(item.session_id)
                batch.append(item)
                left = self._queued.pop(item.session_id, 1) - 1
                if left > 0:
                    self._queued[item.session_id] = left
        self._pending.extendleft(reversed(deferred))
        if self._groups is not None:
            self._groups.ran(
                (item.session_id for item in batch), self._sessions, trio.current_time()
            )
        return batch

    async def _gather(self, limit: int) -> None:
        """Take what the inbox holds; while fewer than ``limit`` sessions wait, keep
        taking items that follow each other within the gap (:data:`GATHER_S` unless
        ``HETMESH_STAGE_GATHER_MS`` says otherwise), unless every
        session of the waiting sessions' last rounds here is in
        (:mod:`hetmesh.node.stage_groups`: the burst is complete).

        The previous stage sends a round's outputs one right after another: a
        stage that started on the first of them would split the micro-batch in
        two rounds, and the pipeline's groups would crumble into single steps.
        """
        merge_until: float | None = None  # a burst too small for a round waits this long
        while True:
            try:
                self._pending.append(self._inbox.receive_nowait())
                continue
            except trio.WouldBlock:
                pass
            waiting = {item.session_id for item in self._pending}
            if len(waiting) >= limit:
                return
            wait = self._gather_s
            if self._too_small(waiting, limit):  # wait for the next group, to run with it
                now = trio.current_time()
                if merge_until is None:
                    merge_until = now + self._merge_wait()
                wait = merge_until - now
                if wait <= 0:
                    return  # no group came: it runs as it is
            elif (
                self._groups is not None
                and 2 * len(waiting) >= limit  # a lone straggler waits to rejoin a round
                and self._groups.complete(waiting, self._sessions)
            ):
                return  # every session of their last rounds here is in: the burst ended
            with trio.move_on_after(wait):
                self._pending.append(await self._inbox.receive())
                continue
            return

    def _merge_wait(self) -> float:
        """How long a group too small for the micro-batches waits for the next one: the
        merge's wait, but no more than two of this stage's recent rounds (the next group
        comes in about a round behind; a group that does not is not coming soon, and the
        sessions waiting would pay for it), and never less than the gap."""
        wait = self._merge_s
        recent = self._counters.recent
        if len(recent) >= MERGE_ROUNDS_SEEN:
            wait = min(wait, 2.0 * statistics.median(recent))
        return max(wait, self._gather_s)

    def _too_small(self, waiting: set[str], limit: int) -> bool:
        """Whether the waiting burst, decode steps only, is a group too small for the
        micro-batches (:meth:`Groups.too_small`): it then waits to merge with the next."""
        if self._groups is None or self._merge_s <= 0:
            return False
        if any(item.inputs.shape[0] != 1 for item in self._pending):  # a prefill's chunk
            return False
        return self._groups.too_small(
            waiting, self._sessions, limit, self._micro_batches, trio.current_time()
        )

    def _compute(self, outcomes: list[_Outcome]) -> None:
        """Runs on the device thread: one forward for the whole batch if it can.

        Sessions were resolved on the trio thread and cannot be freed while
        the batch is in flight (see :meth:`close`).
        """
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # binds this thread's OpenMP team
        data_path_thread()  # trio's worker thread: not as nice as trio's (HETMESH_CONTROL_NICE)
        first = list(outcomes)
        ready: list[_Outcome] = []
        for outcome in outcomes:
            session, item = outcome.session, outcome.item
            if session is None:
                outcome.error = InvalidRequest(f"session {item.session_id} was closed")
            elif item.positions[:1] != (session.kv.length,):
                outcome.error = InvalidRequest(
                    f"session {item.session_id}: activation starts at position "
                    f"{item.positions[:1]}, the cache holds {session.kv.length}"
                )
            else:
                ready.append(outcome)
        via_trio: set[str] = set()  # sessions whose tokens went to trio in an earlier round
        try:
            while True:
                began = time.perf_counter()
                self._forward_isolated(ready)
                self._rounds.append(
                    (
                        len(ready),
                        sum(o.item.inputs.shape[0] for o in ready),
                        time.perf_counter() - began,
                    )
                )
                following = self._follow_here(ready, via_trio)
                if following is None:
                    break
                outcomes[:] = ready = following  # the batch's outcomes are its last round's
            if self._send_now is not None:
                self._send_outputs(ready, self._send_now, via_trio)
                # one item, none failed before the forward (its Error goes from trio)
                if len(outcomes) == 1 and len(ready) == 1 and ready[0] is outcomes[0]:
                    outcomes[:] = self._run_parked(ready)
        finally:
            for outcome in first:
                outcome.item.release()

    # -- the fast lane (hetmesh.node.stage_lane) ------------------------------------

    def offer(self, frame: Activations, release: Callable[[], None], sender: PeerId | None) -> bool:
        """From a link's reader thread: hand ``frame`` to the device thread parked after
        its session's last step, if it can run there with no help from trio (True: it
        is the stage's now); False: it goes through trio (:meth:`submit`) as before.

        Taken: one decode step (one position, right after what the session's cache
        holds) of the session the parked round computed, from the peer that feeds it,
        with nothing of it queued, unsent or closing; a step that starts a new block
        takes it here if one is free. A refused decode step of a session here is
        counted by its reason (:attr:`StageStatistics.lane_refused`).
        """
        if len(frame.positions) != 1 or len(frame.tensors) != 1 or sender is None:
            return False
        sid = frame.session_id
        refused = "not parked"  # the device thread is in trio, or busy: accept never ran

        def accept() -> _Item | None:
            nonlocal refused
            session = self._sessions.get(sid)
            if session is None:
                refused = ""  # not this stage's session (another stage of this node's)
                return None
            if sid not in self._inflight or sid in self._closing:
                refused = "not in flight"
                return None
            request = session.request
            if self._wants_trio:
                refused = "trio waits"
                return None
            if session.awaiting is not None or request.split:
                refused = "split or awaiting KV"
                return None
            if sender != (request.previous_peer or request.gateway):
                refused = "sender"
                return None
            if self._queued.get(sid) or self._unsent.get(sid):
                refused = "queued or unsent"
                return None
            kv = session.kv
            if frame.positions[0] != kv.length:
                refused = "position"
                return None
            if kv.capacity <= kv.length:  # a new block: a free one, else trio's _grow
                if not kv.extend(kv.length + 1):
                    refused = "no free block"
                    return None
                self._lane_blocks += 1  # under the lane's lock
            return _Item(sid, frame.step, frame.positions, frame.tensors[0], release)

        if self._lane.offer(accept, self._step_offered):
            return True
        if refused and sid in self._sessions:
            with self._lane_count:
                self._lane_refused[refused] += 1
        return False

    def _may_park(self, ready: list[_Outcome]) -> bool:
        """Whether the device thread waits here for the session's next step: one
        session's step of a cut, sent on at once, and nothing else for trio to batch."""
        if not self._lane_on or len(ready) != 1 or self._wants_trio or self._trio_token is None:
            return False
        outcome = ready[0]
        session = outcome.session
        if not outcome.sent or outcome.error is not None or outcome.follow or session is None:
            return False
        if self.stage.has_embed and self.stage.has_head:  # whole model: it feeds itself
            return False
        # a decode step (a prefill chunk's successor is a chunk: trio's) of the one
        # session here: with more, another's frame would wake it back to trio on the
        # critical path, and trio's rounds batch them anyway
        one_step = int(outcome.item.inputs.shape[0]) == 1
        return one_step and len(self._sessions) == 1 and not session.request.split

    def _stay_parked(self) -> bool:
        """Asked by the parked thread: nothing waits for trio or for the device."""
        return not self._wants_trio and not self._limiter.statistics().tasks_waiting

    def _run_parked(self, ready: list[_Outcome]) -> list[_Outcome]:
        """On the device thread: while :meth:`_may_park`, park while the reader threads
        compute the session's next steps (:meth:`_step_offered`); returns the last
        round's outcomes (trio delivers them, see :meth:`_compute`)."""
        self._parked_ready = ready
        if self._may_park(ready):
            self._parked_s += self._lane.park(PARK_S, self._stay_parked)
        return self._parked_ready

    def _step_offered(self, item: _Item) -> bool:
        """On the reader thread that read ``item`` (accepted by :meth:`offer`), while the
        device thread is parked: compute it, send its output on from here; whether the
        device thread stays parked. Never raises: a failure goes to trio's delivery."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # binds this thread's OpenMP team
        outcome = _Outcome(item, self._sessions.get(item.session_id))
        try:
            began = time.perf_counter()
            self._forward_isolated([outcome])
            self._rounds.append((1, int(item.inputs.shape[0]), time.perf_counter() - began))
            if self._send_now is not None:
                self._send_outputs([outcome], self._send_now)
        except Exception as exc:  # a bug must not take the reader down: fail the step
            log.exception("stage [%d, %d) step failed", self.stage.start, self.stage.end)
            outcome.error = outcome.error or ComputeError(f"stage failed: {exc!r}")
        finally:
            item.release()
        self._parked_ready = [outcome]
        return self._may_park(self._parked_ready)

    def _forward_isolated(self, ready: list[_Outcome]) -> None:
        try:
            self._forward(ready)
        except MeshError:
            for outcome in ready:  # isolate the culprit: run each alone
                try:
                    self._forward([outcome])
                except MeshError as exc:
                    outcome.error = exc

    def _follow_here(self, ready: list[_Outcome], via_trio: set[str]) -> list[_Outcome] | None:
        """On the device thread: the next round of a round whose sessions all feed
        themselves, with the round's tokens sent on from here; None to end the batch
        (a session ends its feed or fails, needs a new KV block, or trio has news)."""
        if not ready or self._interrupt or self._trio_token is None:
            return None
        for outcome in ready:
            session = outcome.session
            if not outcome.follow or outcome.error is not None or session is None:
                return None
            if session.awaiting is not None:  # its next step waits for a helper's KV
                return None
            kv = session.kv
            if kv.capacity <= kv.length and not kv.extend(kv.length + 1):
                return None  # no free block: trio's _grow
        following = []
        for outcome in ready:
            outcome.follow = False  # fed here: trio does not feed it again
            following.append(_Outcome(_next_step(outcome), outcome.session))
        # the round's tokens, in order with the session's others
        if self._send_now is not None:
            self._send_outputs(ready, self._send_now, via_trio)
        for outcome in ready:
            if not outcome.sent:
                via_trio.add(outcome.item.session_id)
                try:
                    self._trio_token.run_sync_soon(self._deliver, outcome)
                except trio.RunFinishedError:  # the node is stopping
                    return None
        return following

    def _send_outputs(
        self, outcomes: list[_Outcome], send_now: SendNow, via_trio: AbstractSet[str] = frozenset()
    ) -> None:
        """On the device thread: send each output whose link takes it at once.

        A session has one step in flight at a time (its gateway feeds it one step
        after another, a long prefill in chunks); a session whose earlier frame
        still waits in an outbox (counted in ``_unsent`` before this round began)
        or went to trio in an earlier round of this batch (``via_trio``) sends
        through the outbox, so no frame overtakes an earlier one of its own.
        """
        for outcome in outcomes:
            if outcome.error is not None or outcome.session is None:
                continue
            sid = outcome.item.session_id
            if self._unsent.get(sid) or sid in via_trio:  # behind its last frame
                continue
            if sid in self._closing:  # closed (or moved) while computed: nobody waits
                continue
            frame = _output_frame(outcome.item, outcome.output)
            if frame is None:
                continue
            try:
                outcome.sent = send_now(outcome.session.request.next_peer, frame)
            except MeshError as exc:  # the outbox's send meets it again and drops the link
                log.info("session %s: direct send failed: %s", outcome.item.session_id, exc)

    def _forward(self, outcomes: list[_Outcome]) -> None:
        if not outcomes:
            return
        if self.stage.has_head and any(o.item.drafts for o in outcomes):
            # a verify step needs the head on every row: a forward of its own
            self._forward([o for o in outcomes if not o.item.drafts])
            for outcome in outcomes:
                if outcome.item.drafts:
                    self._forward_verify(outcome)
            return
        sessions = [o.session for o in outcomes if o.session is not None]
        # a prefill chunk short of the prompt's end samples nothing: no head for it
        pairs = list(zip(outcomes, sessions, strict=True))
        samples = [_samples(o.item, s) for o, s in pairs]
        spans = [span_of(o.item.positions, s.request) for o, s in pairs]
        results = self.stage.forward_batch(
            [(o.item.inputs, s.kv) for o, s in pairs],
            last_only=self.stage.has_head,
            heads=samples if self.stage.has_head else None,
            spans=spans if any(spans) else None,
        )
        for outcome, session, result, sampled in zip(
            outcomes, sessions, results, samples, strict=True
        ):
            if session.sampler is None:
                outcome.output = result.contiguous()
                continue
            if not sampled:
                continue  # its next chunk samples
            try:  # one session's draw failing fails that session, not the batch
                token = session.sampler(result[-1], outcome.item.step)
            except MeshError as exc:
                outcome.error = exc
                continue
            outcome.output = token
            request = session.request
            if request.feed_steps > 1:  # it feeds itself until its feed, or it, ends
                session.feed_left -= 1
                outcome.follow = (
                    session.feed_left > 0
                    and token not in request.stop_ids
                    and session.kv.length < request.max_tokens - 1
                )

    def _forward_verify(self, outcome: _Outcome) -> None:
        """A head stage's verify step: logits on all ``k + 1`` rows, and the tokens
        :func:`~hetmesh.speculative.accept.verify` keeps (row ``i`` drawn as plain
        decoding draws step ``step + i``). A session that draws within a grammar or
        reports log-probabilities keeps row 0's token only (its drafts ignored: the
        grammar would advance on a rejected draw, and a frame carries one token's
        log-probabilities)."""
        session, item = outcome.session, outcome.item
        assert session is not None  # _forward's outcomes all have one
        sampler = session.sampler
        if sampler is None:  # a split prefill's helper: it samples nothing
            outcome.error = InvalidRequest("a verify step for a stage that samples nothing")
            return
        (logits,) = self.stage.forward_batch([(item.inputs, session.kv)])  # (k + 1, vocab)
        plain = sampler.constraint is not None or sampler.params.logprobs is not None
        drafts = () if plain else item.drafts
        try:
            tokens = verify(
                drafts, lambda i: int(sampler(logits[i], item.step + i)), session.request.stop_ids
            )
        except MeshError as exc:
            outcome.error = exc
            return
        outcome.output = tuple(tokens)
        counters = self._counters
        counters.verify_steps += 1
        counters.drafted += len(item.drafts)
        counters.accepted += accepted(drafts, tokens)
        counters.verified_tokens += len(tokens)

    def _deliver(self, outcome: _Outcome) -> None:
        item, session = outcome.item, outcome.session
        if session is None or item.session_id not in self._sessions:
            return  # closed meanwhile: nobody waits for it
        request = session.request
        if outcome.error is not None:
            # anything but a bad request reads as the stage's own failure: ComputeError
            failure = outcome.error
            # a bad chunk from a split prefill's helper is not the client's fault either
            bad_input = isinstance(failure, InvalidRequest)
            if bad_input and is_helped_chunk(item.positions, request):
                bad_input = False
            code = error_code(failure if bad_input else ComputeError)
            log.info(
                "session %s failed on [%d, %d): %s",
                item.session_id,
                request.start,
                request.end,
                outcome.error,
            )
            self._counters.errors += 1
            error = Error(code=code, message=str(failure), session_id=item.session_id)
            if not self._post(request.gateway, error):
                log.warning("session %s: its gateway takes no frames", item.session_id)
            return
        frame = None if outcome.sent else _output_frame(item, outcome.output)
        if frame is not None and not self._post(request.next_peer, frame):
            # the next hop takes nothing: fail the session here, its gateway replays it
            self._fail(
                session, item.session_id, ComputeError(f"next hop {request.next_peer} is stuck")
            )
            return
        if split_role(request) == "helper" and _samples(item, session):
            self._hand_over(item.session_id, session)  # the prompt's last chunk: done here
            return
        if outcome.follow:  # its token is its next step here
            if session.awaiting is not None:  # the helper's KV first
                session.awaiting.held.append(_next_step(outcome))
                return
            try:
                self._enqueue(_next_step(outcome))
            except Rejected as exc:
                self._fail(session, item.session_id, exc)

    def _hand_over(self, session_id: str, session: _Session) -> None:
        """A split prefill's helper, after the prompt's last chunk: send the KV of its
        units to the session's stage and let the session go (its work is done)."""
        request = session.request
        layers = self.stage.layer_slice(self.stage.start, request.split)
        start = session.prompt_from or 0
        keys, values = session.kv.export(layers, start)
        if not self._post(request.next_peer, kv_frame(session_id, keys, values, start)):
            self._fail(session, session_id, ComputeError(f"next hop {request.next_peer} is stuck"))
        self._helped += 1
        self.close(session_id)

    def _lane_counts(self) -> tuple[tuple[str, int], ...]:
        with self._lane_count:
            return tuple(sorted(self._lane_refused.items()))

    def statistics(self) -> StageStatistics:
        c = self._counters
        return StageStatistics(
            start=self.stage.start,
            end=self.stage.end,
            rounds=c.rounds,
            items=c.items,
            tokens=c.tokens,
            errors=c.errors,
            queue_depth=len(self._pending) + self._inbox.statistics().current_buffer_used,
            recent_step_s=tuple(c.recent),
            kv=self.kv.statistics(),
            device_rounds=c.device_rounds,
            helped=self._helped,
            lane_steps=self._lane.taken,
            lane_refused=self._lane_counts(),
            lane_blocks=self._lane_blocks,
            verify_steps=c.verify_steps,
            drafted=c.drafted,
            accepted=c.accepted,
            verified_tokens=c.verified_tokens,
        )


def _chunks_cap() -> int:
    """A gateway's most prefill chunks as this process's environment says (a bad value
    is the gateway's error to report: here the default)."""
    try:
        return max_prefill_chunks()
    except InvalidRequest:
        return MAX_PREFILL_CHUNKS


def _session_of(frame: Frame) -> str:
    """The session a frame is for ("" for one that names none)."""
    return str(getattr(frame, "session_id", ""))


def _sampler(request: OpenSession, grammars: Grammars | None) -> Sampler:
    """A head stage's sampler for a session; a request with a grammar (response_format,
    tools: api, issue 49) draws within it (:mod:`hetmesh.partition.grammar`)."""
    return Sampler(request.sampling, grammars, drawn=request.drawn)


def _samples(item: _Item, session: _Session) -> bool:
    """Whether a head stage samples from this item: not from a prefill chunk short of
    the prompt's end (its next chunk does)."""
    positions = item.positions
    return not positions or positions[-1] + 1 >= session.request.prompt_tokens


def _next_step(outcome: _Outcome) -> _Item:
    """The step a session feeds itself: its sampled token, at the next position."""
    assert outcome.session is not None
    assert isinstance(outcome.output, int)
    item = outcome.item
    return _Item(
        item.session_id,
        item.step + 1,
        (outcome.session.kv.length,),
        torch.tensor([outcome.output]),
        _no_release,
    )


def _output_frame(item: _Item, output: torch.Tensor | int | tuple[int, ...] | None) -> Frame | None:
    """What a computed item sends on: a sampled token, a verify step's tokens (the
    first at the position after the step's first input), or the hidden states."""
    if isinstance(output, tuple):
        return Tokens(
            session_id=item.session_id,
            step=item.step,
            token_ids=output,
            position=item.positions[0] + 1,
        )
    if isinstance(output, int):
        # the token's place in the sequence: right after the item's last position
        position = item.positions[-1] + 1 if item.positions else 0
        return Tokens(
            session_id=item.session_id,
            step=item.step,
            token_ids=(int(output),),
            position=position,
            logprobs=wire_of(output),  # a Sampled token's log-probabilities (api issue 49)
        )
    if output is None:
        return None
    end = item.positions[-1] + 1 if item.positions else 0
    return Activations(
        session_id=item.session_id,
        step=item.step,
        positions=tuple(range(end - output.shape[0], end)),
        tensors=(output,),
        drafts=item.drafts,  # the head stage compares them with its draws
    )


def _migrated_length(frame: KVBlock, length: int) -> int:
    """The positions a migrated KV frame holds, if ``length`` and at most
    :data:`MAX_DRAFTS` more (the source's cache past the step the session moved
    after: a verify step's rejected drafts, dropped here), else ``length`` (refused)."""
    keys = frame.tensors[0] if frame.tensors else None
    if keys is None or keys.dim() != 4:
        return length
    held = int(keys.shape[2])
    return held if length <= held <= length + MAX_DRAFTS else length


def _pool_blocks(stage: StageModule, limits: KVLimits) -> int:
    """Blocks of the stage's KV budget (a stage without layers holds no KV: any count)."""
    per_block = BLOCK_TOKENS * stage.kv_bytes_per_token()
    if per_block == 0:
        return limits.max_sessions * blocks_for(limits.max_tokens_per_session)
    return limits.budget_bytes // per_block
