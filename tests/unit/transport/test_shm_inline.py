"""Small tensors ride inside the shm doorbell packet: no segment, no release back.

A decode step's activations (a few KiB) used to take a segment and cost the
sender's reader a wake-up for the release packet, once a token per hop.
"""

from __future__ import annotations

import os
import socket

import msgpack
import pytest
import torch

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport.frames import DEFAULT_LIMITS, Activations, encode_parts
from hetmesh.transport.shm import INLINE_MAX_BYTES, MIN_SEGMENT, ShmLink, new_segment_fd
from tests.unit.transport.test_links import link_pair, planes


async def test_a_small_tensor_travels_inline_and_a_large_one_in_a_segment() -> None:
    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        assert isinstance(lb, ShmLink)
        small = torch.randn(1, 576)  # one decode step of the default model, float32
        large = torch.randn(INLINE_MAX_BYTES // 4 + 1)
        empty = torch.zeros(0, 576)
        sent = Activations(session_id="s", step=1, positions=(7,), tensors=(small, empty, large))
        for _ in range(2):
            await la.send(sent)
            frame = await lb.receive()
            assert frame == sent  # bit for bit, every tensor
            assert lb.statistics().in_use_bytes == small.nbytes + large.nbytes
            frame.tensors[0].add_(1)  # the receiver's own memory: writable
            lb.release(frame)
            assert lb.statistics().in_use_bytes == 0
        # only the large tensor took a segment (reused the second time)
        assert la.statistics().cached_bytes == MIN_SEGMENT
        assert len(la._own) == 1
        await la.send(Activations(session_id="s", step=2, positions=(8,), tensors=(small,)))
        frame = await lb.receive()
        assert torch.equal(frame.tensors[0], small)
        lb.release(frame)
        assert lb._pending_release == []  # nothing to give back for an inline tensor
        assert len(la._own) == 1
        for link in (la, lb):
            await link.aclose()


async def test_with_inline_off_a_small_tensor_takes_a_segment() -> None:
    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        la._inline_max = 0  # the old path, as the A/B measurement runs it
        small = torch.randn(1, 576)
        sent = Activations(session_id="s", step=1, positions=(7,), tensors=(small,))
        await la.send(sent)
        frame = await lb.receive()
        assert frame == sent
        lb.release(frame)
        assert len(la._own) == 1
        for link in (la, lb):
            await link.aclose()


def test_an_inline_tensor_of_the_wrong_size_is_refused_and_maps_nothing() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = ShmLink(right, "peer", DEFAULT_LIMITS)
    fd = new_segment_fd(1, MIN_SEGMENT)
    t = torch.arange(4, dtype=torch.float32)
    head, _, _ = encode_parts(Activations(session_id="s", step=0, positions=(), tensors=(t, t)))
    try:
        for data in (b"", t.numpy().tobytes()[:-1], t.numpy().tobytes() + b"x"):
            with pytest.raises(RemoteProtocolError, match="inline"):
                link._on_packet(msgpack.packb([0, head, [data, 1], [[1, MIN_SEGMENT]]]), [fd])
            assert link._remote == {}
        frame = link._on_packet(
            msgpack.packb([0, head, [t.numpy().tobytes(), t.numpy().tobytes()], []]), []
        )
        assert isinstance(frame, Activations)
        assert all(torch.equal(x, t) for x in frame.tensors)
        link.release(frame)
        assert link.statistics().in_use_bytes == 0
    finally:
        os.close(fd)
        link._shutdown()
        left.close()
