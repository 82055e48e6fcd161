"""The link prober: RTT and bandwidth between two nodes, one protocol over every path.

This is the only module that knows how a link is measured. The asker sends
``b"P"`` pings, each echoed by ``b"p"``, then ``b"B"`` + an 8-byte length +
that many bytes, acknowledged by ``b"K"`` and the receiver's time (float64
seconds) between the arrival of the first quarter and of the last byte
(:func:`measure`; the answerer: :func:`answer`). Timing the tail at the
receiver keeps TCP slow start, the sender's socket buffer and a token
bucket's initial burst out of the figure. Arrival times are the kernel's
receive timestamps (``SO_TIMESTAMPNS``) where the path is a socket: a
receiver starved of CPU (a cgroup quota) reads late and then drains a
backlog at once, which a clock read in user space would count as a fast link.

The paths differ only in how the connection is made and what the answerer's
clock can see, and are data (:class:`ProbeKind`):

- :data:`TCP_PROBE`: a plain TCP connection to the peer's announced probe
  port (:func:`probe_link` / :func:`serve_probe`, here). The server opens
  with a 16-byte random challenge; the client answers with an HMAC of it
  under a key derived from the mesh secret (so strangers cannot use the port
  as a sink, and an answer seen on the wire is worth nothing on the next
  connection).
- :data:`LIBP2P_PROBE`: a stream of the libp2p connection, relayed or not,
  for a member no TCP probe reaches (:mod:`hetmesh.nat.link_probe`). The
  receiver reads after the muxer buffered the bytes, so its clock is in user
  space and the asker never reports more than its own whole-transfer figure.
- :data:`PUNCHED_PROBE`: a hole-punched TCP connection of its own, for a
  member whose data plane is punched (:mod:`hetmesh.nat.link_probe`).

A stranger costs little: at most ``max_pending`` connections wait for their
answer at once (``max_pending_per_address`` from one address; more are
closed on accept), each for ``auth_timeout_s`` at most.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from hetmesh.errors import PeerUnreachable, RemoteProtocolError
from hetmesh.transport.gate import ConnectionGate

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

PROBE_BYTES = 4 * 1024 * 1024
MAX_PROBE_BYTES = 64 * 1024 * 1024
_LEN = struct.Struct(">Q")
_SECONDS = struct.Struct(">d")
_CHUNK = bytes(256 * 1024)


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    rtt_s: float
    bandwidth_bps: float


@dataclass(frozen=True, slots=True)
class ProbeKind:
    """One path a link is probed over: the same protocol, its own limits and clock."""

    name: str
    path: str  # what it measures, for the logs
    max_bytes: int  # the largest bulk transfer its answerer takes
    # the answerer times arrivals in user space (a muxed stream): the asker's own
    # whole-transfer figure caps what it reports (:func:`stream_bandwidth`)
    user_clock: bool = False

    def bandwidth(self, nbytes: int, tail_s: float, elapsed_s: float, rtt_s: float) -> float:
        """The link's rate from one probe: the answerer's tail, ``elapsed_s`` the asker's
        time from the first byte written to the acknowledgement read."""
        if self.user_clock:
            return stream_bandwidth(nbytes, tail_s, elapsed_s)
        return tail_bandwidth(nbytes, tail_s, elapsed_s - rtt_s)


TCP_PROBE = ProbeKind("tcp", "the probe port", MAX_PROBE_BYTES)
LIBP2P_PROBE = ProbeKind("libp2p", "the libp2p connection", 16 * 1024 * 1024, user_clock=True)
PUNCHED_PROBE = ProbeKind("punched", "the hole-punched path", 16 * 1024 * 1024)
ANSWER_S = 30.0  # how long one probe session may last at the answerer


class ProbeChannel(Protocol):
    """A connected byte path a probe runs over."""

    async def write(self, data: bytes) -> None: ...

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; ``b""`` once the other end closed."""
        ...

    async def read_timed(self, n: int) -> tuple[bytes, float | None]:
        """Up to ``n`` bytes and the kernel's arrival time of the last (None: unknown)."""
        ...


class SocketChannel:
    """A TCP connection (the probe port's, or a punched one) as a probe channel."""

    def __init__(self, stream: trio.SocketStream, *, stamped: bool = False) -> None:
        self.stream = stream
        self.stamped = stamped  # the kernel timestamps arrivals (enable_timestamps)

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def read(self, n: int) -> bytes:
        return bytes(await self.stream.receive_some(n))

    async def read_timed(self, n: int) -> tuple[bytes, float | None]:
        if not self.stamped:
            return await self.read(n), None
        chunk, ancillary, _, _ = await self.stream.socket.recvmsg(n, socket.CMSG_SPACE(16))
        return chunk, arrival_s(ancillary)


class StreamChannel:
    """A libp2p stream as a probe channel (no kernel clock: arrivals are the muxer's)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def read(self, n: int) -> bytes:
        return bytes(await self.stream.read(n))

    async def read_timed(self, n: int) -> tuple[bytes, float | None]:
        return await self.read(n), None


CHALLENGE_BYTES = 16
AUTH_TIMEOUT_S = 5.0


def probe_token(psk: str) -> bytes:
    """The probe key: derived from the mesh secret, never sent."""
    return hashlib.sha256(b"hetmesh/probe/v1\x00" + psk.encode()).digest()


def probe_answer(token: bytes, challenge: bytes) -> bytes:
    """What proves the mesh secret for one connection's ``challenge``."""
    return hmac.new(token, b"hetmesh/probe/v2\x00" + challenge, hashlib.sha256).digest()


async def read_exact(channel: ProbeChannel, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await channel.read(n - len(buf))
        if not chunk:
            raise RemoteProtocolError("probe connection closed early")
        buf += chunk
    return bytes(buf)


_SO_TIMESTAMPNS = 35  # Linux (asm-generic); Python does not name it
_TIMESPEC = struct.Struct("@qq")


def enable_timestamps(sock: socket.socket | trio.socket.SocketType) -> bool:
    """Ask the kernel to timestamp what arrives on ``sock``; False where it cannot."""
    if sys.platform != "linux":
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def arrival_s(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """The kernel's arrival time of the last bytes of one ``recvmsg`` (seconds), if given."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
            seconds, nanoseconds = _TIMESPEC.unpack_from(data)
            return float(seconds) + float(nanoseconds) * 1e-9
    return None


async def _authenticate(channel: SocketChannel, token: bytes, timeout_s: float) -> bool:
    """Challenge the client; True once it proved the mesh secret within ``timeout_s``."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    with trio.move_on_after(timeout_s):
        await channel.write(challenge)
        got = await read_exact(channel, 32)
        return hmac.compare_digest(got, probe_answer(token, challenge))
    return False


async def answer(
    channel: ProbeChannel, kind: ProbeKind, *, bulk_lock: trio.Lock | None = None
) -> None:
    """The answerer's side of one probe session: echo pings, time each bulk transfer
    (one at a time under ``bulk_lock``, or probes share the link), until the asker
    closes or sends anything else; at most :data:`ANSWER_S`."""
    with trio.move_on_after(ANSWER_S):
        while True:
            op = await channel.read(1)
            if op == b"P":
                await channel.write(b"p")
            elif op == b"B":
                (n,) = _LEN.unpack(await read_exact(channel, _LEN.size))
                if n > kind.max_bytes:
                    raise RemoteProtocolError(f"{kind.name} probe of {n} bytes")
                async with bulk_lock or contextlib.nullcontext():
                    await receive_bulk(channel, n)
            else:
                return


async def measure(channel: ProbeChannel, kind: ProbeKind, nbytes: int) -> LinkMeasurement:
    """The asker's side: RTT (median of 5 pings) and the rate of one bulk transfer."""
    rtts = []
    for _ in range(5):
        t0 = time.perf_counter()
        await channel.write(b"P")
        await read_exact(channel, 1)
        rtts.append(time.perf_counter() - t0)
    rtt = statistics.median(rtts)
    t0 = time.perf_counter()
    await channel.write(b"B" + _LEN.pack(nbytes))
    remaining = nbytes
    while remaining:
        piece = _CHUNK[: min(remaining, len(_CHUNK))]
        await channel.write(piece)
        remaining -= len(piece)
    reply = await read_exact(channel, 1 + _SECONDS.size)
    elapsed = time.perf_counter() - t0
    if reply[:1] != b"K":
        raise RemoteProtocolError(f"{kind.name} probe peer did not acknowledge")
    (tail_s,) = _SECONDS.unpack(reply[1:])
    return LinkMeasurement(rtt_s=rtt, bandwidth_bps=kind.bandwidth(nbytes, tail_s, elapsed, rtt))


class TailClock:
    """The receiver's clock for one bulk transfer of ``n`` bytes: how long the last three
    quarters took to arrive.

    Feed it every read with the kernel's arrival time of the read's last byte where the
    socket gives one (``SO_TIMESTAMPNS``, see :func:`arrival_s`), None where it does not.
    Kernel arrival times are immune to a receiver that reads late and drains a backlog at
    once; where a read comes without one, the clock in user space stands in.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.remaining = n
        self._mark = n - n // 4  # the clock starts once a quarter has arrived
        self._started = time.perf_counter()
        self._kernel_start: tuple[float, int] | None = None  # (arrival, bytes still to come)
        self._kernel_end: float | None = None

    def read(self, nbytes: int, arrived: float | None) -> None:
        before = self.remaining
        self.remaining -= nbytes
        if before > self._mark >= self.remaining:
            self._started = time.perf_counter()
            if arrived is not None and self.remaining:
                self._kernel_start = (arrived, self.remaining)
        self._kernel_end = arrived

    def seconds(self) -> float:
        """The tail's duration, scaled to the bytes the asker divides by (three quarters)."""
        start, end = self._kernel_start, self._kernel_end
        if start is not None and end is not None and end > start[0]:
            return (end - start[0]) * (self.n - self.n // 4) / start[1]
        return time.perf_counter() - self._started


def tail_bandwidth(nbytes: int, tail_s: float, elapsed_s: float) -> float:
    """Bytes/s of a bulk transfer of ``nbytes``: its last three quarters over the
    receiver's ``tail_s`` (:class:`TailClock`), or the whole over the asker's
    ``elapsed_s`` where the receiver timed no tail (a tiny transfer)."""
    tail_bytes = nbytes - nbytes // 4
    if tail_s > 0 and tail_bytes > 0:
        return tail_bytes / tail_s
    return nbytes / max(elapsed_s, 1e-6)


def stream_bandwidth(nbytes: int, tail_s: float, elapsed_s: float) -> float:
    """The link's rate from one probe over a stream: the receiver's tail figure, never
    above the asker's whole one (``nbytes`` over ``elapsed_s``, from the first byte
    written to the acknowledgement read).

    The receiver reads the stream after the muxer buffered it, so its clock is in user
    space: a receiver that got no CPU for a while drains the backlog at once and times
    it as a fast link (a relayed 12.5 MB/s path once read as 31 MB/s). The asker's
    figure cannot be fooled that way: no acknowledgement comes back before every byte
    has crossed the link.
    """
    return min(tail_bandwidth(nbytes, tail_s, elapsed_s), nbytes / max(elapsed_s, 1e-6))


async def receive_bulk(channel: ProbeChannel, n: int) -> None:
    """Receive ``n`` bytes; answer with the time the last three quarters took to arrive."""
    clock = TailClock(n)
    while clock.remaining:
        chunk, arrived = await channel.read_timed(min(clock.remaining, 1 << 20))
        if not chunk:
            raise RemoteProtocolError("probe connection closed mid-transfer")
        clock.read(len(chunk), arrived)
    await channel.write(b"K" + _SECONDS.pack(clock.seconds()))


async def serve_probe(
    host: str,
    psk: str,
    *,
    auth_timeout_s: float = AUTH_TIMEOUT_S,
    max_pending: int = 32,
    max_pending_per_address: int = 8,
    task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer link probes on ``host`` (an IP; "0.0.0.0" for all); reports the port."""
    token = probe_token(psk)
    bulk_lock = trio.Lock()
    gate = ConnectionGate(max_pending, max_pending_per_address)
    listeners = await trio.open_tcp_listeners(0, host=host)
    port = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.SocketStream) -> None:
        try:
            source = str(stream.socket.getpeername()[0])
        except OSError:
            await stream.aclose()
            return
        if not gate.admit(source):
            await stream.aclose()  # over the cap: closed before a byte is read
            return
        channel = SocketChannel(stream, stamped=enable_timestamps(stream.socket))
        try:
            try:
                trusted = await _authenticate(channel, token, auth_timeout_s)
            finally:
                gate.release(source)
            if trusted:
                await answer(channel, TCP_PROBE, bulk_lock=bulk_lock)
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError):
            pass
        except Exception:
            log.debug("probe handler failed", exc_info=True)
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        task_status.started(port)
        await trio.serve_listeners(handler, listeners, handler_nursery=nursery)


async def probe_link(
    host: str, port: int, psk: str, *, nbytes: int = PROBE_BYTES, timeout_s: float = 15.0
) -> LinkMeasurement:
    """Measure RTT (median of 5 pings) and one-way bandwidth to a probe server."""
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                channel = SocketChannel(stream)
                challenge = await read_exact(channel, CHALLENGE_BYTES)
                await channel.write(probe_answer(probe_token(psk), challenge))
                return await measure(channel, TCP_PROBE, nbytes)
    except trio.TooSlowError as exc:
        raise PeerUnreachable(f"link probe to {host}:{port} timed out") from exc
    except (OSError, trio.BrokenResourceError) as exc:
        raise PeerUnreachable(f"link probe to {host}:{port} failed: {exc}") from exc


__all__ = [
    "LIBP2P_PROBE",
    "PROBE_BYTES",
    "PUNCHED_PROBE",
    "TCP_PROBE",
    "LinkMeasurement",
    "ProbeChannel",
    "ProbeKind",
    "SocketChannel",
    "StreamChannel",
    "answer",
    "measure",
    "probe_answer",
    "probe_link",
    "probe_token",
    "read_exact",
    "receive_bulk",
    "serve_probe",
    "stream_bandwidth",
    "tail_bandwidth",
]
