"""The stages this node serves: the sole owner of its :class:`StageServer`\\ s.

```
StageHost
├── reconcile()   pure: which stages to load, which retire, for the followed plan
├── follow(plan)  carries it out: loads (fetch + load, with retries), retirements
├── control()     the one path of a session control request: StageServer.handle
├── deliver()     frames for a stage here (activations, KV, cancels)
├── offer()       a decode step, from a link's reader thread to a parked stage
└── drain, retire_idle, expire_loop
```

A stage the plan no longer gives this node keeps serving (and admitting)
until every stage it does give is loaded, unless holding both would exceed the
memory the node offers (:func:`~hetmesh.node.memory.must_release_first`): then
the old stages retire at once and a new one loads once they are gone; a
draining node retires them all. A load the plan leaves behind while it runs is
cancelled (:func:`~hetmesh.partition.materialise.cancel_on`): it stops within a
tensor and what it loaded is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery.wire import Load
from hetmesh.errors import InvalidRequest, MeshError, NoRoute
from hetmesh.node.config import ServingConfig
from hetmesh.node.control import CloseSession, MoveSession, Reply, Request
from hetmesh.node.kvcache import kv_counters, stage_kv_limits
from hetmesh.node.memory import must_release_first
from hetmesh.node.stage_lane import lane_enabled
from hetmesh.node.stage_server import SendNow, StageServer
from hetmesh.partition.grammar import Grammars
from hetmesh.partition.text import load_tokenizer
from hetmesh.resources import PeerId
from hetmesh.scheduler.announcement import ServedStage
from hetmesh.scheduler.prefix_summary import SUMMARY_BLOCKS, encode_summary, salted
from hetmesh.scheduler.records import Plan, PlanConstraints
from hetmesh.transport import Activations, Frame, KVBlock, Link
from hetmesh.transport.frames import Cancel
from hetmesh.transport.priority import nice_control_thread

if TYPE_CHECKING:
    from hetmesh.node.gateway import Send
    from hetmesh.shards.fetch import Shards

log = logging.getLogger(__name__)

Key = tuple[int, int]  # a stage's (first unit, end unit)

STAGE_LOAD_ATTEMPTS = 3  # a stage's fetch + load, before the node gives it up
STAGE_LOAD_RETRY_S = 2.0  # times the attempt number, between attempts


@dataclass(frozen=True, slots=True)
class Reconcile:
    """What to do for the followed plan: stages to start loading, and whether each
    served stage retires."""

    load: tuple[Key, ...]
    retiring: Mapping[Key, bool]


def reconcile(
    mine: Set[Key], served: Mapping[Key, bool], loading: Set[Key], draining: bool
) -> Reconcile:
    """``mine``: the stages the plan gives us; ``served``: each loaded stage -> whether
    it retires already. A stage leaves only once every stage of ``mine`` is loaded
    (until then the old ones keep serving, also when a new stage's load fails for
    good); draining retires them all and loads nothing."""
    load = () if draining else tuple(sorted(mine - served.keys() - loading))
    loaded = mine <= served.keys()
    retiring = {
        key: draining or (key not in mine and (loaded or was)) for key, was in served.items()
    }
    return Reconcile(load, retiring)


@dataclass(slots=True)
class _Served:
    server: StageServer
    scope: trio.CancelScope
    retiring: bool = False


def plan_steps(stages: Iterable[tuple[bool, Sequence[float]]]) -> tuple[float, ...]:
    """The step times a node announces (``load.recent_step_s``): the last four of each
    stage it serves for the plan, given ``(retiring, recent steps)`` per stage.

    A retiring stage's steps are left out: the coordinator compares a node's steps
    with what the plan predicts for the stages it now gives that node
    (``calibration.measured_constraints``), and a node moved from a long stage to a
    short one would otherwise read as far slower than it claimed, and be moved again
    (a float32 cut under load swapped two hosts this way every few minutes).
    """
    return tuple(x for retiring, steps in stages if not retiring for x in steps[-4:])


class StageHost:
    """Loads, serves and retires this node's stages; see the module docstring.

    ``held``: called when the shards fetched units (the held units are announced);
    ``changed``: when a stage became ready (the stages are announced).
    """

    def __init__(
        self,
        *,
        model_dir: Path,
        model_key: str,
        config: ServingConfig,
        constraints: PlanConstraints,
        device: str,
        device_limiter: trio.CapacityLimiter,
        send: Send,
        send_now: SendNow,
        held: Callable[[], None],
        changed: Callable[[], None],
    ) -> None:
        self.model_dir = model_dir
        self.model_key = model_key
        # the model's grammar engine (JSON-schema output), its tokenizer built on first use
        self.grammars = Grammars(functools.partial(load_tokenizer, model_dir))
        self.config = config
        self.constraints = constraints
        self.device = device
        self.weights = "float32"  # the format stages load in (the calibration settles it)
        self.shards: Shards | None = None
        self.summary_salt = b""  # the mesh-private key of announced prefix names (serving)
        self._limiter = device_limiter
        self._send = send
        self._send_now = send_now
        self._held = held
        self._changed = changed
        self._served: dict[Key, _Served] = {}
        self._loading: set[Key] = set()
        self._mine: set[Key] = set()  # the stages the followed plan gives us
        self._draining = False  # stopping: every stage retires, its sessions move away
        self._nursery: trio.Nursery | None = None
        # memory: what the plans charged each stage, the node's offer (set by Serving)
        self.capacity: Callable[[], int | None] = lambda: None
        self._charges: dict[Key, int] = {}
        self._freed = trio.Event()  # set (and replaced) whenever a stage lets go
        self._waiting = 0  # loads waiting for room
        self._cancels: dict[Key, threading.Event] = {}  # each running load's cancel event
        self.cancelled_loads = 0  # loads stopped because the plan moved on

    def start(self, nursery: trio.Nursery) -> None:
        """Run stages (and their loads) in ``nursery``; on trio's thread, which
        ``HETMESH_CONTROL_NICE`` makes nicer than the stages' data path."""
        self._nursery = nursery
        nice_control_thread()

    # -- what is served ---------------------------------------------------------

    def servers(self) -> dict[Key, StageServer]:
        """Every stage server here, retiring ones too."""
        return {key: s.server for key, s in sorted(self._served.items())}

    def serving(self) -> dict[Key, StageServer]:
        """The stage servers taking sessions (not retiring)."""
        return {key: s.server for key, s in sorted(self._served.items()) if not s.retiring}

    def holding(self) -> bool:
        """Whether a stage is served or loading here (its memory is the plan's charge)."""
        return bool(self._served or self._loading)

    def sessions(self) -> int:
        """Sessions the stages here hold."""
        return sum(s.server.kv.statistics().sessions for s in self._served.values())

    def busy(self) -> bool:
        """Sessions held here, or moved ones' KV still on its way out or not yet
        confirmed by their gateways (they may ask for it again)."""
        return bool(self.sessions()) or any(
            s.server.sending() or s.server.handing() for s in self._served.values()
        )

    def announced(self) -> tuple[tuple[ServedStage, ...], tuple[dict[str, Any], ...], Load]:
        """The stages, their servers' counters and the load, as announced."""
        served = list(self._served.values())
        stats = [s.server.statistics() for s in served]
        stages = tuple(
            ServedStage(model=self.model_key, start=a, end=b, ready=not s.retiring)
            for (a, b), s in sorted(self._served.items())
        )
        counters = tuple(
            {k: v for k, v in as_dict(s).items() if k != "kv" and k != "recent_step_s"}
            | kv_counters(s.kv)
            for s in stats
        )
        load = Load(
            queue_depth=sum(s.queue_depth for s in stats),
            active_sessions=sum(s.kv.sessions for s in stats),
            kv_bytes_used=sum(s.kv.bytes_used for s in stats),
            kv_bytes_free=sum(max(0, s.kv.budget_bytes - s.kv.bytes_reserved) for s in stats),
            recent_step_s=plan_steps(
                (x.retiring, s.recent_step_s) for x, s in zip(served, stats, strict=True)
            ),
        )
        return stages, counters, load

    def kv_frame_bytes(self, session_id: str) -> int | None:
        """The most payload bytes a KVBlock of ``session_id`` may carry to one of our
        stages (None: none awaits it); see ``frames.Limits.kv_block_bytes``."""
        sizes = [s.server.kv_frame_bytes(session_id) for s in list(self._served.values())]
        return max((n for n in sizes if n is not None), default=None)

    def prefix_summaries(self) -> dict[Key, str]:
        """What each of our ready stages holds in its prefix cache, as announced."""
        return {
            key: encode_summary(
                salted(server.pool.prefix.recent_hashes(SUMMARY_BLOCKS), self.summary_salt)
            )
            for key, server in self.serving().items()
        }

    # -- following the plan -----------------------------------------------------

    def follow(self, plan: Plan, me: PeerId) -> None:
        """Load the stages ``plan`` gives ``me``; retire the others once they are."""
        mine = [s for p in plan.pipelines for s in p.stages if s.peer_id == me]
        self._mine = {(s.start, s.end) for s in mine}
        self._charges.update({(s.start, s.end): s.memory_bytes for s in mine})
        for key, cancel in self._cancels.items():
            if key not in self._mine:  # left behind: stop it (it restarts if it comes back)
                cancel.set()
        step = self._reconcile()
        assert self._nursery is not None
        for key in step.load:
            self._loading.add(key)
            self._nursery.start_soon(self._load, *key)
        self._retire(step)
        if any(self._crowded(key) for key in self._mine - self._served.keys()):
            for key, served in self._served.items():  # no room to keep them meanwhile
                served.retiring = served.retiring or key not in self._mine
        self._let_go()  # a waiting load checks the new plan (its stage may be gone, or fit)

    def _crowded(self, key: Key) -> bool:
        held = self._served.keys() | self._loading
        return must_release_first(self._charges, held, self._mine, key, self.capacity())

    def _let_go(self) -> None:
        self._freed.set()
        self._freed = trio.Event()

    def _reconcile(self) -> Reconcile:
        served = {key: s.retiring for key, s in self._served.items()}
        return reconcile(self._mine, served, self._loading, self._draining)

    def _retire(self, step: Reconcile) -> None:
        for key, retiring in step.retiring.items():
            self._served[key].retiring = retiring

    async def _load(self, start: int, end: int) -> None:
        from hetmesh.partition.materialise import LoadCancelled, cancel_on
        from hetmesh.partition.stage import load_stage

        def load(cancel: threading.Event) -> Any:
            with cancel_on(cancel):
                return load_stage(
                    self.model_dir, start, end, device=self.device, weights=self.weights
                )

        log.info(
            "loading units [%d, %d) of %s on %s in %s",
            *(start, end, self.model_key, self.device, self.weights),
        )
        began = time.perf_counter()
        attempt = 0
        while True:
            attempt += 1
            try:
                if self.shards is not None:  # a node without them fetches the stage's tensors
                    await self.shards.ensure(start, end)
                    self._held()
                self._waiting += 1
                try:  # the stages leaving must go first: both would not fit
                    while self._crowded((start, end)) and (start, end) in self._mine:
                        await self._freed.wait()
                finally:
                    self._waiting -= 1
                if (start, end) not in self._mine:
                    self._loading.discard((start, end))
                    self._let_go()
                    return
                cancel = self._cancels[(start, end)] = threading.Event()
                try:
                    stage = await trio.to_thread.run_sync(load, cancel, limiter=self._limiter)
                finally:
                    del self._cancels[(start, end)]
                break
            except LoadCancelled:
                if (start, end) in self._mine:  # left behind, then given back: again
                    continue
                log.info("loading units [%d, %d) cancelled: the plan moved on", start, end)
                self.cancelled_loads += 1
                self._loading.discard((start, end))
                self._let_go()
                return
            except MeshError as exc:
                # a holder may come back, a disk may be freed: retry a few times while the
                # plan still wants the stage (the old stages serve meanwhile: reconcile)
                if attempt >= STAGE_LOAD_ATTEMPTS or (start, end) not in self._mine:
                    log.error(
                        "loading units [%d, %d) failed (attempt %d): %s; giving up",
                        *(start, end, attempt, exc),
                    )
                    self._loading.discard((start, end))
                    self._let_go()
                    return
                log.warning(
                    "loading units [%d, %d) failed (attempt %d of %d): %s; retrying",
                    *(start, end, attempt, STAGE_LOAD_ATTEMPTS, exc),
                )
                await trio.sleep(STAGE_LOAD_RETRY_S * attempt)
        if (start, end) not in self._mine and self._waiting:  # loaded too late: room first
            log.info("units [%d, %d) loaded after the plan moved on: dropped", start, end)
            self._loading.discard((start, end))
            del stage
            self._let_go()
            return
        self._run(start, end, stage)
        log.info(
            "stage [%d, %d) ready: %d parameters in %.1f s",
            *(start, end, stage.param_count(), time.perf_counter() - began),
        )
        self._changed()

    def _run(self, start: int, end: int, stage: Any) -> None:
        limits = stage_kv_limits(
            max_context_tokens=self.constraints.max_context_tokens,
            max_sessions=self.config.max_sessions,
            planned_sessions=self.constraints.max_sessions,
            pool_tokens=self.config.kv_pool_tokens,
            kv_bytes_per_token=stage.kv_bytes_per_token(),
            idle_timeout_s=self.config.idle_session_s,
        )
        if self.config.kv_reserve_whole:  # the old admission, for comparisons
            limits = dataclasses.replace(limits, reserve_whole=True)
        server = StageServer(
            stage,
            limits=limits,
            send=self._send,
            device_limiter=self._limiter,
            threads=self.config.threads,
            send_now=self._send_now,
            grammars=self.grammars,
            lane=lane_enabled(),  # as serving.py wires the links' offers (stage_lane)
        )
        scope = trio.CancelScope()
        assert self._nursery is not None

        async def run() -> None:
            with scope:
                await server.serve()

        self._nursery.start_soon(run)
        self._served[(start, end)] = _Served(server, scope)
        self._loading.discard((start, end))
        self._retire(self._reconcile())  # the last new stage loaded: the old ones retire now

    def retire_idle(self) -> None:
        """Stop the retiring stages no session uses any more."""
        for key, served in list(self._served.items()):
            server = served.server  # idle, and no moved session's KV still leaving
            idle = server.kv.statistics().sessions == 0
            if served.retiring and idle and not server.sending() and not server.handing():
                served.scope.cancel()
                del self._served[key]
                log.info("stage [%d, %d) retired", *key)
                self._let_go()

    def start_draining(self) -> None:
        """Every stage retires (its sessions move away); nothing loads any more."""
        self._draining = True
        self._retire(self._reconcile())

    async def drain(self, drain_s: float, move: Callable[[], None]) -> None:
        """Wait up to ``drain_s`` for the sessions here to move away (``move``: asks
        the node's own gateway to move those entering here, every 50 ms)."""
        if self.sessions():
            log.info("draining: %d sessions to move off this node", self.sessions())
        with trio.move_on_after(drain_s):
            while self.busy():
                move()
                await trio.sleep(0.05)
        if self.sessions():
            log.warning("drained for %.1f s: %d sessions left to replay", drain_s, self.sessions())

    async def expire_loop(self) -> None:
        """Free idle sessions' KV caches, forever."""
        while True:
            await trio.sleep(min(30.0, self.config.idle_session_s / 4))
            for served in self._served.values():
                for sid in served.server.expire_idle():
                    log.info(
                        "session %s expired after %.0f s idle", sid, self.config.idle_session_s
                    )

    # -- requests and frames ----------------------------------------------------

    def _holder(self, session_id: str) -> StageServer | None:
        """The stage here holding ``session_id``'s KV (None: none does)."""
        return next((s.server for s in self._served.values() if session_id in s.server.kv), None)

    def _handed(self, session_id: str) -> StageServer | None:
        """The stage here that moved ``session_id`` away, its move not confirmed yet."""
        servers = [s.server for s in self._served.values()]
        return next((s for s in servers if s.handed_to(session_id) is not None), None)

    def control(self, request: Request, sender: PeerId | None = None) -> Reply:
        """Apply a session control request from ``sender`` (None: this node): every
        kind goes to the stage's :meth:`StageServer.handle`, the one path (only a
        session's gateway may close or move it)."""
        if isinstance(request, MoveSession):
            # a session moved away already: its gateway may ask for the KV again
            holder = self._holder(request.session_id) or self._handed(request.session_id)
            if holder is None:
                return Reply.failed(InvalidRequest(f"unknown session {request.session_id}"))
            return holder.handle(request, sender)
        if isinstance(request, CloseSession):
            # every stage here that may hold it: the close's block hashes join its prefix
            # cache (the next turn's prefix)
            for served in self._served.values():
                try:
                    served.server.check_control(request.session_id, sender)
                except InvalidRequest as exc:
                    return Reply.failed(exc)
            for served in self._served.values():
                served.server.handle(request, sender)
            return Reply(ok=True)
        target = self._served.get((request.start, request.end))
        if target is None or target.retiring:
            return Reply.failed(
                NoRoute(f"units [{request.start}, {request.end}) are not served here")
            )
        return target.server.handle(request, sender)

    def offer(self, sender: PeerId, link: Link | None, frame: Frame) -> bool:
        """From ``link``'s reader thread: give a decode step to the stage whose device
        thread is parked for it (:meth:`StageServer.offer`); False: ``frame`` goes
        through trio (:meth:`deliver`) as before. Never raises. ``link`` None: a step
        of this node's own gateway (``sender``: this node), nothing to release."""
        if not isinstance(frame, Activations):
            return False
        try:  # trio may change the stages meanwhile: then this frame takes the slow way
            servers = [served.server for served in list(self._served.values())]
        except RuntimeError:
            return False
        release = _kept if link is None else functools.partial(link.release, frame)
        return any(server.offer(frame, release, sender) for server in servers)

    def deliver(self, frame: Frame, release: Callable[[], None], sender: PeerId | None) -> bool:
        """Hand a stage here its frame from ``sender`` (None: this node); False for a
        frame that is not a stage's (released). ``InvalidRequest`` for a session no
        stage here holds, ``Rejected`` for a full inbox."""
        if isinstance(frame, Activations | KVBlock):  # KV: a session migrating here
            holder = self._holder(frame.session_id)
            if holder is None:
                release()
                handed = self._handed(frame.session_id)
                if isinstance(frame, Activations) and handed is not None:
                    handed.tell_moved(frame.session_id)  # its gateway sends it again
                    return True
                if isinstance(frame, Activations):
                    raise InvalidRequest(f"unknown session {frame.session_id}")
                raise InvalidRequest(f"no KV of session {frame.session_id} is expected here")
            if isinstance(frame, Activations):
                holder.submit(frame, release, sender)
            else:
                holder.receive_kv(frame, release, sender)
            return True
        release()
        if isinstance(frame, Cancel):
            for served in self._served.values():
                served.server.check_control(frame.session_id, sender)
            for served in self._served.values():
                served.server.close(frame.session_id)
            return True
        return False


def _kept() -> None:
    """Nothing to release: a frame built in this process."""


def as_dict(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


__all__ = [
    "STAGE_LOAD_ATTEMPTS",
    "Reconcile",
    "StageHost",
    "as_dict",
    "plan_steps",
    "reconcile",
]
