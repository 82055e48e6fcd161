"""Shard bytes over the data plane: negotiated links to holders, requests answered on them.

```
ShardLinks (one per node, beside its Shards)
  ├── handle(stream)     /hetmesh/shards/link/1.0.0: accept a link, answer requests on it
  └── request(peer, message, nbytes) -> bytes | None | DIRECT_UNAVAILABLE
```

A link is negotiated as a stage link is: over a libp2p control stream, with a
one-time credential the holder hands out in its offer
(:meth:`~hetmesh.transport.DataPlane.connect` / ``accept``), so the pair uses shm
on one host and direct TCP between hosts. The node runs a second
:class:`~hetmesh.transport.DataPlane` for these (:func:`shard_plane_config`: no
torchdist), so weight transfers never take the stage links' places. When the
pair can only use libp2p, the link is dropped and the caller uses the libp2p
request protocol instead (:data:`hetmesh.shards.fetch.SHARDS_PROTOCOL`): that is
the fallback, and nothing is sent twice over the encrypted control plane.

The data plane's own frames carry the exchange (no new frame type): a request
is an :class:`~hetmesh.transport.frames.Activations` with no tensors whose
``session_id`` is the request (``{"manifest", "kind", "name"}`` as JSON); the
reply is an ``Activations`` with the same ``session_id`` and one ``uint8``
tensor of the bytes, or an :class:`~hetmesh.transport.frames.Error` naming the
refusal. One request is in flight per link; a fetcher opens one link per
concurrent request (the holder's ``max_links_per_peer`` bounds them), reuses
idle ones, and closes them all when its fetch ends (:meth:`ShardLinks.aclose_idle`).
Verification stays with the caller: these are only bytes. The holder answers
within :mod:`hetmesh.shards.serve_caps` (requests per peer and in all, shared
with the libp2p path; a busy refusal is an ``Error``), and a reply the fetcher
does not read within its deadline closes the link.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import warnings
from collections.abc import Callable
from typing import Any, Final

import torch
import trio

from hetmesh.discovery.rpc import open_stream
from hetmesh.errors import MeshError, ProtocolError, RemoteProtocolError, TransportError
from hetmesh.resources import PeerId
from hetmesh.shards.serve_caps import BUSY, ServeCaps, reply_deadline_s
from hetmesh.transport import Activations, DataPlane, DataPlaneConfig, Error, Link
from hetmesh.transport.p2p import Libp2pStream

log = logging.getLogger(__name__)

SHARD_LINK_PROTOCOL: Final = "/hetmesh/shards/link/1.0.0"
MAX_REQUEST_CHARS: Final = 4096
DIRECT_UNAVAILABLE: Final = object()  # the pair negotiates only libp2p: use the fallback
_NOT_FOUND_CODE: Final = 404
_BUSY_CODE: Final = 429
_CONNECT_TIMEOUT_S: Final = 15.0

Answer = Callable[[dict[str, Any]], bytes]


def shard_plane_config(config: DataPlaneConfig) -> DataPlaneConfig:
    """The node's data-plane settings for its shard plane: the same backends (and
    encryption rules) less ``torchdist``, whose two-rank process group per link costs
    seconds to set up and buys a weight transfer nothing over a socket."""
    backends = tuple(b for b in config.backends if b != "torchdist")
    # a weight tensor rides in one Activations frame: not the serving plane's model caps
    limits = dataclasses.replace(config.limits, max_activation_bytes=None, max_kv_block_bytes=None)
    return dataclasses.replace(config, backends=backends or ("libp2p",), gloo=False, limits=limits)


class ShardLinks:
    """This node's shard links: answering holders' side and fetching side (see module)."""

    def __init__(
        self,
        host: Any,
        plane: DataPlane,
        answer: Answer,
        served: Callable[[int], None],
        caps: ServeCaps | None = None,
    ) -> None:
        self._host = host
        self._caps = caps or ServeCaps()
        self._plane = plane
        self._answer = answer  # runs in a worker thread; raises MeshError/OSError to refuse
        self._served = served  # bytes sent to a peer, for the node's counters
        self._idle: dict[PeerId, list[Link]] = {}
        self._libp2p_only: set[PeerId] = set()
        self.bytes_by_backend: dict[str, int] = {}  # bytes fetched, by the link's backend

    # -- the holder's side ------------------------------------------------------

    async def handle(self, stream: Any) -> None:
        """libp2p handler: accept a link from a fetcher and answer its requests until it
        closes. A broken link or a malformed request ends this link only."""
        remote = str(stream.muxed_conn.peer_id)
        control = Libp2pStream(stream)
        link = await self._plane.accept(control, expected_peer_id=remote)
        if link.backend == "libp2p":  # the fetcher falls back to the request protocol
            await link.aclose()
            return
        await control.aclose()  # direct link up: the control stream is done
        try:
            while True:
                frame = await link.receive()
                if not self._caps.take(remote):
                    link.release(frame)
                    await link.send(Error(code=_BUSY_CODE, message=BUSY))
                    continue
                try:
                    try:
                        reply = await self._reply(frame)
                    finally:
                        link.release(frame)
                    nbytes = reply.tensors[0].numel() if isinstance(reply, Activations) else 0
                    with trio.move_on_after(reply_deadline_s(nbytes)) as writing:
                        await link.send(reply)
                    if writing.cancelled_caught:  # it does not read: the link goes
                        log.info("%s did not read its shard reply in time: dropped", remote)
                        return
                finally:
                    self._caps.give_back(remote)
                if isinstance(reply, Activations):
                    self._served(reply.tensors[0].numel())
        except (TransportError, ProtocolError) as exc:
            log.debug("shard link from %s closed: %s", remote, exc)
        finally:
            with trio.CancelScope(shield=True):
                await link.aclose()

    async def _reply(self, frame: Any) -> Activations | Error:
        if not isinstance(frame, Activations) or frame.tensors:
            return Error(code=_NOT_FOUND_CODE, message="expected a shard request")
        key = frame.session_id
        try:
            message = json.loads(key) if len(key) <= MAX_REQUEST_CHARS else None
            if not isinstance(message, dict):
                raise ValueError("not a request")
            data = await trio.to_thread.run_sync(self._answer, message)
        except (MeshError, OSError, ValueError) as exc:
            return Error(code=_NOT_FOUND_CODE, message=str(exc)[:500], session_id=key)
        with warnings.catch_warnings():  # read-only bytes: the tensor is only ever sent
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0)
        return Activations(session_id=key, step=0, positions=(), tensors=(tensor.to(torch.uint8),))

    # -- the fetcher's side -----------------------------------------------------

    async def request(
        self, peer: PeerId, message: dict[str, Any], nbytes: int, *, timeout_s: float
    ) -> bytes | object | None:
        """The bytes ``peer`` sends for ``message`` (at most ``nbytes``); None when it
        failed or refused (logged); :data:`DIRECT_UNAVAILABLE` when the pair has no
        direct link (the caller uses libp2p). Never raises ``MeshError``."""
        if peer in self._libp2p_only:
            return DIRECT_UNAVAILABLE
        key = json.dumps(message, sort_keys=True)
        try:
            link = await self._take(peer)
        except (MeshError, OSError, trio.TooSlowError) as exc:
            log.info("no shard link to %s: %s", peer, exc)
            return None
        if link is None:
            return DIRECT_UNAVAILABLE
        data: bytes | None = None
        whole = False
        try:
            with trio.fail_after(timeout_s):
                await link.send(Activations(session_id=key, step=0, positions=(), tensors=()))
                reply = await link.receive()
            data = self._read(peer, key, nbytes, reply)
            link.release(reply)
            whole = True
        except (MeshError, trio.TooSlowError) as exc:
            log.info("fetching %s from %s over %s failed: %s", key, peer, link.backend, exc)
            return None
        finally:
            if not whole:  # failed or cancelled mid-exchange: the link is unusable
                with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                    await link.aclose()
        self._idle.setdefault(peer, []).append(link)
        if data is not None:
            backend = link.backend.value
            self.bytes_by_backend[backend] = self.bytes_by_backend.get(backend, 0) + len(data)
        return data

    @staticmethod
    def _read(peer: PeerId, key: str, nbytes: int, reply: Any) -> bytes | None:
        if isinstance(reply, Error):
            log.info("%s refused %s: %s", peer, key, reply.message)
            return None
        if (
            not isinstance(reply, Activations)
            or reply.session_id != key
            or len(reply.tensors) != 1
            or reply.tensors[0].dtype != torch.uint8
        ):
            raise RemoteProtocolError(f"{peer} answered {key} with an unexpected frame")
        tensor = reply.tensors[0]
        if tensor.numel() > nbytes:  # the manifest bounds every reply
            raise RemoteProtocolError(f"{peer} sent {tensor.numel()} bytes for {nbytes}")
        return tensor.contiguous().numpy().tobytes()

    async def _take(self, peer: PeerId) -> Link | None:
        """An idle link to ``peer``, or a new one; None when only libp2p is possible."""
        idle = self._idle.get(peer)
        if idle:
            return idle.pop()
        with trio.fail_after(_CONNECT_TIMEOUT_S):
            stream = await open_stream(
                self._host, peer, SHARD_LINK_PROTOCOL, timeout_s=_CONNECT_TIMEOUT_S
            )
            control = Libp2pStream(stream)
            try:
                link = await self._plane.connect(control, expected_peer_id=peer)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await control.aclose()
                raise
        if link.backend == "libp2p":
            self._libp2p_only.add(peer)
            await link.aclose()
            return None
        await control.aclose()
        return link

    async def aclose_idle(self) -> None:
        """Close every idle link (a fetch ended); later requests open new ones."""
        links = [link for idle in self._idle.values() for link in idle]
        self._idle.clear()
        for link in links:
            with trio.move_on_after(2.0), contextlib.suppress(Exception):
                await link.aclose()


__all__ = ["DIRECT_UNAVAILABLE", "SHARD_LINK_PROTOCOL", "ShardLinks", "shard_plane_config"]
