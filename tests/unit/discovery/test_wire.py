"""Announcement records: round trips, mixed versions, and hostile bytes."""

from __future__ import annotations

import contextlib
import math
import os
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import trio

from hetmesh.discovery import wire
from hetmesh.discovery.service import Discovery, DiscoveryConfig
from hetmesh.discovery.wire import Announcement, KnownPeer, Load
from hetmesh.errors import RemoteProtocolError, StreamReset
from hetmesh.resources import DeviceProfile, LinkProfile

# Every fuzz test runs >= 10,000 examples (HETMESH_FUZZ_EXAMPLES shortens a local run);
FUZZ_EXAMPLES = int(os.environ.get("HETMESH_FUZZ_EXAMPLES", "10000"))


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


def _fuzz(name: str, check: Callable[[int], None]) -> None:
    """``check(seed)`` for FUZZ_EXAMPLES seeds, each drawing its input from
    ``random.Random(seed)`` in plain Python (Hypothesis drawing an example cost more
    than the decoder under test); the seeds start somewhere new each run, and a
    failure names its seed, which rebuilds the input exactly."""
    first = random.SystemRandom().randrange(2**48)
    for seed in range(first, first + FUZZ_EXAMPLES):
        try:
            check(seed)
        except Exception as exc:
            raise AssertionError(f"{name}: seed {seed}: {exc!r}") from exc


def _random_bytes(seed: int, most: int) -> bytes:
    rng = random.Random(seed)
    return rng.randbytes(rng.randint(0, most))


def test_wire_random_bytes_parse_or_raise_protocol_error() -> None:
    def check(seed: int) -> None:
        with contextlib.suppress(RemoteProtocolError):
            wire.decode_announcement(_random_bytes(seed, 512))

    _fuzz("random bytes", check)


_ENCODED = wire.encode(full_record())


def _mutated_record(seed: int) -> bytes:
    rng = random.Random(seed)
    raw = bytearray(_ENCODED)
    for _ in range(rng.randint(1, 8)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    cut = rng.randint(1, len(raw))
    return bytes(raw[:cut])


def test_wire_mutated_records_parse_or_raise_protocol_error() -> None:
    def check(seed: int) -> None:
        with contextlib.suppress(RemoteProtocolError):
            wire.decode_announcement(_mutated_record(seed))

    _fuzz("mutated record", check)


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


_TEXT = "aZ0_-./:é\u2603\x00"  # ascii, accents, a snowman, NUL


def _hostile_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value: scalars of every type, edge values, nested containers."""
    kind = rng.randrange(8 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randint(-(2**40), 2**40)])
    if kind == 3:
        return rng.choice([0.0, -0.0, math.inf, -math.inf, math.nan, 1e308, rng.uniform(-1e6, 1e6)])
    if kind == 4:
        return "".join(rng.choice(_TEXT) for _ in range(rng.randrange(20)))
    if kind == 5:
        return rng.randbytes(rng.randrange(20))
    if kind == 6:
        return [_hostile_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        _hostile_value(rng, 2) if rng.random() < 0.2 else f"k{i}": _hostile_value(rng, depth + 1)
        for i in range(rng.randrange(4))
    }


_FULL = full_record().to_wire()


def hostile_record(seed: int) -> bytes:
    """A full record with up to four fields dropped or replaced by hostile values.

    Built from one drawn seed in plain Python: drawing each value through
    Hypothesis cost ~4 ms an example, too slow for 10,000 of them.
    """
    rng = random.Random(seed)
    record: dict[Any, Any] = dict(_FULL)
    for key in rng.sample(sorted(_FULL), rng.randrange(5)):
        if rng.random() < 0.5:
            del record[key]
        else:
            record[key] = _hostile_value(rng)
    packed: bytes = msgpack.packb(record)
    return packed


@pytest.mark.slow  # 10,000 examples: a few CPU-s, more on a loaded machine
def test_discovery_receive_never_raises_and_counts_rejections() -> None:
    """Half the payloads hostile records, half random bytes."""

    def check(seed: int) -> None:
        payload = hostile_record(seed) if seed % 2 else _random_bytes(seed, 300)
        disc = _discovery()
        result = disc.receive(payload, remote="B", now=1.0)
        stats = disc.statistics()
        if result is None:
            assert stats.rejected == 1
            assert disc.members() == []
        else:
            assert stats.accepted == 1
            assert stats.rejected == 0

    _fuzz("receive", check)


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


def test_wire_drops_devices_and_links_of_other_peers() -> None:
    mine = full_record("B")
    theirs = full_record("C")
    forged = Announcement.from_wire(
        {
            **mine.to_wire(),
            # B describes C's hardware and a link from C: neither is B's to announce
            "devices": [d.to_wire() for d in mine.devices + theirs.devices],
            "links": [link.to_wire() for link in mine.links + theirs.links]
            + [LinkProfile(src="B", dst="B", rtt_s=0.0, bandwidth_bps=1e14).to_wire()],
        }
    )
    assert forged.devices == mine.devices
    assert forged.links == mine.links
    got = wire.decode_announcement(wire.encode(forged))
    assert [d.peer_id for d in got.devices] == ["B"]
    assert [(link.src, link.dst) for link in got.links] == [("B", "C")]


@pytest.mark.parametrize(
    "change",
    [
        {"devices": [{**full_record().devices[0].to_wire(), "matmul_flops": float("nan")}]},
        {"devices": [{**full_record().devices[0].to_wire(), "matmul_flops": 1e30}]},
        {"links": [{**full_record().links[0].to_wire(), "rtt_s": float("inf")}]},
        {"sent_at_s": float("nan")},
        {"load": {"recent_step_s": [float("inf")]}},
        {"addrs": ["/ip4/1.2.3.4/tcp/1"] * 65},
        {"devices": [full_record().devices[0].to_wire()] * 65},
    ],
    ids=["nan-flops", "absurd-flops", "inf-rtt", "nan-clock", "inf-step", "addrs", "devices"],
)
def test_wire_refuses_non_finite_absurd_or_too_many_values(change: dict[str, Any]) -> None:
    payload = msgpack.packb({**full_record().to_wire(), **change}, use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        wire.decode_announcement(payload)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
async def test_wire_frame_reader_gives_each_message_whatever_the_pieces(chunk: int) -> None:
    """Messages arriving in pieces of any size, several in one piece or one across many,
    come out whole and in order; a reader takes each piece in one read."""
    payloads = [wire.encode({"i": i, "text": "x" * (i * 37 % 300)}) for i in range(12)]
    stream = _Stream(b"", chunk)
    for payload in payloads:
        await wire.write_frame(stream, payload)
    total = len(stream.data)
    reads = 0
    real_read = stream.read

    async def counted(n: int | None = None) -> bytes:
        nonlocal reads
        reads += 1
        return await real_read(n)

    stream.read = counted  # type: ignore[method-assign]
    reader = wire.FrameReader(stream)
    got = [await reader.read_frame(max_bytes=1 << 20, timeout_s=5) for _ in payloads]
    assert got == payloads
    assert reads == -(-total // chunk)  # every piece read once, none read twice


async def test_wire_frame_reader_refuses_a_frame_over_the_cap_before_its_body() -> None:
    stream = _Stream(struct.pack(">I", 1 << 30) + b"abc", 1 << 20)
    with pytest.raises(RemoteProtocolError):
        await wire.FrameReader(stream).read_frame(max_bytes=1 << 20, timeout_s=5)


async def test_wire_frame_reader_a_stream_ending_mid_frame_is_a_reset() -> None:
    stream = _Stream(struct.pack(">I", 5) + b"hello" + struct.pack(">I", 100) + b"abc", 4)
    reader = wire.FrameReader(stream)
    assert await reader.read_frame(max_bytes=1 << 20, timeout_s=5) == b"hello"
    with pytest.raises(StreamReset):
        await reader.read_frame(max_bytes=1 << 20, timeout_s=5)
