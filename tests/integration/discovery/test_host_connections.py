"""A node keeps accepting clients however many came and went before (real hosts, TCP).

py-libp2p admits an inbound connection under a cap (250 by default) and, left
alone, holds its slot for the host's whole life; and a client host that stops
left its socket open. Both are fixed in ``hetmesh.discovery``: here the server's
cap is cut to 3 so that a dozen clients, one after another, would exhaust it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from hetmesh.discovery.host import derive_psk, dial, open_host, parse_peer_addr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # a few seconds; generous for load

PSK = derive_psk("connections-test")
LISTEN = ["/ip4/127.0.0.1/tcp/0"]
CAP = 3


def _address(host: Any) -> str:
    addr = f"{host.get_addrs()[0]}"
    return addr if "/p2p/" in addr else f"{addr}/p2p/{host.get_id()}"


def _open_connections(host: Any) -> int:
    return sum(len(conns) for conns in host.get_network().connections.values())


@pytest.fixture
async def server() -> AsyncIterator[Any]:
    from libp2p import generate_new_ed25519_identity

    async with open_host(generate_new_ed25519_identity(), psk=PSK, listen=LISTEN) as host:
        # the same limiter libp2p sizes from its connection config, smaller
        host.get_network()._inbound_limiter = trio.CapacityLimiter(CAP)
        yield host


async def _until(check: Any, what: str, timeout_s: float = 30.0) -> None:
    # the swarm's connection table has no event to wait on: read it every 50 ms
    with trio.move_on_after(timeout_s):
        while True:
            if check():
                return
            await trio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def test_clients_one_after_another_never_exhaust_the_inbound_cap(server: Any) -> None:
    from libp2p import generate_new_ed25519_identity

    target = parse_peer_addr(_address(server))
    for i in range(4 * CAP):
        async with open_host(generate_new_ed25519_identity(), psk=PSK, listen=LISTEN) as client:
            await dial(client, target, timeout_s=30)  # raised AuthenticationFailed at i == CAP
            assert _open_connections(client) == 1
            await _until(lambda: _open_connections(server) == 1, f"client {i} accepted")
        # the client's connection closed when it stopped, and the server let it go
        await _until(lambda: _open_connections(server) == 0, f"client {i}'s connection gone")
