"""Membership messages to peers over one long-lived libp2p stream per peer.

Opening a libp2p stream costs a protocol negotiation on both ends; the
membership protocol sends a few small messages a second, so each peer gets
one outbound *lane*: a bounded queue and a task that keeps one stream open
and writes length-prefixed frames on it. A lane closes after ``idle_s``
without messages; a full queue drops the newest message (the protocol
tolerates loss: probes retry, rumors repeat).

Failures only feed the liveness judgement: a refused dial (nothing listens
there, the process is gone) is reported through ``on_refused``; other
failures drop the stream and the next message opens a new one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from hetmesh.discovery import wire
from hetmesh.discovery.host import dial
from hetmesh.errors import AuthenticationFailed, ConnectTimeout, PeerUnreachable
from hetmesh.resources import PeerId

log = logging.getLogger(__name__)

_Item = tuple[bytes, Callable[[], None] | None]  # a frame, and what to call once written


@dataclass(frozen=True, slots=True)
class OutboxStatistics:
    sent: int
    bytes_sent: int
    failures: int
    dropped: int
    lanes: int
    streams_opened: int


class Outbox:
    """One lane per peer (see the module doc); runs its lanes in the given nursery."""

    def __init__(
        self,
        host: Any,
        protocol: str,
        *,
        peer_info: Callable[[PeerId], Any | None],
        on_refused: Callable[[PeerId], None],
        dial_timeout_s: float,
        send_timeout_s: float,
        idle_s: float = 30.0,
        queue: int = 32,
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.peer_info = peer_info
        self.on_refused = on_refused
        self.dial_timeout_s = dial_timeout_s
        self.send_timeout_s = send_timeout_s
        self.idle_s = idle_s
        self.queue = queue
        self._lanes: dict[PeerId, trio.MemorySendChannel[_Item]] = {}
        self._sent = self._bytes = self._failures = self._dropped = self._opened = 0

    def send(
        self,
        nursery: trio.Nursery,
        peer_id: PeerId,
        payload: bytes,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        """Queue one frame for ``peer_id`` (never blocks); ``on_sent`` runs once it is
        written (after the dial and stream set-up a new lane needs), never if it fails."""
        lane = self._lanes.get(peer_id)
        if lane is None:
            lane, recv = trio.open_memory_channel[_Item](self.queue)
            self._lanes[peer_id] = lane
            nursery.start_soon(self._run, peer_id, lane, recv)
        try:
            lane.send_nowait((payload, on_sent))
        except trio.WouldBlock:
            self._dropped += 1

    def statistics(self) -> OutboxStatistics:
        return OutboxStatistics(
            self._sent, self._bytes, self._failures, self._dropped, len(self._lanes), self._opened
        )

    async def _run(
        self,
        peer_id: PeerId,
        lane: trio.MemorySendChannel[_Item],
        recv: trio.MemoryReceiveChannel[_Item],
    ) -> None:
        stream: Any = None
        try:
            while True:
                item: _Item | None = None
                with trio.move_on_after(self.idle_s):
                    item = await recv.receive()
                if item is None:
                    # idle: retire the lane before any await, so no message is queued
                    # on it after this point (a later send opens a new lane)
                    if self._lanes.get(peer_id) is lane:
                        del self._lanes[peer_id]
                    return
                payload, on_sent = item
                stream = await self._write(peer_id, stream, payload)
                if stream is not None and on_sent is not None:
                    on_sent()
        finally:
            if self._lanes.get(peer_id) is lane:
                del self._lanes[peer_id]
            recv.close()
            if stream is not None:
                deadline = trio.current_time() + 1.0
                with (
                    trio.CancelScope(deadline=deadline, shield=True),
                    contextlib.suppress(Exception),
                ):
                    await stream.close()

    async def _write(self, peer_id: PeerId, stream: Any, payload: bytes) -> Any:
        """Write one frame, opening the stream if needed; the stream to keep (or None)."""
        info = None
        try:
            if stream is None:
                info = self.peer_info(peer_id)
                if info is None:
                    self._dropped += 1
                    return None
                stream = await self._open(info)
            with trio.fail_after(self.send_timeout_s):
                await wire.write_frame(stream, payload)
            self._sent += 1
            self._bytes += len(payload) + 4
            return stream
        except PeerUnreachable:
            self._failures += 1
            self.on_refused(peer_id)
        except (AuthenticationFailed, ConnectTimeout, trio.TooSlowError):
            self._failures += 1
        except Exception as exc:  # libp2p errors: a dropped connection is a refusal
            self._failures += 1
            log.debug("membership message to %s failed: %r", peer_id, exc)
            connected = self._connected(peer_id)
            if not connected:
                self.on_refused(peer_id)
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.reset()
        return None

    def _connected(self, peer_id: PeerId) -> bool:
        from libp2p.peer.id import ID

        with contextlib.suppress(Exception):
            return ID.from_base58(peer_id) in self.host.get_network().connections
        return False

    async def _open(self, info: Any) -> Any:
        from libp2p.custom_types import TProtocol

        if info.peer_id not in self.host.get_network().connections:
            await dial(self.host, info, timeout_s=self.dial_timeout_s)
        with trio.fail_after(self.send_timeout_s):
            stream = await self.host.new_stream(info.peer_id, [TProtocol(self.protocol)])
        self._opened += 1
        return stream


__all__ = ["Outbox", "OutboxStatistics"]
