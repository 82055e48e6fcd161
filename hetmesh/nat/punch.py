"""Hole punching: the sockets (the pure plan: :mod:`hetmesh.nat.punch_plan`).

- :func:`reserve_port`: a socket bound (not listening) to a fresh local port
  with ``SO_REUSEADDR``/``SO_REUSEPORT``, held from the offer until the punch
  so that the port in our candidate stays ours.
- :func:`simultaneous_open` (blocking): connect from that port to the peer's
  candidate on the schedule; both sides doing it at once is a TCP
  simultaneous open, which both NAT routers see as an outgoing connection.

The public IP a candidate names and the punched links a node holds are the
node's :class:`~hetmesh.nat.state.NatState`, passed where they are needed.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Iterable
from typing import Any

import trio

from hetmesh.errors import PeerUnreachable, RemoteProtocolError
from hetmesh.nat.punch_plan import DEFAULT_SCHEDULE, AttemptSchedule, Candidate, parse_candidate
from hetmesh.nat.state import NatState
from hetmesh.transport.threads import in_thread

log = logging.getLogger(__name__)


def punchable_host(host: str) -> bool:
    """Whether a data plane listening on ``host`` can punch (not loopback / wildcard)."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return not (address.is_loopback or address.is_unspecified)


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # several sockets on one local port: the reservation and each attempt
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(host: str) -> socket.socket:
    """A socket holding a fresh local port on ``host`` for a punch (close it after)."""
    return _bound(host, 0)


def simultaneous_open(
    local: tuple[str, int],
    remote: Candidate,
    schedule: AttemptSchedule,
    *,
    clock: float | None = None,
) -> socket.socket | None:
    """Blocking: a TCP connection from ``local`` to ``remote``, or None when every attempt failed.

    Attempt ``i`` starts at ``schedule.starts()[i]`` seconds after ``clock``
    (default: now) and waits ``schedule.timeout_s`` for the handshake; a
    refused or timed-out attempt is closed and the next one binds the same
    port again. The returned socket is blocking, with no timeout set.
    """
    start = time.monotonic() if clock is None else clock
    for offset in schedule.starts():
        wait = start + offset - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        sock = _bound(*local)
        sock.settimeout(schedule.timeout_s)
        try:
            sock.connect((remote.ip, remote.port))
        except OSError as exc:  # refused, reset or timed out: the next attempt may pass
            log.debug("punch %s:%d -> %s failed: %r", *local, remote, exc)
            sock.close()
            continue
        sock.settimeout(None)
        return sock
    return None


# the exchange before a punch (over the authenticated libp2p connection): the asker
# writes "<candidate> <token hex>\n", the answerer "<candidate>\n" ("-": none)
_LINE_BYTES = 128
TOKEN_BYTES = 16  # the one-time token the asker proves on the punched socket


def local_host(addrs: Iterable[Any]) -> str | None:
    """The first announced non-loopback IPv4 address (where a punch binds), or None."""
    for addr in addrs:
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] == "ip4" and punchable_host(parts[2]):
            return parts[2]
    return None


def reserve_candidate(
    nat: NatState, addrs: Iterable[Any]
) -> tuple[socket.socket, Candidate] | None:
    """A local port held for a punch and our candidate (the public IP ``nat`` knows, that
    port), or None when this node knows no public IP or has no address to bind."""
    ip, host = nat.public_ip, local_host(addrs)
    if not ip or not host:
        return None
    sock = reserve_port(host)
    return sock, Candidate(ip, sock.getsockname()[1])


async def punch_from(reserved: socket.socket, remote: Candidate) -> socket.socket | None:
    """Punch from the ``reserved`` port to ``remote`` on the default schedule (the
    reservation is closed either way); the connected socket, or None."""
    local = reserved.getsockname()[:2]
    try:
        with trio.move_on_after(DEFAULT_SCHEDULE.total_s + DEFAULT_SCHEDULE.timeout_s):
            return await in_thread(simultaneous_open, local, remote, DEFAULT_SCHEDULE)
        return None
    finally:
        reserved.close()


async def read_line(stream: Any) -> str:
    """One line of the candidate exchange from a libp2p stream (bounded)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.read(1)
        if not chunk:
            raise RemoteProtocolError("punch exchange stream closed early")
        data += chunk
        if len(data) > _LINE_BYTES:
            raise RemoteProtocolError("punch exchange line too long")
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


async def punch_to(
    nat: NatState, addrs: Iterable[Any], host: Any, peer_id: str, protocol: str, timeout_s: float
) -> tuple[socket.socket, bytes]:
    """The asker's side of a punch: reserve a port, trade candidates with ``peer_id``
    over a ``protocol`` stream (ours with a fresh token), open simultaneously. The
    punched socket and the token the asker must prove on it first; raises
    :class:`PeerUnreachable` (nothing to punch from, no candidate, a failed punch)."""
    from hetmesh.discovery.rpc import open_stream

    try:
        reservation = reserve_candidate(nat, addrs)
    except OSError as exc:
        raise PeerUnreachable(f"no local port to punch from: {exc!r}") from exc
    if reservation is None:
        raise PeerUnreachable("no public mapping known here: nothing to punch from")
    reserved, mine = reservation
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        stream = await open_stream(host, peer_id, protocol, timeout_s=timeout_s)
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
        return sock, token
    finally:
        reserved.close()


async def answer_offer(
    stream: Any, nat: NatState, addrs: Iterable[Any], *, willing: bool
) -> tuple[socket.socket, Candidate, bytes] | None:
    """The answerer's side of the exchange on ``stream`` (closed after): the asker's
    offer, then our candidate when ``willing`` (else ``"-"``). The port reserved for
    the punch (:func:`punch_from` it), the asker's candidate and its token; None when
    either side has none."""
    offer = await read_offer(stream, TOKEN_BYTES)
    reservation = reserve_candidate(nat, addrs) if offer is not None and willing else None
    await stream.write(f"{reservation[1] if reservation else '-'}\n".encode())
    await stream.close()
    if reservation is None or offer is None:
        return None
    return reservation[0], *offer


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Blocking: exactly ``n`` bytes from a punched socket."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RemoteProtocolError("punched connection closed early")
        buf += chunk
    return bytes(buf)


__all__ = [
    "TOKEN_BYTES",
    "answer_offer",
    "local_host",
    "punch_from",
    "punch_to",
    "punchable_host",
    "read_line",
    "read_offer",
    "recv_exact",
    "reserve_candidate",
    "reserve_port",
    "simultaneous_open",
]
