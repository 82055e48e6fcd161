"""Sealed records opened straight into their tensor (OpenedSocket.land, BufferPool landings)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport import Activations
from hetmesh.transport.codec import BufferPool, TensorSpec
from hetmesh.transport.frames import DEFAULT_LIMITS, Frame, encode_parts
from hetmesh.transport.links import SealedReader
from hetmesh.transport.sealed import Sealer

KEY = bytes(range(32))


def _frame(step: int, tensor: torch.Tensor, session: str = "s") -> Activations:
    return Activations(session_id=session, step=step, positions=(step,), tensors=(tensor,))


def _record(sealer: Sealer, frame: Frame) -> bytes:
    head, buffers, total = encode_parts(frame)
    return bytes(sealer.seal_frame(head, buffers, total))


class _Counted:
    """The reader's OpenedSocket with its open_alone calls counted."""

    def __init__(self, reader: SealedReader) -> None:
        self.alone = 0
        opened = reader._opened
        original = opened.open_alone

        def counted(*args: Any) -> int:
            self.alone += 1
            return original(*args)

        opened.open_alone = counted  # type: ignore[method-assign]


def test_a_landing_is_aligned_kept_once_and_never_allocated_by_take() -> None:
    pool = BufferPool()
    spec = TensorSpec("bfloat16", (3, 5), 30)
    assert pool.take_landing(spec, 40) is None
    pool.add_landing(spec, 40)
    pool.add_landing(spec, 40)  # one is free already: kept once
    assert pool.statistics().allocations == 1
    got = pool.take_landing(spec, 40)
    assert got is not None
    tensor, landing = got
    assert tensor.dtype == torch.bfloat16
    assert tensor.shape == (3, 5)
    assert tensor.data_ptr() % 64 == 0
    assert len(landing) == 40 + 30
    landing[40:] = bytes(range(30))  # the landing's tail is the tensor's memory
    assert bytes(tensor.reshape(-1).view(torch.uint8).numpy()) == bytes(range(30))
    assert pool.take_landing(spec, 40) is None  # in use, and take never allocates
    assert pool.take_landing(spec, 41) is None  # another lead is another landing
    assert pool.acquire(spec).data_ptr() != tensor.data_ptr()  # plain buffers apart
    pool.release(tensor)
    again = pool.take_landing(spec, 40)
    assert again is not None
    assert again[0].data_ptr() == tensor.data_ptr()
    assert pool.statistics().allocations == 2


def test_frames_of_a_layout_seen_before_open_straight_into_their_tensor() -> None:
    """The first two frames of a layout read the usual way (opened into the staging
    buffer, then copied): the second makes a landing; the next ones open into it."""
    left, right = socket.socketpair()
    with left, right:
        sealer, pool = Sealer(KEY), BufferPool()
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, pool)
        counted = _Counted(reader)
        pointers = set()
        for step in range(6):
            frame = _frame(step, torch.randn(2048))
            left.sendall(_record(sealer, frame))
            got = reader.read_frame()
            assert got == frame
            pointers.add(got.tensors_()[0].data_ptr())
            pool.release(got.tensors_()[0])
        assert counted.alone == 2
        assert len(pointers) == 2  # the first frames' buffer, then the one landing
        assert pool.statistics().allocations == 2
        assert reader.bytes_read == 6 * len(encode_parts(frame)[0]) + 6 * 2048 * 4


@pytest.mark.parametrize("other", ["another dtype", "another head length"])
def test_a_record_of_a_learned_size_laid_out_otherwise_reads_back_equal(other: str) -> None:
    """Records of one size, two layouts (same head length and another spec; or a longer
    head and a shorter tensor), interleaved: every frame reads back equal."""
    left, right = socket.socketpair()
    with left, right:
        sealer, pool = Sealer(KEY), BufferPool()
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, pool)
        frames: list[Frame] = []
        for step in range(8):
            if step % 3 != 2:
                frames.append(_frame(step, torch.randn(512)))
            elif other == "another dtype":
                frames.append(_frame(step, torch.randn(1024, dtype=torch.float16)))
            else:
                tensor = torch.randn(1023, dtype=torch.float16)  # 2 bytes short
                frames.append(_frame(step, tensor, session="sss"))  # 2 bytes more
        records = [_record(sealer, f) for f in frames]
        assert len({len(r) for r in records}) == 1
        counted = _Counted(reader)
        for frame, record in zip(frames, records, strict=True):
            left.sendall(record)
            got = reader.read_frame()
            assert got == frame
            pool.release(got.tensors_()[0])
        # frames 0, 1, 3 and 6 read the usual way (3 and 6: their size was last seen
        # laid out otherwise); the rest were opened into a landing (2 and 5 were
        # then copied to the staging buffer, laid out otherwise)
        assert counted.alone == 4
        assert pool.statistics().in_use_bytes == 0


def test_while_every_landing_is_held_frames_read_the_usual_way() -> None:
    left, right = socket.socketpair()
    with left, right:
        sealer, pool = Sealer(KEY), BufferPool()
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, pool)
        frames = [_frame(step, torch.randn(1024)) for step in range(5)]
        held = []
        for frame in frames:
            left.sendall(_record(sealer, frame))
            held.append(reader.read_frame())
        assert held == frames
        assert len({f.tensors_()[0].data_ptr() for f in held}) == 5
        for f in held:
            pool.release(f.tensors_()[0])
        assert pool.statistics().in_use_bytes == 0


@pytest.mark.parametrize("attack", ["flip a tag bit", "flip a ciphertext bit", "bad head"])
def test_a_landed_record_that_fails_is_refused_and_gives_its_landing_back(attack: str) -> None:
    """A record of a learned size that fails its tag, or opens to a head the reader
    refuses (authenticated: sealed with the link's key), ends the read with
    RemoteProtocolError; the landing goes back to the pool."""
    left, right = socket.socketpair()
    with left, right:
        sealer, pool = Sealer(KEY), BufferPool()
        reader = SealedReader(right, KEY, DEFAULT_LIMITS, pool)
        first = _frame(0, torch.randn(256))
        for _ in range(2):  # a layout seen twice: a landing waits for the next record
            left.sendall(_record(sealer, first))
            pool.release(reader.read_frame().tensors_()[0])
        if attack == "bad head":  # the same size, a bad magic, sealed as the next record
            head = encode_parts(first)[0]
            bad = bytes(sealer.seal([b"XX" + head[2:] + bytes(256 * 4)]))
        else:
            bad = _record(sealer, _frame(2, torch.randn(256)))
            at = len(bad) - 1 if attack == "flip a tag bit" else 30
            bad = bad[:at] + bytes([bad[at] ^ 4]) + bad[at + 1 :]
        counted = _Counted(reader)
        left.sendall(bad)
        with pytest.raises(RemoteProtocolError):
            reader.read_frame()
        assert counted.alone == 0  # refused on the landing's path
        assert pool.statistics().in_use_bytes == 0
