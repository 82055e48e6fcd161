"""Host helpers: mesh keys, persistent identity, guarded handlers, addresses."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from hetmesh.discovery import host as mesh_host
from hetmesh.discovery.addrs import expand_listen_addrs


def test_host_psk_is_a_32_byte_hex_key_that_depends_on_the_secret() -> None:
    key = mesh_host.derive_psk("s3cret")
    assert len(key) == 64
    bytes.fromhex(key)
    assert key == mesh_host.derive_psk("s3cret")
    assert key != mesh_host.derive_psk("other")
    assert mesh_host.derive_psk(None) == mesh_host.derive_psk("")
    assert "s3cret" not in key


def test_host_mdns_fingerprint_fits_a_service_name_and_hides_the_key() -> None:
    tag = mesh_host.mesh_fingerprint("s3cret")
    assert len("p2p-" + tag) <= 15
    assert tag not in mesh_host.derive_psk("s3cret")
    assert tag != mesh_host.mesh_fingerprint("other")


def test_host_identity_persists_across_restarts(tmp_path: Path) -> None:
    from libp2p.peer.id import ID

    first = mesh_host.load_or_create_identity(tmp_path)
    again = mesh_host.load_or_create_identity(tmp_path)
    assert ID.from_pubkey(first.public_key) == ID.from_pubkey(again.public_key)
    other = mesh_host.load_or_create_identity(tmp_path / "elsewhere")
    assert ID.from_pubkey(first.public_key) != ID.from_pubkey(other.public_key)
    assert (tmp_path / mesh_host.IDENTITY_FILE).stat().st_mode & 0o077 == 0


class _Stream:
    def __init__(self) -> None:
        self.closed = False
        self.reset_called = False

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.reset_called = True


async def test_host_guarded_handler_swallows_errors_and_resets_the_stream() -> None:
    async def bad(_stream: object) -> None:
        raise ValueError("boom")

    stream = _Stream()
    await mesh_host.guarded_handler("bad", bad)(stream)
    assert stream.reset_called
    assert not stream.closed


async def test_host_guarded_handler_closes_after_success_and_lets_cancellation_through() -> None:
    async def good(_stream: object) -> None:
        return None

    stream = _Stream()
    await mesh_host.guarded_handler("good", good)(stream)
    assert stream.closed

    async def slow(_stream: object) -> None:
        await trio.sleep_forever()

    stream = _Stream()
    with trio.move_on_after(0.01) as scope:
        await mesh_host.guarded_handler("slow", slow)(stream)
    assert scope.cancelled_caught
    assert stream.reset_called


def test_host_parse_peer_addr_requires_a_peer_id() -> None:
    pid = "12D3KooWAg2qJFc8ygdSBb41X3YRKdFtF3aipuZb24fnBU3CxT7h"
    info = mesh_host.parse_peer_addr(f"/ip4/127.0.0.1/tcp/4001/p2p/{pid}")
    assert str(info.peer_id) == pid
    with pytest.raises(ValueError, match="PEER_ID"):
        mesh_host.parse_peer_addr("/ip4/127.0.0.1/tcp/4001")


def test_host_wildcard_listen_address_expands_to_dialable_ones() -> None:
    addrs = expand_listen_addrs(["/ip4/0.0.0.0/tcp/4001", "/ip4/10.1.2.3/tcp/5"], "PID")
    assert "/ip4/10.1.2.3/tcp/5/p2p/PID" in addrs
    assert all("0.0.0.0" not in a for a in addrs)
    assert all(a.endswith("/p2p/PID") for a in addrs)
    assert len(addrs) >= 2


def test_host_negotiates_a_stream_within_its_own_limit_or_the_dials() -> None:
    from libp2p import generate_new_ed25519_identity

    def limits(**kwargs: float) -> tuple[float, float, float]:
        host = mesh_host.new_mesh_host(generate_new_ed25519_identity(), psk="0" * 64, **kwargs)
        config = host.get_network().connection_config
        return (
            config.dial_timeout,
            config.outbound_stream_protocol_negotiation_timeout,
            config.inbound_stream_protocol_negotiation_timeout,
        )

    assert limits(dial_timeout_s=3.0) == (3.0, 3.0, 3.0)
    assert limits(dial_timeout_s=3.0, negotiate_timeout_s=60.0) == (3.0, 60.0, 60.0)
