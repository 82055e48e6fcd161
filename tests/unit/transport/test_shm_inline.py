"""Small tensors over a same-host link travel inside the doorbell packet.

A decode step's activations (a few KiB) need no shared-memory segment: they are
copied into the packet, and their release sends nothing back (before, every hop of
every token woke the sender's reader thread once more with a release packet). A
tensor over ``INLINE_BYTES`` still goes through a segment, given back on release.
"""

from __future__ import annotations

import socket

import msgpack
import pytest
import torch
import trio

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport import Activations, DataPlaneConfig, Tokens, open_data_plane
from hetmesh.transport.frames import DEFAULT_LIMITS, encode_parts
from hetmesh.transport.shm import INLINE_BYTES, INLINE_FRAME_BYTES, ShmLink

from .test_links import link_pair


class Released:
    """Counts the release packets a link handles."""

    def __init__(self, link: ShmLink) -> None:
        self.packets: list[list[object]] = []
        handle = link._on_release

        def counted(seg_ids: list[object]) -> None:
            self.packets.append(list(seg_ids))
            handle(seg_ids)

        link._on_release = counted  # type: ignore[method-assign]


async def round_trip(la: ShmLink, lb: ShmLink) -> None:
    """A frame from ``lb`` to ``la``: every packet ``lb`` sent before it has been read."""
    await lb.send(Tokens(session_id="s", step=0, token_ids=(1,)))
    assert await la.receive() == Tokens(session_id="s", step=0, token_ids=(1,))


@pytest.mark.parametrize(
    ("tensors", "segments", "releases"),
    [
        # a decode step of the default model (576 floats) and of a 1B one (2048)
        ((torch.randn(576),), 0, 0),
        ((torch.randn(2048),), 0, 0),
        ((torch.randn(2048).to(torch.bfloat16), torch.zeros(0)), 0, 0),
        ((torch.randn(INLINE_BYTES // 4 + 1),), 1, 1),  # one float over: a segment
        ((torch.randn(300), torch.randn(4096)), 1, 1),  # the small one inline
    ],
)
async def test_small_tensors_travel_in_the_packet_and_send_no_release(
    tensors: tuple[torch.Tensor, ...], segments: int, releases: int
) -> None:
    config = {"backends": ("shm", "libp2p"), "gloo": True}
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", **config)) as a,  # type: ignore[arg-type]
        open_data_plane(DataPlaneConfig(peer_id="B", **config)) as b,  # type: ignore[arg-type]
    ):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        assert isinstance(lb, ShmLink)
        released = Released(la)
        for step in range(3):
            sent = Activations(session_id="s", step=step, positions=(step,), tensors=tensors)
            await la.send(sent)
            frame = await lb.receive()
            assert frame == sent  # bit for bit (Activations compare their tensors' bits)
            total = sum(t.nbytes for t in tensors)
            assert lb.statistics().in_use_bytes == total  # held until released
            lb.release(frame)
            assert lb.statistics().in_use_bytes == 0
            await round_trip(la, lb)
        assert len(la._own) == segments  # the sender's segments (reused when there is one)
        assert len(released.packets) == releases * 3
        for link in (la, lb):
            await link.aclose()


def test_an_inline_payload_must_match_its_description() -> None:
    """A peer's inline bytes are checked against the frame head before anything is built."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = ShmLink(right, "peer", DEFAULT_LIMITS)
    try:
        t = torch.arange(4, dtype=torch.float32)
        head, _, _ = encode_parts(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
        big = torch.zeros(INLINE_BYTES // 4 + 1)
        big_head, _, _ = encode_parts(
            Activations(session_id="s", step=0, positions=(), tensors=(big,))
        )
        many = tuple(
            torch.zeros(INLINE_BYTES // 4) for _ in range(INLINE_FRAME_BYTES // INLINE_BYTES + 1)
        )
        many_head, _, _ = encode_parts(
            Activations(session_id="s", step=0, positions=(), tensors=many)
        )
        refused = {
            "short": [0, head, [t.numpy().tobytes()[:-1]], []],
            "long": [0, head, [t.numpy().tobytes() + b"\0"], []],
            "over INLINE_BYTES": [0, big_head, [big.numpy().tobytes()], []],
            "over INLINE_FRAME_BYTES": [0, many_head, [x.numpy().tobytes() for x in many], []],
        }
        for name, packet in refused.items():
            with pytest.raises(RemoteProtocolError):
                link._on_packet(msgpack.packb(packet), [])
            assert link.statistics().in_use_bytes == 0, name
        frame = link._on_packet(msgpack.packb([0, head, [t.numpy().tobytes()], []]), [])
        assert isinstance(frame, Activations)
        assert torch.equal(frame.tensors[0], t)
        frame.tensors[0].add_(1)  # the receiver's own copy: writable
        link.release(frame)
        assert link.statistics().in_use_bytes == 0
        assert link._pending_release == []  # nothing to give back
    finally:
        link._shutdown()
        left.close()


async def test_a_peer_that_stops_reading_never_blocks_the_sender_on_its_doorbell() -> None:
    """Inline payloads fill the doorbell socket, not the segment budget, when the peer
    stops reading (it holds every frame: no credit left for its reader). A write "at
    once" (from trio, or ``send_nowait`` from any thread) must then give way instead
    of blocking its thread in the kernel: ``send_nowait`` says False, and a trio send
    waits in a worker thread, where a deadline can cancel it. All frames sent arrive,
    in order, once the peer reads again (the cancelled one whole, or not at all)."""
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", backends=("shm", "libp2p"))) as a,
        open_data_plane(DataPlaneConfig(peer_id="B", backends=("shm", "libp2p"))) as b,
    ):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        x = torch.randn(INLINE_BYTES // 4)  # 8 KiB: the largest that travels inline

        def frame(step: int) -> Activations:
            return Activations(session_id="s", step=step, positions=(step,), tensors=(x,))

        def fill() -> int:
            for step in range(10_000):  # the doorbell holds a few dozen at most
                if not la.send_nowait(frame(step)):
                    return step
            raise AssertionError("send_nowait never gave way")

        with trio.fail_after(30):  # a write blocked in the kernel would hang here
            sent = await trio.to_thread.run_sync(fill, abandon_on_cancel=True)
        assert 0 < sent < 10_000
        for _ in range(1_000):  # trio sends, until one waits on the full doorbell
            with trio.move_on_after(1.0) as waiting:  # trio runs on: it is cancellable
                await la.send(frame(sent))
            if waiting.cancelled_caught:
                break
            sent += 1
        assert waiting.cancelled_caught
        with trio.fail_after(30):
            for step in range(sent):  # the peer reads again: every frame, in order
                got = await lb.receive()
                assert isinstance(got, Activations)
                assert got.step == step
                assert torch.equal(got.tensors[0], x)
                lb.release(got)
            await la.send(frame(sent + 1))  # the link still works
            got = await lb.receive()
            if isinstance(got, Activations) and got.step == sent:  # the cancelled one, whole
                assert torch.equal(got.tensors[0], x)
                lb.release(got)
                got = await lb.receive()
        assert isinstance(got, Activations)
        assert got.step == sent + 1
        for link in (la, lb):
            await link.aclose()


async def test_inline_off_sends_every_tensor_through_a_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``HETMESH_SHM_INLINE=0`` (for comparisons): the old path, a segment and a release."""
    monkeypatch.setenv("HETMESH_SHM_INLINE", "0")
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", backends=("shm", "libp2p"))) as a,
        open_data_plane(DataPlaneConfig(peer_id="B", backends=("shm", "libp2p"))) as b,
    ):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        assert isinstance(lb, ShmLink)
        released = Released(la)
        sent = Activations(session_id="s", step=0, positions=(0,), tensors=(torch.randn(576),))
        await la.send(sent)
        frame = await lb.receive()
        assert frame == sent
        lb.release(frame)
        await round_trip(la, lb)
        assert len(la._own) == 1
        assert len(released.packets) == 1
        for link in (la, lb):
            await link.aclose()
