"""The one control-call helper between two real libp2p hosts: each failure's error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from hetmesh.discovery import rpc, wire
from hetmesh.discovery.host import derive_psk, dial, guarded_handler, open_host, parse_peer_addr
from hetmesh.errors import ConnectTimeout, PeerUnreachable, RemoteProtocolError, StreamReset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # a few seconds; generous for load

ECHO, SILENT, HUGE = "/test/echo/1", "/test/silent/1", "/test/huge/1"


async def _echo(stream: Any) -> None:
    data = wire.decode_map(await wire.read_frame(stream, max_bytes=1024, timeout_s=10))
    await wire.write_frame(stream, wire.encode({"echo": data}))


async def _silent(stream: Any) -> None:
    await wire.read_frame(stream, max_bytes=1024, timeout_s=10)
    await trio.sleep(30)  # never answers


async def _huge(stream: Any) -> None:
    await wire.read_frame(stream, max_bytes=1024, timeout_s=10)
    await wire.write_frame(stream, wire.encode({"blob": b"x" * 4096}))


@pytest.fixture
async def hosts() -> AsyncIterator[tuple[Any, Any]]:
    from libp2p import generate_new_ed25519_identity
    from libp2p.custom_types import TProtocol

    psk = derive_psk("rpc-test")
    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with (
        open_host(generate_new_ed25519_identity(), psk=psk, listen=listen) as server,
        open_host(generate_new_ed25519_identity(), psk=psk, listen=listen) as client,
    ):
        for name, handler in ((ECHO, _echo), (SILENT, _silent), (HUGE, _huge)):
            server.set_stream_handler(TProtocol(name), guarded_handler(name, handler))
        addr = f"{server.get_addrs()[0]}"
        if "/p2p/" not in addr:
            addr += f"/p2p/{server.get_id()}"
        await dial(client, parse_peer_addr(addr), timeout_s=30)
        yield server, client


async def test_rpc_maps_each_failure_to_one_error(hosts: tuple[Any, Any]) -> None:
    from libp2p import generate_new_ed25519_identity
    from libp2p.peer.id import ID

    server, client = hosts
    peer = str(server.get_id())
    assert rpc.connected(client, peer)

    reply = await rpc.call(client, peer, ECHO, {"n": 7}, timeout_s=30)
    assert reply == {"echo": {"n": 7}}

    with pytest.raises(StreamReset):  # connected, but nobody serves the protocol
        await rpc.call(client, peer, "/test/nobody/1", {}, timeout_s=30)
    with pytest.raises(ConnectTimeout):  # the handler never answers
        await rpc.call(client, peer, SILENT, {}, timeout_s=1.0)
    with pytest.raises(RemoteProtocolError):  # the reply is over the cap
        await rpc.call(client, peer, HUGE, {}, timeout_s=30, max_reply_bytes=1024)

    stranger = str(ID.from_pubkey(generate_new_ed25519_identity().public_key))
    with pytest.raises(PeerUnreachable):  # no connection and no address to dial
        await rpc.call(client, stranger, ECHO, {}, timeout_s=30)

    # a failed call leaves the connection serving the next one
    assert await rpc.call(client, peer, ECHO, {"n": 8}, timeout_s=30) == {"echo": {"n": 8}}
