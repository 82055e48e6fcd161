"""Asking a node for its view of the mesh (the status RPC client side).

The server side is :meth:`hetmesh.discovery.service.Discovery.view`, served on
:data:`~hetmesh.discovery.wire.STATUS_PROTOCOL`. The client is a throw-away
libp2p host with a random identity: it never announces itself, so it never
enters any peer table.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import trio

from hetmesh.discovery import wire
from hetmesh.discovery.host import derive_psk, dial, open_host, parse_peer_addr
from hetmesh.errors import ConnectTimeout, PeerUnreachable, RemoteProtocolError, StreamReset


async def fetch_status(
    addr: str, *, mesh_secret: str | None = None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """The view of the node at ``addr`` (``/ip4/H/tcp/P/p2p/ID``).

    Raises ``ValueError`` for a malformed address, :class:`AuthenticationFailed`
    for a wrong mesh secret, :class:`PeerUnreachable` / :class:`ConnectTimeout`
    when the node cannot be reached, :class:`RemoteProtocolError` for a bad reply.
    """
    limit_s = min(timeout_s, 3.0)
    # a node too busy to agree on the protocol within a dial's 3 s is slow, not gone (the
    # connection is open): its stream may take the request's whole time
    async with open_status_client(
        mesh_secret=mesh_secret, dial_timeout_s=limit_s, negotiate_timeout_s=timeout_s
    ) as host:
        return await request_status(host, addr, timeout_s=timeout_s, dial_timeout_s=limit_s)


@contextlib.asynccontextmanager
async def open_status_client(
    *,
    mesh_secret: str | None = None,
    dial_timeout_s: float = 3.0,
    negotiate_timeout_s: float | None = None,
) -> AsyncIterator[Any]:
    """A throw-away host to ask nodes for their views with :func:`request_status`
    (one host for many requests: a watcher polling a mesh dials each node once).
    ``negotiate_timeout_s`` bounds each stream's protocol negotiation
    (``dial_timeout_s`` when not given)."""
    from libp2p import generate_new_ed25519_identity

    async with open_host(
        generate_new_ed25519_identity(),
        psk=derive_psk(mesh_secret),
        listen=["/ip4/127.0.0.1/tcp/0"],
        dial_timeout_s=dial_timeout_s,
        negotiate_timeout_s=negotiate_timeout_s,
    ) as host:
        yield host


async def request_status(
    host: Any, addr: str, *, timeout_s: float = 5.0, dial_timeout_s: float = 3.0
) -> dict[str, Any]:
    """The view of the node at ``addr``, asked through ``host`` (from
    :func:`open_status_client`), dialling only if not connected; raises as
    :func:`fetch_status` does."""
    from libp2p.custom_types import TProtocol
    from libp2p.host.exceptions import StreamFailure

    info = parse_peer_addr(addr)
    if info.peer_id not in host.get_network().connections:
        await dial(host, info, timeout_s=dial_timeout_s)
    try:
        with trio.fail_after(timeout_s):
            stream = await host.new_stream(info.peer_id, [TProtocol(wire.STATUS_PROTOCOL)])
            try:
                payload = await wire.read_frame(
                    stream, max_bytes=wire.MAX_STATUS_BYTES, timeout_s=timeout_s
                )
            finally:
                with contextlib.suppress(Exception):
                    await stream.close()
    except trio.TooSlowError as exc:
        raise ConnectTimeout(f"{addr} did not answer the status request in time") from exc
    except StreamReset as exc:
        raise RemoteProtocolError(f"{addr} closed the status stream: {exc}") from exc
    except StreamFailure as exc:  # its protocol negotiation timed out (a node under load)
        raise PeerUnreachable(f"{addr} did not open a status stream: {exc}") from exc
    return wire.decode_map(payload, max_bytes=wire.MAX_STATUS_BYTES)


__all__ = ["fetch_status", "open_status_client", "request_status"]
