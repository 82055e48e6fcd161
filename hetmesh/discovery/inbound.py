"""Inbound connections that free their slot when they close (a py-libp2p 0.8 fix).

py-libp2p's swarm admits an inbound connection under a cap of
``max_connections - min_connections`` (250 by default), and the task that
accepted it holds its slot until the *swarm* stops, not until the connection
closes: its handler ends in ``await self.manager.wait_finished()``. So every
connection a node ever accepted counts for its whole life, and after about 250
of them (status polls, SDK clients, members reconnecting) it refuses every new
one: the client sees a port that answers and a handshake that never completes.
Each of those tasks also keeps its closed connection's objects alive.

:func:`release_closed_inbound` wraps the swarm's inbound handler: the
connection it registers (``add_conn``, called in the same task) is watched,
and when it closes the handler is cancelled, which ends the task and returns
its slot. A handshake that fails returns as before. The cap then bounds the
connections open at once, as it means to.

Connections still upgrading (private-network key, Noise, yamux: before anyone
is known) are also admitted through a :class:`~hetmesh.transport.gate.ConnectionGate`:
at most :data:`MAX_PENDING_UPGRADES` at once, :data:`MAX_PENDING_PER_ADDRESS`
from one address and :data:`MAX_PENDING_PER_PREFIX` from one network (a /24,
an IPv6 /64). One past a cap is closed at once, so a stranger's silent
connections cannot take the places a member's connection needs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from hetmesh.transport.gate import ConnectionGate

log = logging.getLogger(__name__)

MAX_PENDING_UPGRADES = 64
MAX_PENDING_PER_ADDRESS = 8
MAX_PENDING_PER_PREFIX = 16


@dataclass
class _Accepted:
    """The connection an inbound handler registered, once it has."""

    added: trio.Event = field(default_factory=trio.Event)
    conn: Any = None


# the inbound handler running in this task (None: add_conn was called for a dial)
_ACCEPTING: contextvars.ContextVar[_Accepted | None] = contextvars.ContextVar(
    "hetmesh_inbound_accepting", default=None
)


def release_closed_inbound(swarm: Any) -> None:
    """Make ``swarm``'s inbound handlers end when their connection closes (left as
    is where the swarm is not the shape this fix knows)."""
    accept = getattr(swarm, "_do_handle_inbound_connection", None)
    add_conn = getattr(swarm, "add_conn", None)
    if accept is None or add_conn is None:
        log.debug("libp2p swarm without the inbound handler this fix wraps: left as is")
        return

    async def add_conn_noted(muxed_conn: Any, *args: Any, **kwargs: Any) -> Any:
        conn = await add_conn(muxed_conn, *args, **kwargs)
        accepted = _ACCEPTING.get()
        if accepted is not None and not accepted.added.is_set():
            accepted.conn = conn
            accepted.added.set()
        return conn

    gate = ConnectionGate(MAX_PENDING_UPGRADES, MAX_PENDING_PER_ADDRESS, MAX_PENDING_PER_PREFIX)
    swarm.hetmesh_upgrade_gate = gate  # for statistics and tests

    async def accept_until_closed(*args: Any, **kwargs: Any) -> None:
        source = _source(args[0]) if args else ""
        if source and not gate.admit(source):
            log.debug("inbound connection from %s refused: too many upgrading", source)
            with contextlib.suppress(Exception):
                await args[0].close()
            return
        upgrading = bool(source)

        def upgraded() -> None:
            nonlocal upgrading
            if upgrading:
                upgrading = False
                gate.release(source)

        accepted = _Accepted()
        token = _ACCEPTING.set(accepted)
        try:
            async with trio.open_nursery() as nursery:

                async def until_closed() -> None:
                    await accepted.added.wait()
                    upgraded()  # authenticated: its place among the upgrading is free
                    closed = getattr(accepted.conn, "event_closed", None)
                    if closed is None:
                        return  # not a connection we can watch: libp2p's own way
                    await closed.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_closed)
                await accept(*args, **kwargs)
                nursery.cancel_scope.cancel()  # it returned: a failed handshake
        finally:
            upgraded()
            _ACCEPTING.reset(token)

    swarm.add_conn = add_conn_noted
    swarm._do_handle_inbound_connection = accept_until_closed


def _source(read_write_closer: Any) -> str:
    """The remote IP of an accepted raw connection ("" when it cannot tell)."""
    try:
        remote = read_write_closer.get_remote_address()
    except Exception:
        return ""
    if isinstance(remote, tuple) and remote and isinstance(remote[0], str):
        return remote[0]
    return ""


__all__ = [
    "MAX_PENDING_PER_ADDRESS",
    "MAX_PENDING_PER_PREFIX",
    "MAX_PENDING_UPGRADES",
    "release_closed_inbound",
]
