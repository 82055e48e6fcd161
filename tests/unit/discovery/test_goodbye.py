"""The goodbye record survives a stream that lands on a dead connection.

Seen in CI: a node frozen (SIGSTOP), resumed and re-admitted, then stopped at once,
said goodbye over a connection its peer had closed while it was frozen; the one
push failed, the peer never heard it and judged the node dead 1.5 s later instead
of 'left'. The host here is a stand-in (pure logic: which tries happen); the
record pushed is the node's real goodbye, read back as the peer would.
"""

from __future__ import annotations

from typing import Any

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from hetmesh.discovery import wire
from hetmesh.discovery.service import GOODBYE_TRIES, Discovery, DiscoveryConfig


class _Stream:
    def __init__(self) -> None:
        self.written = b""

    async def write(self, data: bytes) -> None:
        self.written += data

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


class _Network:
    def __init__(self, peer: ID) -> None:
        self.connections = {peer: ["a connection"]}


class _Host:
    """Its first ``dead`` streams fail as on a connection the peer closed."""

    def __init__(self, own: str, peer: ID, dead: int) -> None:
        self.own, self.dead, self.tries = own, dead, 0
        self.network = _Network(peer)
        self.streams: list[_Stream] = []

    def get_id(self) -> str:
        return self.own

    def get_network(self) -> _Network:
        return self.network

    async def new_stream(self, peer: ID, protocols: Any) -> _Stream:
        self.tries += 1
        if self.tries <= self.dead:
            raise ConnectionResetError("the connection was closed by the peer")
        stream = _Stream()
        self.streams.append(stream)
        return stream


def _peer_id() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


async def _goodbye(dead: int) -> tuple[Discovery, _Host]:
    peer = _peer_id()
    host = _Host(str(_peer_id()), peer, dead)
    discovery = Discovery(host, DiscoveryConfig(), psk="00" * 32)
    payload = wire.encode(discovery.local_record(goodbye=True))
    await discovery._send_record(peer.to_base58(), ("/ip4/127.0.0.1/tcp/4001",), payload)
    return discovery, host


async def test_a_goodbye_on_a_dead_connection_goes_again_and_arrives() -> None:
    discovery, host = await _goodbye(dead=GOODBYE_TRIES - 1)
    assert host.tries == GOODBYE_TRIES
    (stream,) = host.streams
    record = wire.decode_announcement(stream.written[4:])
    assert record.goodbye and record.peer_id == host.own
    stats = discovery.statistics()
    assert (stats.announcements_sent, stats.send_failures) == (1, 0)


async def test_a_goodbye_that_never_gets_through_is_counted_once_and_bounded() -> None:
    discovery, host = await _goodbye(dead=GOODBYE_TRIES + 5)
    assert host.tries == GOODBYE_TRIES
    assert not host.streams
    assert discovery.statistics().send_failures == 1
