"""Serving a model on the mesh: the node's root over its parts.

``Serving`` wires the parts, runs the plan tick, writes the node's one
:class:`~hetmesh.scheduler.announcement.ServingAnnouncement` (``_announce``)
and answers /hetmesh/session and /hetmesh/generate. The parts (drawn in
docs/architecture.md, "The node's parts"): the peer view
(:mod:`~hetmesh.node.peer_view`), the plan follower
(:mod:`~hetmesh.node.plan_follower`), the stage host
(:mod:`~hetmesh.node.stage_host`), the route chooser over pure routing inputs
(:mod:`~hetmesh.node.route_chooser`, :mod:`~hetmesh.node.routing`), the peer
calls (:mod:`~hetmesh.node.peer_calls`), the calibrator
(:mod:`~hetmesh.node.calibrator`) and the gateway (:mod:`~hetmesh.node.gateway`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery import wire
from hetmesh.errors import InvalidRequest, RemoteProtocolError
from hetmesh.node.calibrator import Calibrator
from hetmesh.node.config import PLANNED_SESSIONS, ServingConfig
from hetmesh.node.control import MAX_CONTROL_BYTES, SESSION_PROTOCOL, Reply, parse_request
from hetmesh.node.gateway import Gateway
from hetmesh.node.gateway_lane import SendNow, gateway_lane_own
from hetmesh.node.link_pool import DATAPLANE_PROTOCOL, LinkPool
from hetmesh.node.memory import device_capacity
from hetmesh.node.peer_calls import PeerCalls, data_plane_host, node_plane_config
from hetmesh.node.peer_view import PeerViews
from hetmesh.node.plan_follower import HOST_KEY, PlanFollower, unheld, verify_signature
from hetmesh.node.readiness import StageKey
from hetmesh.node.route_chooser import RouteChooser
from hetmesh.node.stage_host import StageHost, as_dict
from hetmesh.node.stage_lane import lane_enabled
from hetmesh.node.text_stream import answer_generate, encode_request, text_stream
from hetmesh.protocol.generate import (
    GENERATE_PROTOCOL,
    GenerateRequest,
    SamplingParams,
)
from hetmesh.resources import ModelProfile, PeerId
from hetmesh.scheduler.announcement import ServingAnnouncement, serving_extra, serving_stages
from hetmesh.scheduler.prefix_summary import summary_salt
from hetmesh.scheduler.records import Plan, PlanConstraints
from hetmesh.shards.fetch import SHARDS_PROTOCOL, Shards, open_shards
from hetmesh.shards.links import SHARD_LINK_PROTOCOL, shard_plane_config
from hetmesh.speculative.choose import LOOKUP, Speculation, gateway_speculation
from hetmesh.transport import DataPlane, Frame

if TYPE_CHECKING:
    from libp2p.abc import INetStream
    from trio_typing import TaskStatus

    from hetmesh.node.runtime import Node

log = logging.getLogger(__name__)

# the serving entries that move while tokens flow (the gateway's, the stage servers' and
# the shards' counters): nothing plans or routes on them, so a change of these alone is
# published with the load (Discovery.set_counters), not as a record version of its own
COUNTER_KEYS = frozenset({"gateway", "stage_servers", "shards"})
START_POLL_S = 0.05  # how often a node with no plan yet looks for a new peer record


@dataclass(frozen=True, slots=True)
class ServingStatistics:
    plan_epoch: int
    coordinator: str
    stages: tuple[tuple[int, int], ...]
    links: dict[str, str]
    insufficient: str


class Serving:
    """One node's share of serving a model; see the module docstring.

    Its parts are public, for the node and its tests: ``follower`` (the plan),
    ``stages`` (the stage servers), ``routes`` (routing), ``calls`` (peers),
    ``calibrator``, ``views`` (the peer view) and ``gateway``.
    """

    def __init__(self, node: Node, config: ServingConfig, model_dir: Path) -> None:
        from hetmesh.partition.profile import model_profile
        from hetmesh.partition.store import check_model_dir

        self.node = node
        self.config = config
        self.model_dir = model_dir
        self.draft_model: Any = None  # --draft FORMAT: its DraftModel (speculative decoding)
        model_config = check_model_dir(model_dir)
        # the planner's fallback for peers announcing no format; each device is
        # charged its own format's bytes (weights_constraints)
        self.profile: ModelProfile = model_profile(model_config, name=model_dir.name)
        self.model_key = self.profile.name
        self.constraints = PlanConstraints(
            max_context_tokens=min(config.max_context_tokens, self.profile.max_context),
            max_sessions=config.max_sessions or PLANNED_SESSIONS,
            reserve_bytes=config.reserve_bytes,
        )
        device = node.config.device or "cpu"
        discovery = node.discovery
        self.calibrator = Calibrator(
            model_dir=model_dir,
            model_config=model_config,
            profile=self.profile,
            constraints=self.constraints,
            config=config,
            device=device,
            device_limiter=node.device_limiter,
            local=lambda: discovery.local_record(advance=False),
        )
        self._announced = ServingAnnouncement()  # what the discovery record says of us
        self.views = PeerViews(self.model_key, discovery.alive)
        self.follower = PlanFollower(
            me=node.peer_id,
            profile=self.profile,
            constraints=self.constraints,
            config=config,
            started_at=trio.current_time(),
            key=node.host.get_private_key(),
            bytes_of=self.calibrator.bytes_of,
        )
        self.stages = StageHost(
            model_dir=model_dir,
            model_key=self.model_key,
            config=config,
            constraints=self.constraints,
            device=device,
            device_limiter=node.device_limiter,
            send=lambda peer, frame: self.calls.send(peer, frame),
            send_now=lambda peer, frame: self.calls.send_now(peer, frame),
            held=lambda: self._announce(),
            changed=lambda: self._publish(),
        )
        self.stages.capacity = lambda: device_capacity(  # a move releases first if need be
            discovery.local_record(advance=False).devices, node.peer_id, device
        )
        # the format this node's stages are held in: "native" is the checkpoint's own,
        # "auto" is settled by calibration
        self.stages.weights = self.calibrator.settle()
        self.calls = PeerCalls(
            me=node.peer_id, host=node.host, ping_s=config.timeouts.ping_s, stages=self.stages
        )
        self.routes = RouteChooser(
            me=node.peer_id,
            model_key=self.model_key,
            route_wait_s=config.route_wait_s,
            plan_interval_s=config.plan_interval_s,
            follower=self.follower,
            stages=self.stages,
            view=self.views.current,
            mine=lambda: self._announced,
            local=lambda: discovery.local_record(advance=False).load,
        )
        # announced prefix names are salted with a mesh-private key (issue 45, item 8)
        self.stages.summary_salt = self.routes.summary_salt = summary_salt(discovery.psk)
        self._applied: Plan | None = None  # the plan the stages last followed
        self.tokenizer: Any = None
        self.eos: frozenset[int] = frozenset()
        self.plane: DataPlane | None = None
        self.pool: LinkPool | None = None
        self.gateway: Gateway | None = None
        self.shards: Shards | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan this node follows."""
        return self.follower.plan

    @property
    def weights(self) -> str:
        """The format this node's stages are held in."""
        return self.stages.weights

    async def serve(self, *, task_status: TaskStatus[Serving] = trio.TASK_STATUS_IGNORED) -> None:
        from hetmesh.partition.text import eos_token_ids, load_tokenizer
        from hetmesh.transport import open_data_plane

        def load_text() -> tuple[Any, frozenset[int]]:
            tokenizer = load_tokenizer(self.model_dir)
            return tokenizer, frozenset(eos_token_ids(self.model_dir, tokenizer))

        self.tokenizer, self.eos = await trio.to_thread.run_sync(load_text)
        discovery = self.node.discovery
        plane_config = node_plane_config(self.node, self.config, self.profile, self.stages)
        async with (
            open_data_plane(plane_config) as plane,
            open_data_plane(shard_plane_config(plane_config)) as shard_plane,
            trio.open_nursery() as nursery,
        ):
            self.plane = plane
            self.pool = LinkPool(
                host=self.node.host,
                plane=plane,
                dispatch=self.calls.dispatch,
                nursery=nursery,
                offer=self.stages.offer if lane_enabled() else None,  # hetmesh.node.stage_lane
            )
            self.calls.start(nursery, self.pool)
            self.stages.start(nursery)
            self.gateway = Gateway(
                peer_id=self.node.peer_id,
                control=self.calls.control,
                send=self.calls.send,
                choose=self.routes.choose,
                ping=self.calls.ping,
                eos_token_ids=self.eos,
                max_context=self.constraints.max_context_tokens,
                timeouts=self.config.timeouts,
                prefix_cache=self.config.prefix_cache,
                migrate=self.config.migrate,
                chunk_costs=self.routes.chunk_costs,
                helper=self.routes.helper,
                send_now=self._lane_send_now(),  # hetmesh.node.gateway_lane
                speculation=await self._speculation(),
            )
            self.pool.peek = self.gateway.lane.offer
            self.calls.gateway = self.routes.gateway = self.gateway
            # the host: peers on ours reach us over loopback, whose RTT drift is our CPU's
            # (hetmesh.scheduler.replan.should_replan discounts it)
            discovery.set_data_plane(
                {"backends": list(plane.config.backends), HOST_KEY: announced_host()}
            )
            # the tensors it holds, offered to peers (hetmesh.shards: issue 15)
            self.shards = self.stages.shards = await open_shards(
                discovery, self.model_dir, self.model_key
            )
            if self.shards is not None:
                discovery.add_handler(SHARDS_PROTOCOL, self.shards.handle)
                # tensors over the data plane; the protocol above is the fallback
                links = self.shards.attach_links(self.node.host, shard_plane)
                discovery.add_handler(SHARD_LINK_PROTOCOL, links.handle)
            await self._calibrate()  # announced with (before) the model: planned together
            self._announce(model=self.model_key, host=self.calibrator.host())
            discovery.add_handler(DATAPLANE_PROTOCOL, self.pool.handle_incoming)
            discovery.add_handler(SESSION_PROTOCOL, self._handle_session)
            discovery.add_handler(GENERATE_PROTOCOL, self._handle_generate)
            self._publish()
            nursery.start_soon(self._plan_loop)
            nursery.start_soon(self.stages.expire_loop)
            # a dead peer's link closes and its sessions recover at once (issue 13, 7 and 8)
            nursery.start_soon(self.pool.close_dead, discovery.subscribe(), self.gateway.peer_gone)
            task_status.started(self)
            await trio.sleep_forever()

    async def _calibrate(self) -> None:
        """Settle the weight format and time it here (:class:`Calibrator`); announce both."""
        measured = await self.calibrator.measure_here(self.shards, self.stages.weights)
        self.stages.weights = measured.weights
        calibration = measured.calibration or self._announced.calibration
        self._announce(weights=measured.weights, calibration=calibration)

    # -- the plan -------------------------------------------------------------------

    def _tick(self) -> None:
        """One plan step: decide on the mesh now, follow what it adopted, announce it."""
        discovery = self.node.discovery
        view = self.views.current()
        discovery.local_record()  # publishes a changed record: our own, as planned on
        local = discovery.local_record(advance=False)  # its load the latest set
        verdict = unheld(view, self.profile, self.shards)  # no plan can serve those (issue 15)
        followed = self.follower.step(
            local, view, trio.current_time(), verdict, ready=self.routes.ready()
        )
        discovery.request_links(list(followed.missing_links))  # bounded by discovery
        if followed.insufficient is not None:  # announced: gateways refuse requests at once
            self._announce(insufficient=followed.insufficient)
        for plan, signature in followed.adopted:
            if self.gateway is not None:  # a slow peer a standby replaced keeps its stage
                moved = self.gateway.move_replaced(self._applied, plan)
                if moved:
                    log.info("%d sessions move off peers a standby replaced", moved)
            self._applied = plan
            self.stages.follow(plan, self.node.peer_id)
            self._announce(plan=plan, plan_signature=signature)

    async def _plan_loop(self) -> None:
        while True:
            self._tick()
            if self.gateway is not None:  # sessions on stages leaving alive move, KV and all
                self.gateway.move_unready(self.ready_stages())
            self.stages.retire_idle()
            self._publish()
            self.routes.changed()
            await self._until_next_tick()

    async def _until_next_tick(self) -> None:
        """The plan interval; on a node that follows another's plans and has none yet,
        cut short by a peer's new record (the coordinator's first plan): start-up waits on
        gossip, not on the tick. The coordinator keeps the plain interval (its first
        plan's timing is the settle wait's), as does every node once it follows a plan."""
        boss = self.follower.boss
        if self.follower.plan is not None or boss is None or boss == self.node.peer_id:
            await trio.sleep(self.config.plan_interval_s)
            return
        seen = self.views.current()
        with trio.move_on_after(self.config.plan_interval_s):
            # discovery signals health changes, not new records: look (cheap, start-up only)
            while self.views.current() is seen:  # noqa: ASYNC110
                await trio.sleep(START_POLL_S)

    def ready_stages(self) -> set[StageKey]:
        """The ready stages: ours not retiring, and those live members announce."""
        return self.routes.ready_stages()

    def ready(self) -> bool:
        """Whether a pipeline of the adopted plan is fully ready (requests can enter)."""
        return self.routes.ready()

    # -- announcing -----------------------------------------------------------------

    def beside_plan_bytes(self) -> int:
        """What this node holds for serving that no stage of the plan is charged: the
        draft model (``--draft FORMAT``), its weights and its sessions' KV."""
        model = self.draft_model
        return 0 if model is None else int(model.resident_bytes())

    async def _speculation(self) -> Speculation | None:
        """The gateway's drafter and budget for each request (issue 48): none unless
        ``--speculative[-k]``; a draft model (``--draft FORMAT``) is loaded here, once,
        in a thread; its bytes come off the memory the node offers the planner
        (:meth:`beside_plan_bytes`, :func:`hetmesh.node.memory.offered_cap`)."""
        config = self.config
        if config.speculative_k <= 0:
            return None
        model = None
        if config.draft != LOOKUP:
            from hetmesh.speculative.draft_model import DraftModel

            model = await trio.to_thread.run_sync(
                functools.partial(
                    DraftModel.load,
                    self.model_dir,
                    weights=config.draft,
                    device=self.node.config.device or "cpu",
                )
            )
            self.draft_model = model
            log.info(
                "draft model: %s in %s, %.1f MB of weights (off the memory offered the planner)",
                self.model_key,
                config.draft,
                model.weight_bytes() / 1e6,
            )
        return gateway_speculation(
            config.speculative_k, measured=config.speculative_measured, model=model
        )

    def _lane_send_now(self) -> SendNow:
        """The gateway lane's send (:mod:`hetmesh.node.gateway_lane`): a next step for
        this node's own first stage runs on the reader thread that brings its token
        in, if that stage's device thread is parked for it
        (:meth:`StageHost.offer`); any other, or one it does not take, goes as
        :meth:`PeerCalls.send_now` sends it (to this node: through trio)."""
        me, calls, stages = self.calls.me, self.calls, self.stages
        if not (gateway_lane_own() and lane_enabled()):
            return calls.send_now

        def send_now(peer: PeerId, frame: Frame) -> bool:
            return (peer == me and stages.offer(me, None, frame)) or calls.send_now(peer, frame)

        return send_now

    def _publish(self) -> None:
        """Announce the stages, their counters and prefixes, and the load."""
        stages, counters, load = self.stages.announced()
        self._announce(
            stages=stages,
            gateway=as_dict(self.gateway.statistics()) if self.gateway else {},
            stage_servers=counters,
            shards=self.shards.counters() if self.shards is not None else {},
            prefix_summaries=self.stages.prefix_summaries(),
        )
        self.node.discovery.set_load(load)

    def _announce(self, **changes: Any) -> None:
        """Announce the serving state with ``changes`` and the shards' manifest and units
        held (the one writer of this node's serving entries)."""
        if self.shards is not None:
            changes.update(manifest=self.shards.manifest_id, units_held=self.shards.units_held())
        state = self._announced = dataclasses.replace(self._announced, **changes)
        discovery = self.node.discovery
        for key, value in serving_extra(state).items():
            if key in COUNTER_KEYS:  # move with every token: published with the load
                discovery.set_counters(key, value)
            else:
                discovery.set_extra(key, value)
        self.node.discovery.set_stages(serving_stages(state))

    def announced(self) -> ServingAnnouncement:
        """What this node's record announces of its serving state."""
        return self._announced

    async def drain(self) -> None:
        """Stop taking sessions and give the running ones up to ``drain_s`` to move away
        (their gateways migrate them, KV and all, once they see the stages retiring);
        what is left then is cut off by the stop, and its gateways replay it."""
        if self.config.drain_s <= 0:
            return
        self.stages.start_draining()
        self._publish()

        def move() -> None:  # sessions entering here move too
            if self.gateway is not None:
                self.gateway.move_unready(self.ready_stages())

        await self.stages.drain(self.config.drain_s, move)

    # -- the two RPC handlers -------------------------------------------------------

    async def _handle_session(self, stream: INetStream) -> None:
        payload = await wire.read_frame(stream, max_bytes=MAX_CONTROL_BYTES, timeout_s=5.0)
        try:
            data = wire.decode_map(payload, max_bytes=MAX_CONTROL_BYTES)
            if data.get("op") == "ping":
                reply = Reply(ok=True)
            else:
                sender = str(stream.muxed_conn.peer_id)  # authenticated by libp2p
                reply = self.stages.control(parse_request(data), sender)
        except RemoteProtocolError as exc:  # the peer's mistake: say so, keep serving
            reply = Reply.failed(InvalidRequest(str(exc)))
        await wire.write_frame(stream, wire.encode(reply.to_wire()))

    def encode(self, request: GenerateRequest) -> list[int]:
        """Token ids of a request (:func:`~hetmesh.node.text_stream.encode_request`)."""
        return encode_request(self.tokenizer, request)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        """Token ids with their text deltas (:func:`~hetmesh.node.text_stream.text_stream`)."""
        assert self.gateway is not None
        return text_stream(self.gateway, self.tokenizer, prompt_ids, params)

    async def _handle_generate(self, stream: Any) -> None:
        """/hetmesh/generate: a request in, its deltas and finish out
        (:func:`~hetmesh.node.text_stream.answer_generate`)."""
        await answer_generate(stream, self.encode, self.stream)

    def statistics(self) -> ServingStatistics:
        links = {}
        if self.pool is not None:
            links = {p: f"{link.backend}: {link.reason}" for p, link in self.pool.links().items()}
        return ServingStatistics(
            plan_epoch=self.plan.epoch if self.plan else -1,
            coordinator=self.follower.boss or "",
            stages=tuple(self.stages.servers()),
            links=links,
            insufficient=self.follower.insufficient,
        )


async def serve_model(
    node: Node,
    config: ServingConfig,
    *,
    task_status: TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Resolve the model (pulling it on first use), then serve it; never returns."""
    from hetmesh.partition.store import default_cache_dir, resolve_model
    from hetmesh.shards.fetch import join_from_mesh, wants_mesh_model

    if wants_mesh_model(config.model):  # no local model: its manifest and files from a peer
        assert config.model is not None
        cache_dir = config.cache_dir or default_cache_dir()
        model_dir = await join_from_mesh(node.discovery, config.model, cache_dir)
    else:
        model = config.model
        model_dir = await trio.to_thread.run_sync(
            lambda: resolve_model(model, cache_dir=config.cache_dir)
        )
    serving = Serving(node, config, model_dir)
    await serving.serve(task_status=task_status)


def announced_host() -> str:
    """This process's host as its record's data-plane entry names it: a digest of
    :func:`~hetmesh.transport.dataplane.host_identity` (the boot and the network
    namespace), equal exactly for the nodes that reach each other over loopback."""
    import hashlib

    from hetmesh.transport.dataplane import host_identity

    return hashlib.sha256(host_identity().encode()).hexdigest()[:32]


__all__ = [
    "GENERATE_PROTOCOL",
    "Serving",
    "ServingConfig",
    "announced_host",
    "data_plane_host",
    "serve_model",
    "verify_signature",
]
