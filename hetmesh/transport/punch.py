"""Hole punching for the data plane: the sockets (see :mod:`hetmesh.transport.punch_plan`).

- :func:`set_public_ip` / :func:`public_ip`: the public IP this process's node
  was seen from (``hetmesh.nat.dialback`` records it once the verdict is
  "behind NAT"). A process-wide value because the data plane is built by the
  serving layer and reachability by the daemon, and one process is one node;
  None (the default) means "do not offer a punch candidate".
- :func:`reserve_port`: a socket bound (not listening) to a fresh local port
  with ``SO_REUSEADDR``/``SO_REUSEPORT``, held from the offer until the punch
  so that the port in our candidate stays ours.
- :func:`simultaneous_open` (blocking): connect from that port to the peer's
  candidate on the schedule; both sides doing it at once is a TCP
  simultaneous open, which both NAT routers see as an outgoing connection.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable

from hetmesh.transport.punch_plan import AttemptSchedule, Candidate

log = logging.getLogger(__name__)

_public_ip: str | None = None
# the hole-punched links this process holds: (peer id, "is it still open?")
_punched: list[tuple[str, Callable[[], bool]]] = []


def set_public_ip(ip: str | None) -> None:
    """Record the public IP members see this node from (None: behind no NAT / unknown)."""
    global _public_ip
    _public_ip = ip or None


def public_ip() -> str | None:
    return _public_ip


def note_punched(peer_id: str, is_open: Callable[[], bool]) -> None:
    """Remember a hole-punched link to ``peer_id`` while ``is_open()`` (for status)."""
    _punched.append((peer_id, is_open))


def punched_peers() -> list[str]:
    """The peers this node holds an open hole-punched data-plane link to, sorted."""
    _punched[:] = [(peer, is_open) for peer, is_open in _punched if is_open()]
    return sorted({peer for peer, _ in _punched})


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


__all__ = [
    "note_punched",
    "public_ip",
    "punchable_host",
    "punched_peers",
    "reserve_port",
    "set_public_ip",
    "simultaneous_open",
]
