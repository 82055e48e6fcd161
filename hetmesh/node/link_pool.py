"""The node's pool of data-plane links, on top of the libp2p host.

:class:`LinkPool` keeps one long-lived link per remote peer, negotiated over a
libp2p control stream by :class:`~hetmesh.transport.DataPlane` (which picks
shm, torchdist, tcp or libp2p for the pair) and shared by every session that
crosses it. Each link has a receive task that hands frames to the node's
dispatcher. The link of a peer discovery declares dead is closed
(:meth:`LinkPool.close_dead`). Control RPCs (one request, one reply) are
:func:`hetmesh.discovery.rpc.call`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import trio

from hetmesh.discovery.rpc import open_stream
from hetmesh.discovery.table import Health, TableEvent
from hetmesh.errors import PeerUnreachable, RemoteProtocolError, TransportError
from hetmesh.resources import PeerId
from hetmesh.transport import DataPlane, Frame, Libp2pStream, Link
from hetmesh.transport.links import ThreadedLink

log = logging.getLogger(__name__)

DATAPLANE_PROTOCOL = "/hetmesh/dataplane/1.0.0"
# a peer that left closes its links as it exits: until then (at most this long) its
# link is read on, so the frames it sent last (a migrated session's KV) arrive
LEFT_LINGER_S = 5.0

Dispatch = Callable[[PeerId, Link, Frame], None]
# from a link's reader thread: True if it took the frame there (it never reaches trio)
Offer = Callable[[PeerId, Link, Frame], bool]
# from a link's reader thread, before trio gets the frame: a look at it (a gateway's
# lane sends a decode step's successor as its token comes in)
Peek = Callable[[PeerId, Frame], None]


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
        send_timeout_s: float = 20.0,
        offer: Offer | None = None,
    ) -> None:
        """``offer``: each link's reader thread offers it every frame first (a stage's
        fast lane, :meth:`StageHost.offer`); what it does not take goes to ``dispatch``
        on trio."""
        self._host = host
        self._offer = offer
        self._plane = plane
        self._dispatch = dispatch
        self._nursery = nursery
        self._timeout = connect_timeout_s
        self._send_timeout = send_timeout_s
        self._links: dict[PeerId, Link] = {}
        self._locks: dict[PeerId, trio.Lock] = {}
        self._closed: dict[int, trio.Event] = {}
        self.failures = 0
        self.peek: Peek | None = None  # see Peek; set before links open

    def links(self) -> dict[PeerId, Link]:
        return dict(self._links)

    async def send(self, peer: PeerId, frame: Frame) -> None:
        """Send ``frame`` to ``peer``, opening the link if needed (``TransportError``).

        A send that takes longer than ``send_timeout_s`` (a frozen peer reads nothing)
        is ``PeerUnreachable``, and the link is closed: a frame cut short leaves it
        unusable anyway.
        """
        link = await self.get(peer)
        try:
            with trio.fail_after(self._send_timeout):
                await link.send(frame)
        except (TransportError, trio.TooSlowError) as exc:
            self.failures += 1
            await self.drop(peer, link)
            if isinstance(exc, trio.TooSlowError):
                raise PeerUnreachable(
                    f"a send to {peer} took over {self._send_timeout:g} s: link closed"
                ) from None
            raise

    def send_now(self, peer: PeerId, frame: Frame) -> bool:
        """Write ``frame`` to ``peer`` at once, from any thread, if its link is open and
        takes it without waiting (:meth:`Link.send_nowait`); False otherwise (then
        :meth:`send` it). ``TransportError`` if the write fails."""
        link = self._links.get(peer)
        return link is not None and link.send_nowait(frame)

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
        if isinstance(link, ThreadedLink) and (self._offer is not None or self.peek is not None):
            link.sink = functools.partial(self._sink, peer, link)
        self._nursery.start_soon(self._receive_loop, peer, link, done)
        return done

    def _sink(self, peer: PeerId, link: Link, frame: Frame) -> bool:
        """On ``link``'s reader thread: :data:`Peek`, then whether a stage took it."""
        if self.peek is not None:
            self.peek(peer, frame)
        return self._offer is not None and self._offer(peer, link, frame)

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
        with trio.move_on_after(5.0), contextlib.suppress(Exception):  # never held by the peer
            await current.aclose()

    async def close_dead(
        self,
        events: trio.MemoryReceiveChannel[TableEvent],
        on_dead: Callable[[PeerId], None],
    ) -> None:
        """Follow discovery's health changes: a peer declared dead (or gone) loses its
        link, and ``on_dead`` hears of it first (the gateway recovers its sessions).
        A peer that left says goodbye before it closes its links: its link is read
        until it ends (up to :data:`LEFT_LINGER_S`), or the last frames it sent
        (the KV of a session it handed over while draining) would be discarded
        unread. Returns when ``events`` ends."""
        async for event in events:
            if event.new not in (Health.DEAD, Health.LEFT):
                continue
            on_dead(event.peer_id)
            if event.new is Health.LEFT:
                self._nursery.start_soon(self._drop_when_quiet, event.peer_id)
                continue
            log.info("peer %s is %s: closing its data-plane link", event.peer_id, event.new)
            with trio.move_on_after(5.0):  # a frozen peer must not hold this loop
                await self.drop(event.peer_id)

    async def _drop_when_quiet(self, peer: PeerId) -> None:
        """Close a departed peer's link once it has ended, or after the linger."""
        link = self._links.get(peer)
        done = self._closed.get(id(link)) if link is not None else None
        if link is None or done is None:
            return
        with trio.move_on_after(LEFT_LINGER_S):
            await done.wait()
            return
        log.info("peer %s left but its link is still open: closing it", peer)
        with trio.move_on_after(5.0):
            await self.drop(peer, link)

    async def aclose(self) -> None:
        for peer in list(self._links):
            await self.drop(peer)
