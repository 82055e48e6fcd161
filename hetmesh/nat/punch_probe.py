"""Link probes over a hole-punched path, for members whose data plane is punched.

Two homes whose data-plane link is hole-punched (:mod:`hetmesh.transport.punch`)
move tensors over a direct TCP connection through both routers, not over the
relayed libp2p connection that :mod:`hetmesh.nat.p2p_probe` measures. So the
link probe between them punches a connection of its own the same way and
measures RTT and bandwidth on it: the planner then prices the link as the
path the data plane really takes.

Protocol on :data:`PUNCH_PROBE_PROTOCOL` (over the authenticated, relayed
libp2p connection): the asker writes ``"<candidate> <token hex>\\n"``, the
answerer ``"<candidate>\\n"`` (``"-"`` when it has none); both then open
simultaneously from their reserved ports on the default schedule. On the
punched socket the asker first sends the 16-byte token (the answerer drops a
connection without it), then the p2p probe's pings and timed bulk transfer.
A failed punch raises :class:`~hetmesh.errors.PeerUnreachable`; the caller
falls back to the libp2p probe.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import statistics
import struct
import time
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery.probe import (
    LinkMeasurement,
    TailClock,
    arrival_s,
    enable_timestamps,
    tail_bandwidth,
)
from hetmesh.discovery.rpc import open_stream
from hetmesh.errors import MeshError, PeerUnreachable, RemoteProtocolError
from hetmesh.transport.punch import public_ip, punchable_host, reserve_port, simultaneous_open
from hetmesh.transport.punch_plan import DEFAULT_SCHEDULE, Candidate, parse_candidate
from hetmesh.transport.threads import in_thread

if TYPE_CHECKING:
    from hetmesh.discovery.service import Discovery

log = logging.getLogger(__name__)

PUNCH_PROBE_PROTOCOL = "/hetmesh/punch-probe/1.0.0"
MAX_PUNCH_PROBE_BYTES = 16 * 1024 * 1024
_TOKEN_BYTES = 16
_LINE_BYTES = 128
_LEN = struct.Struct(">Q")
_SECONDS = struct.Struct(">d")
_CHUNK = 256 * 1024
_IO_TIMEOUT_S = 30.0
# punched probes answered at once (each holds a worker thread for up to ~10 s):
# more are told "-" (no candidate), and the asker probes over libp2p instead
MAX_CONCURRENT_ANSWERS = 2


def local_host(addrs: Any) -> str | None:
    """The first announced non-loopback IPv4 address (where a punch binds), or None."""
    for addr in addrs:
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] == "ip4" and punchable_host(parts[2]):
            return parts[2]
    return None


async def read_line(stream: Any) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.read(1)
        if not chunk:
            raise RemoteProtocolError("punch probe stream closed early")
        data += chunk
        if len(data) > _LINE_BYTES:
            raise RemoteProtocolError("punch probe line too long")
    return data[:-1].decode("ascii", "replace")


async def read_offer(stream: Any, token_bytes: int) -> tuple[Candidate, bytes] | None:
    """The asker's line ``"CANDIDATE TOKENHEX"``: its candidate and a token of
    ``token_bytes`` bytes, or None if either is malformed."""
    mine_text, _, token_hex = (await read_line(stream)).partition(" ")
    theirs = parse_candidate(mine_text)
    try:
        token = bytes.fromhex(token_hex)
    except ValueError:
        return None
    return None if theirs is None or len(token) != token_bytes else (theirs, token)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RemoteProtocolError("punched probe connection closed early")
        buf += chunk
    return bytes(buf)


def _measure(sock: socket.socket, token: bytes, nbytes: int) -> LinkMeasurement:
    """Blocking, the asker's side on the punched socket."""
    with sock:
        sock.settimeout(_IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token)
        rtts = []
        for _ in range(5):
            t0 = time.perf_counter()
            sock.sendall(b"P")
            recv_exact(sock, 1)
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        t0 = time.perf_counter()
        sock.sendall(b"B" + _LEN.pack(nbytes))
        payload, remaining = bytes(_CHUNK), nbytes
        while remaining:
            piece = payload[: min(remaining, _CHUNK)]
            sock.sendall(piece)
            remaining -= len(piece)
        reply = recv_exact(sock, 1 + _SECONDS.size)
        elapsed = time.perf_counter() - t0
    if reply[:1] != b"K":
        raise RemoteProtocolError("punched probe peer did not acknowledge")
    (tail_s,) = _SECONDS.unpack(reply[1:])
    return LinkMeasurement(rtt_s=rtt, bandwidth_bps=tail_bandwidth(nbytes, tail_s, elapsed))


def _answer(sock: socket.socket, token: bytes) -> None:
    """Blocking, the answerer's side: the token first, then pings and one timed transfer."""
    with sock:
        sock.settimeout(_IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # kernel arrival times: a thread that reads late must not make the link look fast
        # (asked for first: the kernel may switch its timestamps on a little later)
        stamped = enable_timestamps(sock)
        if not hmac.compare_digest(recv_exact(sock, _TOKEN_BYTES), token):
            raise RemoteProtocolError("punched probe connection without the token")
        while True:
            op = sock.recv(1)
            if op == b"P":
                sock.sendall(b"p")
            elif op == b"B":
                (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
                if n > MAX_PUNCH_PROBE_BYTES:
                    raise RemoteProtocolError(f"punched probe of {n} bytes")
                clock, cmsg = TailClock(n), socket.CMSG_SPACE(16) if stamped else 0
                while clock.remaining:
                    chunk, ancillary, _, _ = sock.recvmsg(min(clock.remaining, _CHUNK), cmsg)
                    if not chunk:
                        raise RemoteProtocolError("punched probe closed mid-transfer")
                    clock.read(len(chunk), arrival_s(ancillary))
                sock.sendall(b"K" + _SECONDS.pack(clock.seconds()))
                return
            else:
                return


def reserve_candidate(discovery: Discovery) -> tuple[socket.socket, Candidate] | None:
    ip, host = public_ip(), local_host(discovery.addrs)
    if not ip or not host:
        return None
    sock = reserve_port(host)
    return sock, Candidate(ip, sock.getsockname()[1])


async def punch_from(reserved: socket.socket, remote: Candidate) -> socket.socket | None:
    local = reserved.getsockname()[:2]
    try:
        with trio.move_on_after(DEFAULT_SCHEDULE.total_s + DEFAULT_SCHEDULE.timeout_s):
            return await in_thread(simultaneous_open, local, remote, DEFAULT_SCHEDULE)
        return None
    finally:
        reserved.close()


async def probe_over_punch(
    discovery: Discovery, peer_id: str, *, nbytes: int, timeout_s: float = 40.0
) -> LinkMeasurement:
    """Measure RTT and bandwidth to ``peer_id`` over a freshly hole-punched connection.

    Raises :class:`PeerUnreachable` (no candidate, a failed punch, a timeout)
    or :class:`RemoteProtocolError`.
    """
    try:
        reservation = reserve_candidate(discovery)
    except OSError as exc:
        raise PeerUnreachable(f"no local port to punch from: {exc!r}") from exc
    if reservation is None:
        raise PeerUnreachable("no public mapping known here: nothing to punch from")
    reserved, mine = reservation
    token = secrets.token_bytes(_TOKEN_BYTES)
    try:
        with trio.fail_after(timeout_s):
            stream = await open_stream(
                discovery.host, peer_id, PUNCH_PROBE_PROTOCOL, timeout_s=timeout_s
            )
            try:
                await stream.write(f"{mine} {token.hex()}\n".encode())
                theirs = parse_candidate(await read_line(stream))
            finally:
                await stream.close()
            if theirs is None:
                raise PeerUnreachable(f"{peer_id} offered no punch candidate")
            sock = await punch_from(reserved, theirs)
            if sock is None:
                raise PeerUnreachable(f"hole punching to {peer_id} ({theirs}) failed")
            return await in_thread(_measure, sock, token, nbytes)
    except trio.TooSlowError as exc:
        raise PeerUnreachable(f"punched link probe to {peer_id} timed out") from exc
    except MeshError:
        raise
    except Exception as exc:  # libp2p stream and socket errors
        raise PeerUnreachable(f"punched link probe to {peer_id} failed: {exc!r}") from exc
    finally:
        reserved.close()


def punch_probe_handler(discovery: Discovery) -> Any:
    """The answerer's libp2p handler (wrap it with ``guarded_handler``)."""
    busy = {"answers": 0}

    async def handle(stream: Any) -> None:
        with trio.fail_after(_IO_TIMEOUT_S + DEFAULT_SCHEDULE.total_s):
            offer = await read_offer(stream, _TOKEN_BYTES)
            free = busy["answers"] < MAX_CONCURRENT_ANSWERS
            reservation = reserve_candidate(discovery) if offer is not None and free else None
            await stream.write(f"{reservation[1] if reservation else '-'}\n".encode())
            await stream.close()
            if reservation is None or offer is None:
                return
            theirs, token = offer
            busy["answers"] += 1
            try:
                sock = await punch_from(reservation[0], theirs)
                if sock is not None:
                    await in_thread(_answer, sock, token)
            finally:
                busy["answers"] -= 1

    return handle


__all__ = [
    "PUNCH_PROBE_PROTOCOL",
    "local_host",
    "probe_over_punch",
    "punch_probe_handler",
]
