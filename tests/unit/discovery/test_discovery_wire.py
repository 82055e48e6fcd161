"""Announcement records: round trips, mixed versions, and hostile bytes."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetmesh.discovery import wire
from hetmesh.discovery.service import Discovery, DiscoveryConfig
from hetmesh.discovery.wire import Announcement, KnownPeer, Load
from hetmesh.errors import RemoteProtocolError, StreamReset
from hetmesh.resources import DeviceProfile, LinkProfile


def full_record(peer: str = "B", seq: int = 1) -> Announcement:
    cpu = DeviceProfile(
        peer_id=peer,
        device="cpu",
        backend="cpu",
        name="x86",
        memory_total_bytes=8 << 30,
        memory_free_bytes=4 << 30,
        matmul_flops=1e11,
        memory_bandwidth_bps=2e10,
    )
    return Announcement(
        version="0.1.0",
        peer_id=peer,
        boot_id=123,
        seq=seq,
        addrs=(f"/ip4/10.0.0.2/tcp/4001/p2p/{peer}",),
        devices=(cpu,),
        links=(LinkProfile(src=peer, dst="C", rtt_s=1e-4, bandwidth_bps=1e9, measured_at_s=5.0),),
        data_plane={"tcp": {"host": "10.0.0.2", "port": 5000}},
        stages=({"model": "m", "start": 0, "end": 4, "ready": True},),
        load=Load(
            queue_depth=1,
            active_sessions=2,
            kv_bytes_used=3,
            kv_bytes_free=4,
            recent_step_s=(0.01, 0.02),
        ),
        known_peers=(KnownPeer(peer_id="C", addrs=("/ip4/10.0.0.3/tcp/4001/p2p/C",)),),
        probe_port=5001,
        extra={"plan": {"epoch": 3}},
    )


def test_wire_round_trip_keeps_every_field() -> None:
    record = full_record()
    assert wire.decode_announcement(wire.encode(record)) == record


def test_wire_unknown_fields_are_ignored() -> None:
    data = full_record().to_wire()
    data["from_the_future"] = {"x": [1, 2]}
    data["devices"][0]["new_metric"] = 1.5
    assert wire.decode_announcement(msgpack.packb(data)) == full_record()


def test_wire_optional_fields_may_be_missing() -> None:
    data = {"version": "0", "peer_id": "B", "boot_id": 1, "seq": 1, "addrs": []}
    record = wire.decode_announcement(msgpack.packb(data))
    assert record.devices == ()
    assert record.load == Load()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"seq": "1"}, "mistyped"),
        ({"seq": -1}, "negative"),
        ({"peer_id": None}, "missing id"),
        ({"devices": [{"peer_id": "B"}]}, "incomplete device"),
        ({"devices": [{**full_record().devices[0].to_wire(), "matmul_flops": -1.0}]}, "bad value"),
        ({"load": {"queue_depth": 1.5}}, "mistyped load"),
        ({"addrs": "not-a-list"}, "mistyped addrs"),
    ],
)
def test_wire_malformed_records_are_rejected(change: dict[str, Any], why: str) -> None:
    data = {**full_record().to_wire(), **change}
    with pytest.raises(RemoteProtocolError):
        wire.decode_announcement(msgpack.packb(data))


def test_wire_rejects_oversized_and_non_map_payloads() -> None:
    with pytest.raises(RemoteProtocolError):
        wire.decode_announcement(b"\x00" * (wire.MAX_ANNOUNCEMENT_BYTES + 1))
    with pytest.raises(RemoteProtocolError):
        wire.decode_announcement(msgpack.packb([1, 2, 3]))
    with pytest.raises(RemoteProtocolError):
        wire.decode_announcement(b"\xc1")  # never-used msgpack byte


@given(st.binary(max_size=512))
def test_wire_random_bytes_parse_or_raise_protocol_error(payload: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        wire.decode_announcement(payload)


@given(st.data())
def test_wire_mutated_records_parse_or_raise_protocol_error(data: st.DataObject) -> None:
    raw = bytearray(wire.encode(full_record()))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    with contextlib.suppress(RemoteProtocolError):
        wire.decode_announcement(bytes(raw[:cut]))


class _Stream:
    def __init__(self, data: bytes, chunk: int) -> None:
        self.data = data
        self.chunk = chunk

    async def read(self, n: int | None = None) -> bytes:
        take = min(self.chunk, n or self.chunk)
        out, self.data = self.data[:take], self.data[take:]
        return out

    async def write(self, data: bytes) -> None:
        self.data += data


async def test_wire_frames_survive_one_byte_reads() -> None:
    payload = wire.encode(full_record())
    stream = _Stream(b"", 1)
    await wire.write_frame(stream, payload)
    assert await wire.read_frame(stream, max_bytes=1 << 20, timeout_s=5) == payload


async def test_wire_frame_over_the_cap_is_refused_before_reading() -> None:
    stream = _Stream(struct.pack(">I", 1 << 30), 1 << 20)
    with pytest.raises(RemoteProtocolError):
        await wire.read_frame(stream, max_bytes=1 << 20, timeout_s=5)


async def test_wire_truncated_frame_is_a_stream_reset() -> None:
    stream = _Stream(struct.pack(">I", 100) + b"abc", 1 << 20)
    with pytest.raises(StreamReset):
        await wire.read_frame(stream, max_bytes=1 << 20, timeout_s=5)


class _FakeHost:
    def get_id(self) -> str:
        return "A"


def _discovery() -> Discovery:
    return Discovery(_FakeHost(), DiscoveryConfig(), psk="00" * 32)


@st.composite
def hostile_records(draw: st.DrawFn) -> bytes:
    base: dict[str, Any] = full_record().to_wire()
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=20),
    )
    value = st.recursive(
        leaf,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=20,
    )
    for key in draw(st.lists(st.sampled_from(sorted(base)), max_size=4)):
        if draw(st.booleans()):
            base.pop(key, None)
        else:
            base[key] = draw(value)
    packed: bytes = msgpack.packb(base)
    return packed


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(hostile_records(), st.binary(max_size=300)))
def test_discovery_receive_never_raises_and_counts_rejections(payload: bytes) -> None:
    disc = _discovery()
    result = disc.receive(payload, remote="B", now=1.0)
    stats = disc.statistics()
    if result is None:
        assert stats.rejected == 1
        assert disc.members() == []
    else:
        assert stats.accepted == 1
        assert stats.rejected == 0


def test_discovery_receive_rejects_impersonation() -> None:
    disc = _discovery()
    assert disc.receive(wire.encode(full_record("B")), remote="C", now=0.0) is None
    assert disc.statistics().rejected == 1
    assert disc.members() == []


def test_discovery_receive_learns_peers_by_exchange() -> None:
    disc = _discovery()
    disc.receive(wire.encode(full_record("B")), remote="B", now=0.0)
    assert [e.peer_id for e in disc.members()] == ["B"]
    assert "C" in disc.table.entries  # a candidate to dial, not yet a member
    assert disc.table.entries["C"].record is None


async def test_discovery_view_lists_self_peers_and_links() -> None:
    disc = _discovery()
    disc.receive(wire.encode(full_record("B")), remote="B", now=trio.current_time())
    view = disc.view()
    assert [p["peer_id"] for p in view["peers"]] == ["A", "B"]
    assert view["peers"][1]["health"] == "alive"
    assert view["links"][0]["src"] == "B"
    msgpack.packb(view)  # the view travels as msgpack
