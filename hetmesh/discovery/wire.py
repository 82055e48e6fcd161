"""Discovery records and their framing on libp2p streams.

Every message is one msgpack map behind a 4-byte big-endian length. Decoding
is strict at the boundary: oversized frames, undecodable bytes and records
that are missing fields or carry ill-typed ones raise
:class:`~hetmesh.errors.RemoteProtocolError`; unknown fields are ignored so
that mixed versions coexist. Nothing here does I/O except the two small
stream helpers at the bottom.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from hetmesh.errors import RemoteProtocolError, StreamReset
from hetmesh.resources import DeviceProfile, LinkProfile, PeerId, WireRecord

ANNOUNCE_PROTOCOL = "/hetmesh/announce/1.0.0"
STATUS_PROTOCOL = "/hetmesh/status/1.0.0"

MAX_ANNOUNCEMENT_BYTES = 256 * 1024
MAX_STATUS_BYTES = 8 * 1024 * 1024
# most entries an announcement's lists may hold (a real node has a few devices,
# a link per peer, a handful of addresses and stages)
MAX_ENTRIES = {
    "addrs": 64,
    "devices": 64,
    "links": 1024,
    "stages": 256,
    "known_peers": 1024,
    "link_requests": 256,
}
_HEADER = struct.Struct(">I")

log = logging.getLogger(__name__)


# Bounds of the counters that travel: every one read off the wire is checked against
# them (a bigger one drops its message), and none we send can pass them. Boot ids are
# wall-clock nanoseconds (a signed 64-bit count); an incarnation grows by one per
# refutation, so 2**32 of them outlast any process.
MAX_COUNTER = 2**63 - 1
MAX_INCARNATION = 2**32 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Load(WireRecord):
    """How busy a peer is right now."""

    queue_depth: int = 0
    active_sessions: int = 0
    kv_bytes_used: int = 0
    kv_bytes_free: int = 0
    recent_step_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KnownPeer(WireRecord):
    """A peer the sender considers alive, for peer exchange."""

    peer_id: PeerId
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkRequest(WireRecord):
    """A link the sender (a coordinator) wants measured: ``src`` probes ``dst``."""

    src: PeerId
    dst: PeerId


@dataclass(frozen=True, slots=True, kw_only=True)
class Announcement(WireRecord):
    """What a node tells every peer about itself, about once a second.

    ``(boot_id, seq)`` orders records from one peer: ``boot_id`` changes when
    the process restarts (so a restarted node is not mistaken for a stale
    one), ``seq`` grows by one per record. ``stages``, ``data_plane`` and
    ``extra`` are opaque here: the transport defines ``data_plane``, and a
    serving node's ``stages`` and ``extra`` entries are written and read only
    through :mod:`hetmesh.scheduler.announcement` (``read_serving``).
    """

    version: str
    peer_id: PeerId
    boot_id: int
    seq: int
    addrs: tuple[str, ...]
    devices: tuple[DeviceProfile, ...] = ()
    links: tuple[LinkProfile, ...] = ()
    data_plane: dict[str, Any] = field(default_factory=dict)
    stages: tuple[dict[str, Any], ...] = ()
    load: Load = field(default_factory=Load)
    known_peers: tuple[KnownPeer, ...] = ()
    probe_port: int = 0  # TCP port of the link-probe server on the announced hosts; 0 = none
    goodbye: bool = False
    sent_at_s: float = 0.0  # sender's wall clock
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = 1
    incarnation: int = 0  # the membership protocol's liveness version within one boot
    link_requests: tuple[LinkRequest, ...] = ()  # links the sender's plan lacks

    @property
    def order(self) -> tuple[int, int]:
        return (self.boot_id, self.seq)

    @classmethod
    def from_wire(cls, data: Any) -> Announcement:
        """Parse a record a peer sent, bound to that peer.

        Beyond the field checks every record gets: too many entries in a list
        is refused (:data:`MAX_ENTRIES`), and the devices and links that do not
        belong to the announcing peer (a device of another peer id, a link
        measured from another peer) are dropped, so no member can describe
        another's hardware or the links between others.
        """
        if isinstance(data, dict):
            for name, limit in MAX_ENTRIES.items():
                value = data.get(name)
                if isinstance(value, list | tuple) and len(value) > limit:
                    raise ValueError(f"Announcement.{name}: {len(value)} entries, over {limit}")
        record = _parse_record(cls, data)
        own_devices = tuple(d for d in record.devices if d.peer_id == record.peer_id)
        own_links = tuple(
            link for link in record.links if link.src == record.peer_id and link.dst != link.src
        )
        if own_devices == record.devices and own_links == record.links:
            return record
        log.info(
            "announcement of %s: dropped %d devices and %d links that are not its own",
            record.peer_id,
            len(record.devices) - len(own_devices),
            len(record.links) - len(own_links),
        )
        return dataclasses.replace(record, devices=own_devices, links=own_links)


def _parse_record(cls: type[Announcement], data: Any) -> Announcement:
    # the generic field-by-field parse (WireRecord's), under the override above
    return WireRecord.from_wire.__func__(cls, data)  # type: ignore[attr-defined,no-any-return]


def encode(record: WireRecord | dict[str, Any]) -> bytes:
    """msgpack bytes of a record (or a plain map)."""
    data = record.to_wire() if isinstance(record, WireRecord) else record
    out = msgpack.packb(data, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def decode_map(payload: bytes, *, max_bytes: int = MAX_ANNOUNCEMENT_BYTES) -> dict[str, Any]:
    """Decode one msgpack map, or raise :class:`RemoteProtocolError`."""
    if len(payload) > max_bytes:
        raise RemoteProtocolError(f"message of {len(payload)} bytes exceeds {max_bytes}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise RemoteProtocolError(f"undecodable message: {exc}") from exc
    if not isinstance(data, dict):
        raise RemoteProtocolError(f"expected a map, got {type(data).__name__}")
    return data


def decode_announcement(payload: bytes) -> Announcement:
    """Parse an announcement, or raise :class:`RemoteProtocolError`."""
    data = decode_map(payload, max_bytes=MAX_ANNOUNCEMENT_BYTES)
    try:
        record = Announcement.from_wire(data)
    except (ValueError, TypeError) as exc:
        raise RemoteProtocolError(f"malformed announcement: {exc}") from exc
    if record.seq < 0 or record.boot_id < 0 or record.incarnation < 0:
        raise RemoteProtocolError("malformed announcement: negative sequence")
    if max(record.seq, record.boot_id) > MAX_COUNTER or record.incarnation > MAX_INCARNATION:
        raise RemoteProtocolError("malformed announcement: a counter past its bound")
    return record


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


async def _read_exact(stream: ByteStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except Exception as exc:  # libp2p StreamEOF / StreamReset / StreamError
            raise StreamReset(f"stream ended after {len(buf)} of {n} bytes") from exc
        if not chunk:
            raise StreamReset(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class FrameReader:
    """Length-prefixed messages from one stream, read in as large pieces as arrive.

    :func:`read_frame` reads a message's prefix and its body apart: two reads through
    the stream's layers (libp2p's stream state lock, yamux's stream and window locks)
    for each message. This reader takes whatever has arrived (up to ``chunk_bytes``)
    and keeps what follows a message for the next one, so a token stream pays one
    read a token, and none for tokens already there.
    """

    def __init__(self, stream: ByteStream, *, chunk_bytes: int = 64 * 1024) -> None:
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._buffer = bytearray()

    async def read_frame(self, *, max_bytes: int, timeout_s: float) -> bytes:
        """The next message, within ``timeout_s``; raises as :func:`read_frame` does
        (a length over ``max_bytes`` before its body is read, a stream that ends early,
        ``trio.TooSlowError``). After a timeout the stream is not to be read again."""
        import trio  # here, so the pure modules that use the records stay free of trio

        buffer = self._buffer
        with trio.fail_after(timeout_s):
            while True:
                if len(buffer) >= _HEADER.size:
                    (size,) = _HEADER.unpack_from(buffer)
                    if size > max_bytes:
                        raise RemoteProtocolError(f"frame of {size} bytes exceeds {max_bytes}")
                    end = _HEADER.size + size
                    if len(buffer) >= end:
                        payload = bytes(buffer[_HEADER.size : end])
                        del buffer[:end]
                        return payload
                try:
                    chunk = await self._stream.read(self._chunk_bytes)
                except Exception as exc:  # libp2p StreamEOF / StreamReset / StreamError
                    raise StreamReset(f"stream ended with {len(buffer)} bytes unread") from exc
                if not chunk:
                    raise StreamReset(f"stream ended with {len(buffer)} bytes unread")
                buffer += chunk


def frame_prefix(nbytes: int) -> bytes:
    """The length prefix of a message of ``nbytes`` (a writer that streams the rest)."""
    return _HEADER.pack(nbytes)


async def write_frame(stream: ByteStream, payload: bytes) -> None:
    """Write one length-prefixed message."""
    await stream.write(_HEADER.pack(len(payload)) + payload)


async def read_frame(stream: ByteStream, *, max_bytes: int, timeout_s: float) -> bytes:
    """Read one length-prefixed message within ``timeout_s``.

    Raises :class:`RemoteProtocolError` for a length over ``max_bytes`` (without
    reading the body), :class:`StreamReset` if the stream ends early and
    ``trio.TooSlowError`` on timeout.
    """
    import trio  # here, so the pure modules that use the records stay free of trio

    with trio.fail_after(timeout_s):
        (size,) = _HEADER.unpack(await _read_exact(stream, _HEADER.size))
        if size > max_bytes:
            raise RemoteProtocolError(f"frame of {size} bytes exceeds {max_bytes}")
        return await _read_exact(stream, size)


__all__ = [
    "ANNOUNCE_PROTOCOL",
    "MAX_ANNOUNCEMENT_BYTES",
    "MAX_STATUS_BYTES",
    "STATUS_PROTOCOL",
    "Announcement",
    "FrameReader",
    "KnownPeer",
    "LinkRequest",
    "Load",
    "decode_announcement",
    "decode_map",
    "encode",
    "read_frame",
    "write_frame",
]
