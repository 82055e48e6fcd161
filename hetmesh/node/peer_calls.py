"""Frames and control requests between this node and its peers (transport glue).

Frames go out over the link pool (a hop to this node itself never leaves the
process) and come in through :meth:`PeerCalls.dispatch`: a stage's frames to
the :class:`~hetmesh.node.stage_host.StageHost`, tokens and errors to the
gateway. Control requests to a peer go over the session protocol; to this
node, straight to the stage host's one path.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery.rpc import call
from hetmesh.error_codec import error_code
from hetmesh.errors import InvalidRequest, MeshError, Rejected, RemoteProtocolError
from hetmesh.node.config import ServingConfig
from hetmesh.node.control import SESSION_PROTOCOL, Reply, Request
from hetmesh.node.stage_host import StageHost
from hetmesh.resources import ModelProfile, PeerId
from hetmesh.transport import DataPlaneConfig, Error, Frame, Link, Tokens

if TYPE_CHECKING:
    from hetmesh.node.gateway import Gateway
    from hetmesh.node.link_pool import LinkPool

log = logging.getLogger(__name__)


class PeerCalls:
    """This node's frames and control calls; see the module docstring.

    ``host``: the libp2p host; ``ping_s``: a ping's timeout (a control call: twice).
    """

    def __init__(self, *, me: PeerId, host: Any, ping_s: float, stages: StageHost) -> None:
        self.me = me
        self.host = host
        self.ping_s = ping_s
        self.stages = stages
        self.pool: LinkPool | None = None
        self.gateway: Gateway | None = None
        self._nursery: trio.Nursery | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None

    def start(self, nursery: trio.Nursery, pool: LinkPool) -> None:
        self._nursery = nursery
        self._trio_token = trio.lowlevel.current_trio_token()
        self.pool = pool

    async def send(self, peer: PeerId, frame: Frame) -> None:
        if peer == self.me:
            self.dispatch(peer, None, frame)  # a hop to ourselves never leaves the process
            return
        assert self.pool is not None
        await self.pool.send(peer, frame)

    def send_now(self, peer: PeerId, frame: Frame) -> bool:
        """From a stage's device thread: write ``frame`` to ``peer``'s open link if it
        takes it at once (False for a link not open yet or busy); a hop to ourselves
        is handed to trio as it is, in order with the thread's earlier ones."""
        if peer == self.me:
            if self._trio_token is None:
                return False
            if type(frame) is Tokens and self.gateway is not None:  # the next step, now
                self.gateway.lane.offer(self.me, frame)  # (hetmesh.node.gateway_lane)
            try:
                self._trio_token.run_sync_soon(self._dispatch_own, frame)
            except trio.RunFinishedError:  # stopping: the outbox path reports it
                return False
            return True
        if self.pool is None:
            return False
        return self.pool.send_now(peer, frame)

    def _dispatch_own(self, frame: Frame) -> None:
        """A frame a stage here sent to this node, on trio (a callback must not raise)."""
        try:
            self.dispatch(self.me, None, frame)
        except Exception:  # a bug: the session times out and recovers, the node serves on
            log.exception("a frame to this node failed: %s", type(frame).__name__)

    def dispatch(self, peer: PeerId, link: Link | None, frame: Frame) -> None:
        """A frame from ``peer`` (``link`` None: from this node) to where it goes; the
        sender of a bad one is told with an ``Error`` frame."""

        def release() -> None:
            if link is not None:
                link.release(frame)

        sender = None if link is None else peer  # None: a hop to ourselves
        try:
            if self.stages.deliver(frame, release, sender):
                return
            if isinstance(frame, Tokens | Error) and self.gateway is not None:
                self.gateway.on_frame(frame, sender)
        except (InvalidRequest, Rejected) as exc:  # the sender's mistake, or a full inbox
            assert self._nursery is not None
            self._nursery.start_soon(
                self._send_quietly,
                peer,
                Error(
                    code=error_code(exc),
                    message=str(exc),
                    session_id=str(getattr(frame, "session_id", "")),
                ),
            )

    async def _send_quietly(self, peer: PeerId, frame: Frame) -> None:
        try:
            await self.send(peer, frame)
        except MeshError as exc:
            log.debug("could not tell %s: %s", peer, exc)

    async def control(self, peer: PeerId, request: Request) -> Reply:
        """A session control request to ``peer``'s stages (this node's: applied here)."""
        if peer == self.me:
            return self.stages.control(request)
        raw = await call(
            self.host, peer, SESSION_PROTOCOL, request.to_wire(), timeout_s=self.ping_s * 2
        )
        try:
            return Reply.from_wire(raw)
        except ValueError as exc:
            raise RemoteProtocolError(f"malformed control reply from {peer}: {exc}") from exc

    async def ping(self, peer: PeerId) -> bool:
        if peer == self.me:
            return True
        raw = await call(self.host, peer, SESSION_PROTOCOL, {"op": "ping"}, timeout_s=self.ping_s)
        return bool(raw.get("ok"))


def data_plane_host(addrs: Sequence[str]) -> str:
    """The IPv4 address the data plane should listen on: the node's first announced
    non-loopback address (peers on other hosts can reach it), else loopback."""
    hosts = [a.split("/")[2] for a in addrs if a.startswith("/ip4/")]
    for host in hosts:
        if not host.startswith("127.") and host != "0.0.0.0":
            return host
    return "127.0.0.1"


def node_plane_config(
    node: Any, config: ServingConfig, profile: ModelProfile, stages: StageHost
) -> DataPlaneConfig:
    """The data plane of a serving ``node``: its backends and encryption as configured,
    frames sized to the model and a KVBlock to its session's KV (issue 45)."""
    from hetmesh.transport.frames import limits_for_profile

    limits = limits_for_profile(profile)
    return DataPlaneConfig(
        peer_id=node.peer_id,
        backends=config.backends,
        require_encryption=config.require_encryption,
        tcp_host=config.tcp_host or data_plane_host(node.discovery.addrs),
        gloo="torchdist" in config.backends,
        device=node.config.device,
        limits=dataclasses.replace(limits, kv_block_bytes=stages.kv_frame_bytes),
        nat=node.nat,  # a punch candidate's public IP; punched links noted there
    )


__all__ = ["PeerCalls", "data_plane_host", "node_plane_config"]
