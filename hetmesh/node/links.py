"""The node's data-plane links and control RPCs, on top of the libp2p host.

:class:`LinkPool` keeps one long-lived link per remote peer, negotiated over a
libp2p control stream by :class:`~hetmesh.transport.DataPlane` (which picks
shm, torchdist, tcp or libp2p for the pair) and shared by every session that
crosses it. Each link has a receive task that hands frames to the node's
dispatcher. :func:`call` is the one-request, one-reply control RPC.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import trio

from hetmesh.discovery import wire
from hetmesh.errors import (
    ConnectTimeout,
    MeshError,
    PeerUnreachable,
    RemoteProtocolError,
    TransportError,
)
from hetmesh.resources import PeerId
from hetmesh.transport import DataPlane, Frame, Libp2pStream, Link

log = logging.getLogger(__name__)

DATAPLANE_PROTOCOL = "/hetmesh/dataplane/1.0.0"

Dispatch = Callable[[PeerId, Link, Frame], None]


async def open_stream(host: Any, peer: PeerId, protocol: str, *, timeout_s: float) -> Any:
    """A new libp2p stream to ``peer``, or ``PeerUnreachable`` / ``ConnectTimeout``."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    try:
        with trio.fail_after(timeout_s):
            return await host.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
    except trio.TooSlowError:
        raise ConnectTimeout(f"opening {protocol} to {peer} timed out") from None
    except MeshError:
        raise
    except Exception as exc:
        raise PeerUnreachable(f"cannot open {protocol} to {peer}: {exc}") from exc


async def call(
    host: Any, peer: PeerId, protocol: str, request: dict[str, Any], *, timeout_s: float
) -> dict[str, Any]:
    """One control RPC: send a msgpack map, read the reply map."""
    stream = await open_stream(host, peer, protocol, timeout_s=timeout_s)
    try:
        await wire.write_frame(stream, wire.encode(request))
        payload = await wire.read_frame(
            stream, max_bytes=wire.MAX_STATUS_BYTES, timeout_s=timeout_s
        )
        return wire.decode_map(payload, max_bytes=wire.MAX_STATUS_BYTES)
    except trio.TooSlowError:
        raise ConnectTimeout(f"{protocol} to {peer}: no reply in {timeout_s} s") from None
    finally:
        with contextlib.suppress(Exception):
            await stream.close()


class LinkPool:
    """One data-plane link per peer, opened on first use, shared by all sessions."""

    def __init__(
        self,
        *,
        host: Any,
        plane: DataPlane,
        dispatch: Dispatch,
        nursery: trio.Nursery,
        connect_timeout_s: float = 15.0,
    ) -> None:
        self._host = host
        self._plane = plane
        self._dispatch = dispatch
        self._nursery = nursery
        self._timeout = connect_timeout_s
        self._links: dict[PeerId, Link] = {}
        self._locks: dict[PeerId, trio.Lock] = {}
        self._closed: dict[int, trio.Event] = {}
        self.failures = 0

    def links(self) -> dict[PeerId, Link]:
        return dict(self._links)

    async def send(self, peer: PeerId, frame: Frame) -> None:
        """Send ``frame`` to ``peer``, opening the link if needed (``TransportError``)."""
        link = await self.get(peer)
        try:
            await link.send(frame)
        except TransportError:
            self.failures += 1
            await self.drop(peer, link)
            raise

    async def get(self, peer: PeerId) -> Link:
        link = self._links.get(peer)
        if link is not None:
            return link
        lock = self._locks.setdefault(peer, trio.Lock())
        async with lock:
            link = self._links.get(peer)
            if link is not None:
                return link
            stream = await open_stream(
                self._host, peer, DATAPLANE_PROTOCOL, timeout_s=self._timeout
            )
            control = Libp2pStream(stream)
            try:
                link = await self._plane.connect(control, expected_peer_id=peer)
            except BaseException:
                await control.aclose()
                raise
            if link.backend != "libp2p":
                await control.aclose()
            self._adopt(peer, link)
            return link

    async def handle_incoming(self, stream: Any) -> None:
        """libp2p handler: accept a link a peer dials; lives as long as a libp2p link."""
        remote = str(stream.muxed_conn.peer_id)
        link = await self._plane.accept(Libp2pStream(stream), expected_peer_id=remote)
        done = self._adopt(remote, link)
        if link.backend == "libp2p":  # the stream is the link: keep the handler open
            await done.wait()

    def _adopt(self, peer: PeerId, link: Link) -> trio.Event:
        done = trio.Event()
        self._closed[id(link)] = done
        self._links.setdefault(peer, link)
        self._nursery.start_soon(self._receive_loop, peer, link, done)
        return done

    async def _receive_loop(self, peer: PeerId, link: Link, done: trio.Event) -> None:
        try:
            while True:
                frame = await link.receive()
                try:
                    self._dispatch(peer, link, frame)
                except Exception:  # one bad frame never stops the link
                    log.warning("dispatching a frame from %s failed", peer, exc_info=True)
        except (TransportError, RemoteProtocolError) as exc:
            log.info("data-plane link to %s closed: %s", peer, exc)
        finally:
            done.set()
            self._closed.pop(id(link), None)
            if self._links.get(peer) is link:
                del self._links[peer]
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await link.aclose()

    async def drop(self, peer: PeerId, link: Link | None = None) -> None:
        """Forget the link to ``peer`` (a dead peer); its receive task ends."""
        current = self._links.get(peer)
        if current is None or (link is not None and current is not link):
            return
        del self._links[peer]
        with contextlib.suppress(Exception):
            await current.aclose()

    async def aclose(self) -> None:
        for peer in list(self._links):
            await self.drop(peer)
