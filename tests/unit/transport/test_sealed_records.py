"""The sealed record format, checked against an independent AES-GCM: what goes on the wire
is exactly ``length | AESGCM(key).encrypt(nonce k, plaintext)`` for the k-th record."""

from __future__ import annotations

import itertools
import random
import socket
import struct
import threading
from typing import Any

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hetmesh.errors import LocalProtocolError, RemoteProtocolError, StreamReset
from hetmesh.transport import Activations
from hetmesh.transport.codec import BufferPool
from hetmesh.transport.frames import DEFAULT_LIMITS, encode_bytes, encode_parts
from hetmesh.transport.links import BufferedReader, SealedReader
from hetmesh.transport.sealed import (
    RECORD_BYTES,
    SMALL_BYTES,
    OpenedSocket,
    Sealer,
)

KEY = bytes(range(32))


def _nonce(k: int) -> bytes:
    return bytes(4) + k.to_bytes(8, "big")


def _records(data: bytes) -> list[bytes]:
    out = []
    while data:
        (length,) = struct.unpack(">I", data[:4])
        out.append(data[4 : 4 + length])
        data = data[4 + length :]
    return out


def test_a_small_frame_is_sealed_as_one_independent_aes_gcm_record() -> None:
    """The fast path copies parts of every kind (bytes, arrays of any dtype and shape,
    zeros in a shape, 0-d) to where their ciphertext goes and seals them in place."""
    parts = [
        b"head bytes",
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.zeros((0, 3), dtype=np.float32),
        np.array(7, dtype=np.int64),
        torch.ones(5, dtype=torch.bfloat16).view(torch.int16).numpy(),
        memoryview(b"tail"),
    ]
    plain = b"".join(memoryview(p).tobytes() if not isinstance(p, bytes) else p for p in parts)
    sealer = Sealer(KEY)
    first = bytes(sealer.seal(parts))
    second = bytes(sealer.seal(parts, len(plain)))
    aead = AESGCM(KEY)
    assert _records(first) == [aead.encrypt(_nonce(0), plain, None)]
    assert _records(second) == [aead.encrypt(_nonce(1), plain, None)]


def test_a_large_frame_is_sealed_as_independent_records_in_order() -> None:
    head = b"h" * 40
    payload = np.frombuffer(bytes(range(256)) * ((RECORD_BYTES + 1000) // 256), np.uint8)
    sealed = bytes(Sealer(KEY).seal([head, payload]))
    aead = AESGCM(KEY)
    data = payload.tobytes()
    expected = [head, data[:RECORD_BYTES], data[RECORD_BYTES:]]
    assert _records(sealed) == [aead.encrypt(_nonce(k), p, None) for k, p in enumerate(expected)]


@pytest.mark.parametrize("declared", [9, 7, 3, RECORD_BYTES + 1])
def test_a_declared_size_that_does_not_match_the_parts_is_refused(declared: int) -> None:
    with pytest.raises(LocalProtocolError, match=f"parts of 8 bytes, not {declared}"):
        Sealer(KEY).seal([b"1234", b"5678"], declared)


READERS = ["link reader", "link reader, polling", "plain reader over OpenedSocket"]


def _reader(kind: str, sock: socket.socket) -> BufferedReader:
    """A sealed link's reader (:class:`SealedReader`, as ``TcpLink.seal`` makes it, or
    polling as a blocking link's does), or a plain one reading through an OpenedSocket."""
    if kind == "plain reader over OpenedSocket":
        reader = BufferedReader(sock, DEFAULT_LIMITS, BufferPool())
        reader._sock = OpenedSocket(sock, KEY)  # type: ignore[assignment]
        return reader
    reader = SealedReader(sock, KEY, DEFAULT_LIMITS, BufferPool())
    reader.spin_ns = 50_000 if kind.endswith("polling") else 0
    return reader


def _frames(sizes: list[int]) -> list[Activations]:
    return [
        Activations(session_id="s", step=i, positions=(i,), tensors=(torch.randn(n),))
        for i, n in enumerate(sizes)
    ]


@pytest.mark.parametrize("kind", READERS)
def test_a_sealed_frame_reads_back_equal_through_the_link_reader(kind: str) -> None:
    """encode_parts -> seal -> socket -> the reader, frame by frame, small and over a
    record, with the record counter moving on across frames."""
    left, right = socket.socketpair()
    with left, right:
        sealer = Sealer(KEY)
        reader = _reader(kind, right)
        for frame in _frames([2048, 3, 2048, 300_000, 2048]):
            head, buffers, total = encode_parts(frame)
            data = bytes(sealer.seal([head, *buffers], total))
            assert encode_bytes(frame)[:64] not in data
            sender = threading.Thread(target=left.sendall, args=(data,))
            sender.start()  # over a socket buffer: send while we read
            got = reader.read_frame()
            sender.join()
            assert got == frame
        left.close()
        with pytest.raises(StreamReset):
            reader.read_frame()


def test_a_whole_record_alone_is_opened_by_the_link_readers_own_read() -> None:
    """A decode step's frame (one record, in the socket whole when read) is opened by the
    read itself: the OpenedSocket is not called and holds nothing after."""
    left, right = socket.socketpair()
    with left, right:
        sealer = Sealer(KEY)
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, BufferPool())
        calls = []
        opened = reader._opened
        opened.recv_into = lambda *a: calls.append(a) or 0  # type: ignore[method-assign]
        for frame in _frames([2048, 5, 2048]):
            head, buffers, total = encode_parts(frame)
            left.sendall(sealer.seal_frame(head, buffers, total))
            assert reader.read_frame() == frame
            assert opened.idle
        assert calls == []


def test_whole_records_of_many_sizes_open_alone_through_bounded_views() -> None:
    """open_alone keeps views per record size: records of more sizes than it keeps, each
    size twice and out of order, read back equal, and what it keeps stays bounded."""
    left, right = socket.socketpair()
    with left, right:
        sealer = Sealer(KEY)
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, BufferPool())
        sizes = [1 + 7 * i for i in range(80)]
        sizes = sizes + sizes[::-1]
        for frame in _frames(sizes):
            head, buffers, total = encode_parts(frame)
            left.sendall(sealer.seal_frame(head, buffers, total))
            assert reader.read_frame() == frame
            assert reader._opened.idle
            assert len(reader._opened._alone_views) <= 64
            assert len(reader._opened._layouts) <= 64


def test_open_alone_opens_into_the_target_it_is_given() -> None:
    """Two records of one size opened alone into two different targets: each lands in
    its own (the views kept for a size belong to one target)."""
    left, right = socket.socketpair()
    with left, right:
        sealer, opened = Sealer(KEY), OpenedSocket(right, KEY)
        targets = [memoryview(bytearray(64)), memoryview(bytearray(32))]
        for k, into in enumerate(targets):
            left.sendall(sealer.seal([bytes([k + 1]) * 20]))
            got = right.recv_into(opened.raw)
            assert opened.open_alone(got, into) == 20
            assert bytes(into[:20]) == bytes([k + 1]) * 20
        assert bytes(targets[0][:20]) == b"\x01" * 20


@pytest.mark.parametrize("kind", READERS)
def test_sealed_frames_read_back_whatever_the_chunking(kind: str) -> None:
    """Frames small and over a record, sent back to back in chunks cut anywhere (a record
    in parts, several in one read): every frame reads back equal, then EOF."""
    rng = random.Random(12)
    frames = _frames([2048, 3, 300_000, 2048, 7, 70_000, 2048])
    sealer = Sealer(KEY)
    wire = b""
    for frame in frames:
        head, buffers, total = encode_parts(frame)
        wire += bytes(sealer.seal_frame(head, buffers, total))
    cuts = sorted({0, len(wire), *(rng.randrange(len(wire)) for _ in range(30))})
    left, right = socket.socketpair()
    with left, right:

        def send() -> None:
            for a, b in itertools.pairwise(cuts):
                left.sendall(wire[a:b])
            left.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        reader = _reader(kind, right)
        got = [reader.read_frame() for _ in frames]
        with pytest.raises(StreamReset):
            reader.read_frame()
        sender.join()
    assert got == frames


def test_records_of_any_size_read_back_whatever_the_chunking() -> None:
    """Small and full-size records back to back, sent in chunks that cut lengths and
    records anywhere, read in pieces of random sizes: the plaintext comes back whole."""
    rng = random.Random(45)
    sealer = Sealer(KEY)
    plains = [rng.randbytes(n) for n in (5, RECORD_BYTES, 70, RECORD_BYTES - 3, 1, 4000)]
    wire = b"".join(bytes(sealer.seal([p])) for p in plains)
    cuts = sorted({0, len(wire), *(rng.randrange(len(wire)) for _ in range(40))})
    left, right = socket.socketpair()
    with left, right:

        def send() -> None:
            for a, b in itertools.pairwise(cuts):
                left.sendall(wire[a:b])

        sender = threading.Thread(target=send)
        sender.start()
        opened = OpenedSocket(right, KEY)
        want = b"".join(plains)
        out = bytearray(len(want))
        view = memoryview(out)
        got = 0
        while got < len(want):
            got += opened.recv_into(view[got : got + rng.choice((3, 600, 70_000, 3 << 20))])
        sender.join()
        assert out == want


def test_seal_frame_is_the_same_record_as_seal_of_the_same_parts() -> None:
    """The link's path (``seal_frame``: head and encode_parts' buffers) writes exactly
    ``seal([head, *buffers])``: one independent AES-GCM record per small frame, records
    over SMALL_BYTES as seal's, one nonce counter for both."""
    tensors = [
        (torch.randn(2048),),  # a decode step's 8 KiB
        (torch.zeros(0, 3), torch.arange(7, dtype=torch.int64)),
        (torch.ones(5, dtype=torch.bfloat16), torch.randn(3, 4)),
        (torch.randn(SMALL_BYTES // 4),),  # over SMALL_BYTES with its head: records
        (torch.zeros(0, 3),),  # one tensor with a zero in its shape
        (torch.randn(3, 4),),  # one tensor of two dimensions
        (torch.randn(2048),),  # the first size again: its kept views
    ]
    frames = [
        Activations(session_id="s", step=i, positions=(i,), tensors=t)
        for i, t in enumerate(tensors)
    ]
    fast, reference = Sealer(KEY), Sealer(KEY)
    aead = AESGCM(KEY)
    for k, frame in enumerate(frames):
        head, buffers, total = encode_parts(frame)
        got = bytes(fast.seal_frame(head, buffers, total))
        assert got == bytes(reference.seal([head, *buffers], total))
        if total <= SMALL_BYTES:
            assert _records(got) == [aead.encrypt(_nonce(2 * k), encode_bytes(frame), None)]
        assert bytes(fast.seal([b"between"])) == bytes(reference.seal([b"between"]))


@pytest.mark.parametrize(
    ("parts", "declared"),
    [
        ([b"head bytes", np.zeros(4, np.uint8)], 13),  # more than declared
        ([b"head bytes", np.zeros(4, np.uint8)], 15),  # less
        ([b"a long head", np.zeros(4, np.uint8)], 5),  # the head alone is more
        ([b"", np.zeros(0, np.uint8)], 0),  # nothing
        ([b"head", np.zeros((2, 3), np.float32)], 27),  # one 2-D part, a byte short
        ([b"head", np.zeros((0, 3), np.float32)], 5),  # one empty part, a byte more
        ([b"head", np.zeros(2, np.uint8), np.zeros(2, np.uint8)], 9),  # two parts, more
    ],
)
def test_seal_frame_refuses_parts_that_disagree_with_the_declared_size(
    parts: list[Any], declared: int
) -> None:
    sealer = Sealer(KEY)
    with pytest.raises(LocalProtocolError, match=f"not {declared}"):
        sealer.seal_frame(parts[0], parts[1:], declared)
    assert _records(bytes(sealer.seal([b"next"]))) == [
        AESGCM(KEY).encrypt(_nonce(0), b"next", None)
    ]


@pytest.mark.parametrize("attack", ["flip a bit", "flip a length bit", "replay", "drop", "swap"])
def test_records_arriving_one_at_a_time_refuse_tampering(attack: str) -> None:
    """Each record alone in the socket when read: the path a decode step's frame takes
    (opened straight into the reader's memory); every alteration is refused."""
    sealer = Sealer(KEY)
    records = [bytes(sealer.seal([f"record {i}".encode() * 50])) for i in range(3)]
    if attack == "flip a bit":
        records[1] = records[1][:-1] + bytes([records[1][-1] ^ 1])
    elif attack == "flip a length bit":
        shorter = int.from_bytes(records[1][:4], "big") ^ 0x20  # 416 -> 384 bytes
        records[1] = shorter.to_bytes(4, "big") + records[1][4:]
    elif attack == "replay":
        records[1] = records[0]
    elif attack == "drop":
        records = [records[0], records[2]]
    else:
        records = [records[0], records[2], records[1]]
    left, right = socket.socketpair()
    with left, right:
        opened = OpenedSocket(right, KEY)
        target = bytearray(4096)
        left.sendall(records[0])
        assert opened.recv_into(target) == len("record 0") * 50
        left.sendall(records[1])
        with pytest.raises(RemoteProtocolError):
            opened.recv_into(target)


@pytest.mark.parametrize("attack", ["flip a bit", "flip a length bit", "replay", "drop", "swap"])
def test_frames_arriving_one_at_a_time_refuse_tampering_in_the_link_reader(attack: str) -> None:
    """The link reader's own path (a frame's record whole in the socket when read, opened
    by the read): every alteration of the second frame's record is refused."""
    sealer = Sealer(KEY)
    records = []
    for frame in _frames([2048, 2048, 2048]):
        head, buffers, total = encode_parts(frame)
        records.append(bytes(sealer.seal_frame(head, buffers, total)))
    if attack == "flip a bit":
        records[1] = records[1][:-1] + bytes([records[1][-1] ^ 1])
    elif attack == "flip a length bit":
        length = int.from_bytes(records[1][:4], "big")
        shorter = length ^ (1 << (length.bit_length() - 1))  # a longer one only waits
        records[1] = shorter.to_bytes(4, "big") + records[1][4:]
    elif attack == "replay":
        records[1] = records[0]
    elif attack == "drop":
        records = [records[0], records[2]]
    else:
        records = [records[0], records[2], records[1]]
    left, right = socket.socketpair()
    with left, right:
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, BufferPool())
        left.sendall(records[0])
        assert reader.read_frame().step == 0
        left.sendall(records[1])
        with pytest.raises(RemoteProtocolError):
            reader.read_frame()


@pytest.mark.parametrize("n", [2048, 300_000, (5 * RECORD_BYTES) // 8 + 3])
def test_send_writes_exactly_the_records_seal_makes(n: int) -> None:
    """``Sealer.send`` (the link's blocking write: a large frame sealed and sent a
    record at a time through a standing window) puts on the wire exactly the bytes
    of ``seal`` of the same parts, frame after frame, and keeps no frame-sized buffer."""
    frames = [
        Activations(session_id="s", step=i, positions=(i,), tensors=(torch.randn(n),))
        for i in range(2)
    ]
    sender, reference = Sealer(KEY), Sealer(KEY)
    left, right = socket.socketpair()
    wire = bytearray()

    def drain() -> None:
        while chunk := right.recv(1 << 20):
            wire.extend(chunk)

    with left, right:
        reader = threading.Thread(target=drain)
        reader.start()
        expected = b""
        for frame in frames:
            head, buffers, total = encode_parts(frame)
            sender.send(left, head, buffers, total)
            expected += bytes(reference.seal([head, *buffers], total))
        left.shutdown(socket.SHUT_WR)
        reader.join()
    assert bytes(wire) == expected
    assert len(sender._small) == SMALL_BYTES + 20  # one record's length and tag
    assert not sender._buffer  # seal()'s: not used
    assert sender._window is None or len(sender._window) < 2 * RECORD_BYTES
