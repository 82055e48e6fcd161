"""The Link conformance suite: every backend keeps the contract of ``links.Link``.

Each test runs once per backend (tcp, shm, torchdist over gloo, libp2p over a
real pair of libp2p hosts) on a fresh pair of links opened by two real data
planes, and checks only what the ``Link`` docstring promises: exact round
trips of every frame type, ordering, large frames, counters, close and
Goodbye, the errors after close, and what cancellation leaves behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from hetmesh.errors import StreamReset
from hetmesh.transport import DataPlaneConfig, Link, open_data_plane
from hetmesh.transport.frames import (
    FRAME_TYPES,
    Activations,
    Cancel,
    Challenge,
    Decision,
    Error,
    Frame,
    Goodbye,
    Hello,
    KVBlock,
    Offer,
    Proof,
    Tokens,
    encode_bytes,
)
from hetmesh.transport.negotiation import Backend
from hetmesh.transport.p2p import PROTOCOL_ID, Libp2pStream, open_p2p_host, p2p_connect

BACKENDS = [b.value for b in Backend]
SEALED = "tcp-sealed"  # tcp with every frame sealed (AES-GCM), forced on loopback


@asynccontextmanager
async def open_link_pair(backend: str) -> AsyncIterator[tuple[Link, Link]]:
    """Two data planes in this process and a link between them over ``backend``.

    The control stream is a real libp2p stream between two hosts: for the
    libp2p backend it becomes the link itself.
    """
    sealed = backend == SEALED
    backend = "tcp" if sealed else backend
    config = {
        "backends": (backend, "libp2p"),
        "gloo": True,
        "tcp_encryption": "always" if sealed else "auto",  # auto: loopback stays plain
    }
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", **config)) as a,  # type: ignore[arg-type]
        open_data_plane(DataPlaneConfig(peer_id="B", **config)) as b,  # type: ignore[arg-type]
        open_p2p_host() as host_a,
        open_p2p_host() as host_b,
        trio.open_nursery() as nursery,
    ):
        accepted: trio.MemorySendChannel[Link]
        accepted, delivered = trio.open_memory_channel[Link](1)
        done = trio.Event()

        async def handle(stream: object) -> None:
            await accepted.send(await b.accept(Libp2pStream(stream)))
            await done.wait()  # the stream may be the link: keep the handler open

        host_b.set_stream_handler(PROTOCOL_ID, handle)
        with trio.fail_after(30):
            la = await a.connect(await p2p_connect(host_a, _address(host_b)))
            lb = await delivered.receive()
        assert la.backend == lb.backend == backend
        assert getattr(la, "encrypted", False) == getattr(lb, "encrypted", False) == sealed
        try:
            yield la, lb
        finally:
            done.set()
            for link in (la, lb):
                await link.aclose()
            nursery.cancel_scope.cancel()


def _address(host: object) -> str:
    return f"{host.get_addrs()[0]}"  # type: ignore[attr-defined]


@pytest.fixture(params=[*BACKENDS, SEALED])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Link, Link]]:
    async with open_link_pair(request.param) as links:
        yield links


def _bf16_with_nan() -> torch.Tensor:
    bits = torch.tensor([0x7FC1, -0x0080, 0x0001, 0x3F80], dtype=torch.int16)  # NaN, -inf, ..
    return bits.view(torch.bfloat16)


def every_frame_type() -> list[Frame]:
    """One frame of each type, tensors of several dtypes and shapes (an empty one too)."""
    g = torch.Generator().manual_seed(12)
    frames: list[Frame] = [
        Offer(
            peer_id="A",
            host_id="h",
            backends=("tcp", "libp2p"),
            endpoints=(("tcp", "127.0.0.1:1"),),
            cuda=True,
            deny=("shm",),
            credential_id=b"\x00\xff",
            credential_secret=b"s" * 32,
        ),
        Decision(backend="tcp", reason="why"),
        Hello(peer_id="A", credential_id=b"\x01" * 16, nonce=b"\x02" * 16),
        Challenge(nonce=b"\x03" * 16),
        Proof(mac=b"\x04" * 32),
        Activations(
            session_id="s",
            step=2**40,
            positions=(0, 1, 2),
            tensors=(
                torch.randn(3, 5, generator=g),
                _bf16_with_nan(),
                torch.empty(0, 4),
                torch.arange(-3, 3, dtype=torch.int64),
            ),
        ),
        Tokens(session_id="s", step=7, token_ids=(1, -2, 2**62)),
        KVBlock(
            session_id="s",
            first_layer=3,
            start=16,
            tensors=(
                torch.randn(2, 4, 8, generator=g).to(torch.float16),
                torch.randint(-128, 127, (5,), dtype=torch.int8, generator=g),
            ),
        ),
        Cancel(session_id="s", reason="client went away"),
        Error(code=3, message="boom", session_id="s"),
        Goodbye(reason="not closing, just a frame"),
    ]
    assert {type(f) for f in frames} == set(FRAME_TYPES.values())
    return frames


def _payload_bytes(frame: Frame) -> int:
    return sum(t.nbytes for t in frame.tensors_())


async def test_link_round_trips_every_frame_type_exactly(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    sent = every_frame_type()
    for frame in sent:
        await la.send(frame)
    for frame in sent:
        got = await lb.receive()
        assert type(got) is type(frame)
        assert got == frame  # tensors compared bit for bit (bf16 NaN payloads too)
        lb.release(got)
    # and the other way
    back = Tokens(session_id="r", step=1, token_ids=(9,))
    await lb.send(back)
    assert await la.receive() == back


async def test_link_counts_what_it_sends_and_receives(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    sent = every_frame_type()
    held = []
    for frame in sent:
        await la.send(frame)
    for _ in sent:
        held.append(await lb.receive())
    out, into = la.statistics(), lb.statistics()
    assert out.frames_sent == into.frames_received == len(sent)
    assert out.bytes_sent == sum(len(encode_bytes(f)) for f in sent)
    assert into.bytes_received == sum(_payload_bytes(f) for f in sent)
    assert into.in_use_bytes == sum(_payload_bytes(f) for f in held)
    assert out.errors == into.errors == 0
    assert out.backend == into.backend == la.backend.value
    assert not out.closed
    for frame in held:
        lb.release(frame)
    assert lb.statistics().in_use_bytes == 0
    assert (lb.statistics().frames_sent, la.statistics().frames_received) == (0, 0)


async def test_link_keeps_order_while_both_ends_are_busy(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    count = 60
    h = torch.arange(1024, dtype=torch.float32)

    def frame(step: int) -> Frame:
        if step % 3:
            return Tokens(session_id="s", step=step, token_ids=(step,))
        return Activations(session_id="s", step=step, positions=(step,), tensors=(h + step,))

    async def send_all() -> None:
        for step in range(count):
            await la.send(frame(step))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        for step in range(count):
            got = await lb.receive()
            assert got == frame(step)
            lb.release(got)
            if step % 10 == 0:  # replies cross the frames still in flight
                await lb.send(Tokens(session_id="r", step=step, token_ids=()))
    for step in range(0, count, 10):
        assert await la.receive() == Tokens(session_id="r", step=step, token_ids=())


async def test_link_carries_a_large_frame_bit_for_bit(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    big = torch.randn(4 << 20, generator=torch.Generator().manual_seed(3))  # 16 MiB
    frame = Activations(session_id="big", step=0, positions=(), tensors=(big,))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:  # the peer reads while we write
            nursery.start_soon(la.send, frame)
            got = await lb.receive()
    assert got == frame
    lb.release(got)


async def test_link_close_sends_goodbye_then_every_call_raises(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    await la.send(Tokens(session_id="s", step=0, token_ids=(1,)))
    await la.aclose()
    await la.aclose()  # idempotent
    assert la.statistics().closed
    assert await lb.receive() == Tokens(session_id="s", step=0, token_ids=(1,))
    goodbye = await lb.receive()
    assert isinstance(goodbye, Goodbye)
    with pytest.raises(StreamReset):
        await lb.receive()  # the peer is gone
    with pytest.raises(StreamReset):
        await lb.receive()  # and stays gone
    with pytest.raises(StreamReset):
        await la.receive()  # we closed it
    with pytest.raises(StreamReset):
        await la.send(Tokens(session_id="s", step=1, token_ids=()))
    assert lb.statistics().errors >= 1
    await lb.aclose()  # closing a link whose peer is gone never raises


async def _after_cancelled_receive(la: Link, lb: Link, expected: Frame) -> None:
    """The documented outcome: the frame whole, or (libp2p streams) a failed link."""
    if lb.backend is Backend.LIBP2P:  # py-libp2p's read is not cancel-safe
        with pytest.raises(StreamReset):
            await lb.receive()
        with pytest.raises(StreamReset):
            await lb.receive()
        return
    got = await lb.receive()
    assert got == expected
    lb.release(got)


async def test_link_cancelled_receive_loses_nothing(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    with trio.move_on_after(0.05) as scope:
        await lb.receive()  # nothing was sent
    assert scope.cancelled_caught
    frame = Activations(session_id="s", step=1, positions=(4,), tensors=(torch.ones(8),))
    await la.send(frame)
    await _after_cancelled_receive(la, lb, frame)


async def test_link_receive_cancelled_mid_frame_loses_nothing(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    big = Activations(
        session_id="big", step=0, positions=(), tensors=(torch.arange(4 << 20).float(),)
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(la.send, big)
            with trio.move_on_after(0.002):  # most likely while the frame is half in
                await lb.receive()
                pytest.fail("16 MiB arrived within 2 ms")  # then nothing was tested
            await _after_cancelled_receive(la, lb, big)
            nursery.cancel_scope.cancel()  # a failed libp2p link's send may wait for a window


async def test_link_cancelled_send_leaves_a_whole_frame_or_a_failed_link(
    pair: tuple[Link, Link],
) -> None:
    """Socket backends finish the frame in the background and stay usable; a byte stream
    with part of a frame on it fails instead. The peer never sees a corrupt frame."""
    la, lb = pair
    big = Activations(
        session_id="big", step=0, positions=(), tensors=(torch.arange(2 << 20).float(),)
    )
    small = Tokens(session_id="s", step=1, token_ids=(5,))
    with trio.move_on_after(0.0005):
        await la.send(big)
    try:
        await la.send(small)
    except StreamReset:
        assert la.backend is Backend.LIBP2P  # only a byte stream may fail here
        await la.aclose()
        with pytest.raises(StreamReset):  # the peer sees the stream end mid-frame
            await lb.receive()
        return
    assert await _past_the_cancelled(lb, big) == small


async def _past_the_cancelled(lb: Link, big: Activations) -> Frame:
    """The next frame on ``lb`` after a cancelled send of ``big``, which it may have
    delivered first (then whole)."""
    with trio.fail_after(60):
        got = await lb.receive()
        if isinstance(got, Activations):  # the cancelled frame, delivered whole
            assert got == big
            lb.release(got)
            got = await lb.receive()
    return got


async def test_link_release_is_idempotent_and_ignores_strangers(pair: tuple[Link, Link]) -> None:
    la, lb = pair
    frame = Activations(session_id="s", step=0, positions=(), tensors=(torch.ones(16),))
    await la.send(frame)
    got = await lb.receive()
    lb.release(got)
    lb.release(got)  # twice
    lb.release(frame)  # tensors this link never lent
    assert lb.statistics().in_use_bytes == 0
    await la.send(frame)  # and the link still works
    got = await lb.receive()
    assert got == frame
    lb.release(got)


def test_every_backend_subclasses_the_link_abc() -> None:
    from hetmesh.transport.links import StreamLink, TcpLink
    from hetmesh.transport.shm import ShmLink
    from hetmesh.transport.torchdist import TorchDistLink

    classes: dict[Backend, Callable[..., Link]] = {
        Backend.TCP: TcpLink,
        Backend.SHM: ShmLink,
        Backend.TORCHDIST: TorchDistLink,
        Backend.LIBP2P: StreamLink,
    }
    for backend, cls in classes.items():
        assert isinstance(cls, type)
        assert issubclass(cls, Link)
        assert cls.backend is backend
        assert not getattr(cls, "__abstractmethods__", None)
    with pytest.raises(TypeError):
        Link("peer", None)  # type: ignore[abstract,arg-type]


@pytest.mark.parametrize("backend", ["tcp", SEALED])
async def test_a_send_cancelled_once_it_holds_the_socket_still_sends_its_frame_whole(
    backend: str,
) -> None:
    """A cancel that lands while a send waits at its lock's checkpoint: the send then
    puts part of its frame on the wire. The rest went to a worker thread that trio
    never started for a cancelled caller, so the link's write lock stayed held and
    every later send hung (a loaded suite run)."""
    async with open_link_pair(backend) as (la, lb):
        big = Activations(
            session_id="big", step=0, positions=(), tensors=(torch.arange(2 << 20).float(),)
        )
        small = Tokens(session_id="s", step=1, token_ids=(5,))
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:

                async def cancel() -> None:  # runs at the send's first checkpoint
                    scope.cancel()

                nursery.start_soon(cancel)
                await la.send(big)
        with trio.fail_after(30):
            await la.send(small)
        assert await _past_the_cancelled(lb, big) == small
