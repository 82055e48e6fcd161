"""Link probe: RTT and bandwidth between two nodes over a plain TCP socket.

This is the only module that knows how links are measured; when the
transport's ``tcp`` backend lands, swap :func:`probe_link` and
:func:`serve_probe` for it and nothing else changes.

Protocol (one connection per probe): the server opens with a 16-byte random
challenge; the client answers with an HMAC of it under a key derived from the
mesh secret (so strangers cannot use the port as a sink, and an answer seen
on the wire is worth nothing on the next connection), then
``b"P"`` pings, each echoed by one byte, then ``b"B"`` + an 8-byte length +
that many bytes, acknowledged by ``b"K"`` and the receiver's time (float64
seconds) between the arrival of the first quarter and of the last byte.
Timing the tail at the receiver keeps TCP slow start, the sender's socket
buffer and a token bucket's initial burst out of the figure. Arrival times
are the kernel's receive timestamps (``SO_TIMESTAMPNS``) where it gives them:
a receiver starved of CPU (a cgroup quota) reads late and then drains a
backlog at once, which a clock read in user space would count as a fast link.

A stranger costs little: at most ``max_pending`` connections wait for their
answer at once (``max_pending_per_address`` from one address; more are
closed on accept), each for ``auth_timeout_s`` at most.
"""

from __future__ import annotations

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
from typing import TYPE_CHECKING

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


CHALLENGE_BYTES = 16
AUTH_TIMEOUT_S = 5.0


def probe_token(psk: str) -> bytes:
    """The probe key: derived from the mesh secret, never sent."""
    return hashlib.sha256(b"hetmesh/probe/v1\x00" + psk.encode()).digest()


def probe_answer(token: bytes, challenge: bytes) -> bytes:
    """What proves the mesh secret for one connection's ``challenge``."""
    return hmac.new(token, b"hetmesh/probe/v2\x00" + challenge, hashlib.sha256).digest()


async def _receive_exact(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
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


async def _authenticate(stream: trio.SocketStream, token: bytes, timeout_s: float) -> bool:
    """Challenge the client; True once it proved the mesh secret within ``timeout_s``."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    with trio.move_on_after(timeout_s):
        await stream.send_all(challenge)
        got = await _receive_exact(stream, 32)
        return hmac.compare_digest(got, probe_answer(token, challenge))
    return False


async def _handle(stream: trio.SocketStream, bulk_lock: trio.Lock) -> None:
    """One authenticated probe session: pings, then bulk transfers."""
    stamped = enable_timestamps(stream.socket)
    async with stream:
        with trio.move_on_after(30):
            while True:
                op = await stream.receive_some(1)
                if op == b"P":
                    await stream.send_all(b"p")
                elif op == b"B":
                    (n,) = _LEN.unpack(await _receive_exact(stream, _LEN.size))
                    if n > MAX_PROBE_BYTES:
                        return
                    async with bulk_lock:  # one bulk at a time, or probes share the link
                        await _receive_bulk(stream, n, stamped=stamped)
                else:
                    return


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


async def _receive_bulk(stream: trio.SocketStream, n: int, *, stamped: bool) -> None:
    """Receive ``n`` bytes; answer with the time the last three quarters took to arrive."""
    clock = TailClock(n)
    while clock.remaining:
        size = min(clock.remaining, 1 << 20)
        if stamped:
            chunk, ancillary, _, _ = await stream.socket.recvmsg(size, socket.CMSG_SPACE(16))
        else:
            chunk, ancillary = await stream.receive_some(size), []
        if not chunk:
            raise RemoteProtocolError("probe connection closed mid-transfer")
        clock.read(len(chunk), arrival_s(ancillary))
    await stream.send_all(b"K" + _SECONDS.pack(clock.seconds()))


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
        try:
            try:
                trusted = await _authenticate(stream, token, auth_timeout_s)
            finally:
                gate.release(source)
            if trusted:
                await _handle(stream, bulk_lock)
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
                challenge = await _receive_exact(stream, CHALLENGE_BYTES)
                await stream.send_all(probe_answer(probe_token(psk), challenge))
                rtts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    await stream.send_all(b"P")
                    await _receive_exact(stream, 1)
                    rtts.append(time.perf_counter() - t0)
                rtt = statistics.median(rtts)
                t0 = time.perf_counter()
                await stream.send_all(b"B" + _LEN.pack(nbytes))
                remaining = nbytes
                while remaining:
                    piece = _CHUNK[: min(remaining, len(_CHUNK))]
                    await stream.send_all(piece)
                    remaining -= len(piece)
                reply = await _receive_exact(stream, 1 + _SECONDS.size)
                if reply[:1] != b"K":
                    raise RemoteProtocolError("probe server did not acknowledge")
                (tail_s,) = _SECONDS.unpack(reply[1:])
                bandwidth = tail_bandwidth(nbytes, tail_s, time.perf_counter() - t0 - rtt)
                return LinkMeasurement(rtt_s=rtt, bandwidth_bps=bandwidth)
    except trio.TooSlowError as exc:
        raise PeerUnreachable(f"link probe to {host}:{port} timed out") from exc
    except (OSError, trio.BrokenResourceError) as exc:
        raise PeerUnreachable(f"link probe to {host}:{port} failed: {exc}") from exc


__all__ = [
    "PROBE_BYTES",
    "LinkMeasurement",
    "probe_answer",
    "probe_link",
    "probe_token",
    "serve_probe",
    "tail_bandwidth",
]
