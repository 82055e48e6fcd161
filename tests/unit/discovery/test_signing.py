"""Records signed by their origin, verified when relayed; the node's record versions;
the link-probe sample. Real libp2p keys, no sockets."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from hetmesh.discovery import wire
from hetmesh.discovery.membership import Kind, Message, Update
from hetmesh.discovery.membership_wire import decode_message, encode_message
from hetmesh.discovery.service import Discovery, DiscoveryConfig
from hetmesh.discovery.signing import open_record, sign_record
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import Announcement, Load
from hetmesh.errors import RemoteProtocolError
from hetmesh.resources import DeviceProfile


class _Peer:
    def __init__(self) -> None:
        self.keys = create_new_key_pair()
        self.id = ID.from_pubkey(self.keys.public_key).to_base58()

    def record(self, seq: int = 1, **changes: Any) -> Announcement:
        base = Announcement(
            version="0",
            peer_id=self.id,
            boot_id=7,
            seq=seq,
            addrs=(f"/ip4/10.0.0.9/tcp/1/p2p/{self.id}",),
        )
        return dataclasses.replace(base, **changes)

    def signed(self, record: Announcement) -> tuple[bytes, bytes]:
        blob = wire.encode(record)
        return blob, sign_record(self.keys.private_key, blob)


class _Host:
    def __init__(self, peer: _Peer) -> None:
        self.peer = peer

    def get_id(self) -> str:
        return self.peer.id

    def get_private_key(self) -> Any:
        return self.peer.keys.private_key


def _device(peer_id: str) -> DeviceProfile:
    return DeviceProfile(
        peer_id=peer_id,
        device="cpu",
        backend="cpu",
        name="x86",
        memory_total_bytes=8 << 30,
        memory_free_bytes=4 << 30,
        matmul_flops=1e11,
        memory_bandwidth_bps=2e10,
    )


def test_signing_origin_record_opens_and_any_change_is_refused() -> None:
    b = _Peer()
    blob, signature = b.signed(b.record(stages=({"model": "m", "start": 0, "end": 4},)))
    assert open_record(blob, signature).peer_id == b.id
    forged = wire.encode(b.record(stages=({"model": "m", "start": 0, "end": 30},)))
    with pytest.raises(RemoteProtocolError, match="signature"):
        open_record(forged, signature)
    with pytest.raises(RemoteProtocolError, match="signature"):
        open_record(blob, b"")


def test_signing_a_member_cannot_sign_for_another() -> None:
    b, c = _Peer(), _Peer()
    blob = wire.encode(b.record())
    with pytest.raises(RemoteProtocolError, match="signature"):
        open_record(blob, sign_record(c.keys.private_key, blob))


def test_signing_record_naming_another_peers_device_is_refused() -> None:
    b, c = _Peer(), _Peer()
    blob, signature = b.signed(b.record(devices=(_device(b.id), _device(c.id))))
    with pytest.raises(RemoteProtocolError, match="another peer's device"):
        open_record(blob, signature)


def test_signing_signed_record_survives_the_membership_codec() -> None:
    b = _Peer()
    blob, signature = b.signed(b.record())
    msg = Message(
        Kind.RECORD, "C", "A", 1, 0, 0, target=b.id, record_blob=blob, signature=signature
    )
    got = decode_message(encode_message(msg))
    assert (got.record_blob, got.signature, got.record) == (blob, signature, b.record())


def _relayed(via: _Peer, to: _Peer, blob: bytes, signature: bytes, subject: str) -> bytes:
    msg = Message(
        Kind.RECORD,
        via.id,
        to.id,
        3,
        0,
        0,
        target=subject,
        record=wire.decode_announcement(blob),
        record_blob=blob,
        signature=signature,
    )
    return encode_message(msg)


def _rumor(via: _Peer, to: _Peer, subject: _Peer, seq: int) -> bytes:
    update = Update(subject.id, Health.ALIVE, 7, 0, seq, ())
    return encode_message(Message(Kind.GOSSIP, via.id, to.id, 3, 0, 0, updates=(update,)))


def test_discovery_accepts_a_relayed_record_only_as_its_origin_signed_it() -> None:
    a, b, c = _Peer(), _Peer(), _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(), psk="00" * 32)
    # c tells a of b's record version 1, a pulls it from c, c relays b's signed record
    disc.receive_message(_rumor(c, a, b, 1), c.id, now=0.0)
    blob, signature = b.signed(b.record(seq=1))
    disc.receive_message(_relayed(c, a, blob, signature, b.id), c.id, now=0.1)
    entry = disc.table.entries[b.id]
    assert entry.record is not None
    assert entry.record.seq == 1
    assert disc.statistics().rejected == 0

    # version 2, altered by c on the way: refused, version 1 kept
    disc.receive_message(_rumor(c, a, b, 2), c.id, now=0.2)
    _, signature2 = b.signed(b.record(seq=2))
    forged = wire.encode(b.record(seq=2, stages=({"model": "m", "start": 0, "end": 99},)))
    disc.receive_message(_relayed(c, a, forged, signature2, b.id), c.id, now=0.3)
    assert disc.statistics().rejected == 1
    assert entry.record.seq == 1

    # an unsigned relay is refused too
    unsigned = Message(Kind.RECORD, c.id, a.id, 3, 0, 0, target=b.id, record=b.record(seq=2))
    disc.receive_message(encode_message(unsigned), c.id, now=0.4)
    assert disc.statistics().rejected == 2
    assert entry.record.seq == 1


def test_discovery_refuses_a_message_whose_sender_is_not_the_connection() -> None:
    a, b, c = _Peer(), _Peer(), _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(), psk="00" * 32)
    disc.receive_message(_rumor(b, a, c, 1), c.id, now=0.0)  # claims b, arrives from c
    assert disc.statistics().rejected == 1
    assert b.id not in disc.table.entries


async def test_discovery_record_versions_on_change_and_load_at_most_every_2s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(load_publish_every_s=2.0), psk="00" * 32)
    first = disc.local_record()
    assert disc.local_record().seq == first.seq  # nothing changed: no new version
    disc.set_load(Load(queue_depth=1))
    assert disc.local_record().seq == first.seq  # load alone: not within 2 s of the last
    disc.set_stages([{"model": "m", "start": 0, "end": 4}])
    changed = disc.local_record()
    assert changed.seq == first.seq + 1  # a real change is published at once, load with it
    assert changed.load.queue_depth == 1
    disc.set_load(Load(queue_depth=3))
    assert disc.local_record().seq == changed.seq
    await trio.sleep(2.5)
    later = disc.local_record()
    assert later.seq == changed.seq + 1
    assert later.load.queue_depth == 3
    assert disc.local_record().seq == later.seq


async def test_discovery_counters_alone_wait_for_the_loads_turn_and_ride_with_any_change(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Counters set again and again version the record at most every
    ``load_publish_every_s``; a content change publishes at once with the latest
    counters; the node's own view shows them at once; a key moved between the two
    kinds is announced once, as the last setter said."""
    a = _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(load_publish_every_s=2.0), psk="00" * 32)
    disc.set_counters("stage_servers", [{"steps": 0}])
    first = disc.local_record()
    assert first.extra["stage_servers"] == [{"steps": 0}]
    for step in range(1, 11):  # a token every 0.1 s for a second: no new version
        disc.set_counters("stage_servers", [{"steps": step}])
        assert disc.local_record().seq == first.seq
        await trio.sleep(0.1)
    assert disc.local_record(advance=False).extra["stage_servers"] == [{"steps": 10}]
    disc.set_extra("plan", {"epoch": 1})  # content: at once, the counters with it
    changed = disc.local_record()
    assert changed.seq == first.seq + 1
    assert changed.extra["stage_servers"] == [{"steps": 10}]
    disc.set_counters("stage_servers", [{"steps": 11}])
    assert disc.local_record().seq == changed.seq
    await trio.sleep(2.5)
    later = disc.local_record()
    assert later.seq == changed.seq + 1  # their turn came
    assert later.extra["stage_servers"] == [{"steps": 11}]
    assert disc.local_record().seq == later.seq  # unchanged since: nothing more
    disc.set_counters("plan", {"epoch": 2})  # a key moves kind: one value, the last
    disc.set_extra("stage_servers", [])
    moved = disc.local_record()
    assert moved.seq == later.seq + 1
    assert moved.extra["plan"] == {"epoch": 2}
    assert moved.extra["stage_servers"] == []


async def test_discovery_record_is_encoded_to_compare_only_when_what_it_is_built_from_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tick with nothing set encodes nothing; an equal value set again is encoded
    and compared (no new version); another value is published."""
    a = _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(), psk="00" * 32)
    disc.set_extra("plan", {"epoch": 1})
    first = disc.local_record()
    encoded = []
    real = Announcement.to_wire

    def counting(self: Announcement) -> dict[str, Any]:
        encoded.append(1)
        return real(self)

    monkeypatch.setattr(Announcement, "to_wire", counting)
    for _ in range(5):
        assert disc.local_record().seq == first.seq
    assert encoded == []
    disc.set_extra("plan", {"epoch": 1})  # a new object, equal: compared, not published
    assert disc.local_record().seq == first.seq
    disc.set_extra("plan", {"epoch": 2})
    changed = disc.local_record()
    assert changed.seq == first.seq + 1
    assert changed.extra["plan"] == {"epoch": 2}
    disc.set_stages([{"model": "m", "start": 0, "end": 4}])
    assert disc.local_record().seq == first.seq + 2


def test_discovery_probes_a_bounded_sample_plus_the_links_asked_for() -> None:
    a = _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(link_neighbours=4), psk="00" * 32)
    peers = [_Peer() for _ in range(12)]
    for p in peers:
        assert disc.receive(wire.encode(p.record()), p.id, now=0.0) is not None
    targets = {e.peer_id for e in disc.link_targets()}
    assert len(targets) == 4
    assert targets < {p.id for p in peers}
    outside = next(p.id for p in peers if p.id not in targets)
    disc.want_links([outside])
    assert {e.peer_id for e in disc.link_targets()} == targets | {outside}


def test_discovery_checks_a_record_it_holds_already_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gossip brings the same signed bytes many times: they are decoded and verified
    once; other bytes under the same signature are still checked (and refused)."""
    import hetmesh.discovery.service as service

    opened: list[bytes] = []
    real = service.open_record

    def counting(blob: bytes, signature: bytes) -> Announcement:
        opened.append(blob)
        return real(blob, signature)

    monkeypatch.setattr(service, "open_record", counting)
    a, b, c = _Peer(), _Peer(), _Peer()
    disc = Discovery(_Host(a), DiscoveryConfig(), psk="00" * 32)
    disc.receive_message(_rumor(c, a, b, 1), c.id, now=0.0)
    blob, signature = b.signed(b.record(seq=1))
    for i in range(3):
        disc.receive_message(_relayed(c, a, blob, signature, b.id), c.id, now=0.1 + i / 10)
    assert opened == [blob]
    entry = disc.table.entries[b.id]
    assert entry.record is not None
    assert entry.record.seq == 1
    forged = wire.encode(b.record(seq=1, stages=({"model": "m", "start": 0, "end": 99},)))
    disc.receive_message(_relayed(c, a, forged, signature, b.id), c.id, now=0.5)
    assert opened == [blob, forged]
    assert disc.statistics().rejected == 1
