"""A stranger's silent connections to the libp2p port take a bounded share of it."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio

from hetmesh.discovery.host import derive_psk, dial, open_host, parse_peer_addr
from hetmesh.discovery.inbound import MAX_PENDING_PER_ADDRESS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PSK = derive_psk("upgrade-gate-test")
LISTEN = ["/ip4/127.0.0.1/tcp/0"]


def _closed(sock: socket.socket) -> bool:
    """Whether the node closed ``sock`` (what it sent first, its nonce, is read off)."""
    try:
        while True:
            data = sock.recv(4096, socket.MSG_DONTWAIT)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


async def test_one_address_holds_a_few_upgrading_connections_and_a_member_still_joins() -> None:
    """Eight silent connections from 127.0.0.2 wait in the handshake; the ninth is
    closed at once, while the eight still wait (before the fix it waited as they did,
    up to libp2p's 250), and a member from another address connects meanwhile."""
    from libp2p import generate_new_ed25519_identity

    async with open_host(generate_new_ed25519_identity(), psk=PSK, listen=LISTEN) as server:
        addr = f"{server.get_addrs()[0]}"
        port = int(addr.split("/")[4])
        gate: Any = server.get_network().hetmesh_upgrade_gate
        silent = []
        try:
            for _ in range(MAX_PENDING_PER_ADDRESS):
                sock = socket.socket()
                sock.bind(("127.0.0.2", 0))
                sock.connect(("127.0.0.1", port))
                silent.append(sock)
            with trio.fail_after(30):
                while gate.statistics().pending < MAX_PENDING_PER_ADDRESS:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            extra = socket.socket()
            extra.bind(("127.0.0.2", 0))
            extra.connect(("127.0.0.1", port))
            silent.append(extra)
            with trio.fail_after(30):
                while not _closed(extra):  # noqa: ASYNC110 - the node's own task closes it
                    await trio.sleep(0.02)
            assert not any(_closed(s) for s in silent[:-1])  # the eight still wait
            assert gate.statistics().refused == 1
            target = parse_peer_addr(f"{addr}/p2p/{server.get_id()}")
            async with open_host(generate_new_ed25519_identity(), psk=PSK, listen=LISTEN) as member:
                await dial(member, target, timeout_s=20)
                assert server.get_id() in member.get_network().connections
        finally:
            for sock in silent:
                sock.close()
