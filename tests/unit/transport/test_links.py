"""Data-plane links inside one process: every backend, auth refusals, fallbacks, modes."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import trio
import trio.testing

from hetmesh.errors import (
    AuthenticationFailed,
    LocalProtocolError,
    RemoteProtocolError,
    StreamReset,
)
from hetmesh.transport import (
    Activations,
    DataPlane,
    DataPlaneConfig,
    Link,
    Tokens,
    handshake,
    open_data_plane,
)
from hetmesh.transport.codec import BufferPool
from hetmesh.transport.credentials import Credential
from hetmesh.transport.dataplane import dial_shm, dial_tcp
from hetmesh.transport.frames import DEFAULT_LIMITS, encode_parts
from hetmesh.transport.links import TcpLink, ThreadedLink, in_thread
from hetmesh.transport.shm import MIN_SEGMENT, ShmLink, new_segment_fd

BACKENDS = ["tcp", "shm", "torchdist", "libp2p"]


async def wait_until(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait for state that another thread changes (no trio event exists for it)."""
    with trio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.001)


@asynccontextmanager
async def planes(backend: str, **kw: Any) -> AsyncIterator[tuple[DataPlane, DataPlane]]:
    async with (
        open_data_plane(
            DataPlaneConfig(peer_id="A", backends=(backend, "libp2p"), gloo=True, **kw)
        ) as a,
        open_data_plane(
            DataPlaneConfig(peer_id="B", backends=(backend, "libp2p"), gloo=True, **kw)
        ) as b,
    ):
        yield a, b


async def link_pair(
    a: DataPlane, b: DataPlane, *, blocking_a: bool = False, blocking_b: bool = False
) -> tuple[Link, Link]:
    left, right = trio.testing.memory_stream_pair()
    got: dict[str, Link] = {}

    async def accept() -> None:
        got["b"] = await b.accept(right, blocking=blocking_b)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        got["a"] = await a.connect(left, blocking=blocking_a)
    return got["a"], got["b"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_link_round_trip_in_process(backend: str) -> None:
    async with planes(backend) as (a, b):
        la, lb = await link_pair(a, b)
        assert la.backend == lb.backend == backend
        assert backend in la.reason
        t = torch.randn(2048).to(torch.bfloat16)
        await la.send(Activations(session_id="s", step=3, positions=(7,), tensors=(t,)))
        frame = await lb.receive()
        assert frame == Activations(session_id="s", step=3, positions=(7,), tensors=(t,))
        assert lb.statistics().in_use_bytes == t.nbytes
        lb.release(frame)
        assert lb.statistics().in_use_bytes == 0
        await lb.send(Tokens(session_id="s", step=3, token_ids=(42,)))
        assert await la.receive() == Tokens(session_id="s", step=3, token_ids=(42,))
        assert a.statistics().links_opened == {backend: 1}
        await la.aclose()
        assert (await lb.receive()).__class__.__name__ == "Goodbye"
        await lb.aclose()


async def test_link_falls_back_to_libp2p_and_says_why() -> None:
    async with planes("tcp") as (a, b):
        b._endpoints["tcp"] = "127.0.0.1:1"  # nothing listens there
        la, lb = await link_pair(a, b)
        assert la.backend == lb.backend == "libp2p"
        assert "fell back" in la.reason
        assert "tcp" in la.reason
        assert lb.reason == la.reason


async def test_link_falls_back_to_libp2p_past_every_failed_direct_backend() -> None:
    """tcp preferred over torchdist, tcp unreachable: straight to libp2p, not to torchdist."""
    config = {"backends": ("tcp", "torchdist", "libp2p"), "gloo": True}
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", **config)) as a,  # type: ignore[arg-type]
        open_data_plane(DataPlaneConfig(peer_id="B", **config)) as b,  # type: ignore[arg-type]
    ):
        b._endpoints["tcp"] = "127.0.0.1:1"  # nothing listens there
        la, lb = await link_pair(a, b)
        assert la.backend == lb.backend == "libp2p"
        assert "fell back" in la.reason


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_link_wrong_and_replayed_credentials_are_refused(backend: str) -> None:
    async with planes(backend) as (a, b):
        la, lb = await link_pair(a, b)
        endpoint = dict(b.offer().endpoints)[backend]
        wrong = Credential(b"\1" * 16, b"\2" * 32, "A", "B")

        def dial(credential: Credential) -> object:
            if backend == "tcp":
                return dial_tcp(endpoint, credential, DEFAULT_LIMITS, 0, 5.0)
            return dial_shm(endpoint, credential, "B", DEFAULT_LIMITS, 1 << 20, 5.0)

        with pytest.raises(AuthenticationFailed):
            await in_thread(dial, wrong)
        # replay: a credential that was already used for la/lb
        (used,) = [k for k in b.book._used]
        replay = Credential(used, b"\2" * 32, "A", "B")
        with pytest.raises(AuthenticationFailed):
            await in_thread(dial, replay)
        # the listener counts after its handler thread returns
        await wait_until(lambda: b.statistics().connections_refused >= 2)
        stats = b.statistics()
        assert stats.credentials.refused_unknown == 1
        assert stats.credentials.refused_replay == 1
        assert stats.connections_refused == 2
        # the listener still serves the established link and new ones
        await la.send(Tokens(session_id="s", step=1, token_ids=(1,)))
        assert await lb.receive() == Tokens(session_id="s", step=1, token_ids=(1,))
        lc, ld = await link_pair(a, b)
        assert lc.backend == backend
        for link in (la, lb, lc, ld):
            await link.aclose()


async def test_link_blocking_api_and_mode_guard() -> None:
    async with planes("tcp") as (a, b):
        la, lb = await link_pair(a, b, blocking_b=True)
        assert isinstance(la, TcpLink)
        assert isinstance(lb, TcpLink)
        t = torch.arange(100, dtype=torch.int64)

        def echo() -> None:
            frame = lb.receive_blocking()
            lb.send_blocking(frame)
            lb.release(frame)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, echo)
            await la.send(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
            back = await la.receive()
        assert isinstance(back, Activations)
        assert torch.equal(back.tensors[0], t)
        with pytest.raises(LocalProtocolError):
            await lb.receive()
        with pytest.raises(LocalProtocolError):
            la.receive_blocking()


async def test_link_peer_closing_mid_frame_releases_buffer() -> None:
    async with planes("tcp") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, TcpLink)
        from hetmesh.transport.frames import encode

        parts = encode(
            Activations(session_id="s", step=0, positions=(), tensors=(torch.ones(1 << 20),))
        )
        la.sock.sendall(parts[0])
        la.sock.sendall(parts[1][: 1 << 19])
        await wait_until(lambda: lb.statistics().in_use_bytes > 0)
        la.sock.shutdown(socket.SHUT_RDWR)  # what a dead process does to its socket
        with pytest.raises(StreamReset):
            await lb.receive()
        assert lb.statistics().in_use_bytes == 0
        await lb.aclose()


@pytest.mark.parametrize("spin_us", [0.0, 50.0])
@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_link_blocking_mode_streams_without_deadlock(backend: str, spin_us: float) -> None:
    """Blocking mode has no reader thread: shm must still see the peer's releases.

    Both with and without polling before a blocking receive (``spin_us``).
    """
    async with planes(backend, shm_budget_bytes=1 << 20, spin_us=spin_us) as (a, b):
        la, lb = await link_pair(a, b, blocking_a=True, blocking_b=True)
        assert isinstance(la, ThreadedLink)
        assert isinstance(lb, ThreadedLink)
        t = torch.ones(16 << 10)  # 64 KiB: 16 segments fill the 1 MiB shm budget
        count = 400

        def sender() -> None:
            for i in range(count):
                la.send_blocking(Activations(session_id="s", step=i, positions=(), tensors=(t,)))

        def receiver() -> list[int]:
            steps = []
            for _ in range(count):
                frame = lb.receive_blocking()
                assert isinstance(frame, Activations)
                steps.append(frame.step)
                lb.release(frame)
            return steps

        got: list[list[int]] = []

        async def receive() -> None:
            got.append(await in_thread(receiver))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive)
                await in_thread(sender)
        assert got == [list(range(count))]
        assert lb.statistics().in_use_bytes == 0


def test_buffer_pool_reuses_and_caps() -> None:
    from hetmesh.transport.codec import TensorSpec

    pool = BufferPool(max_cached_bytes=64)
    spec = TensorSpec("float32", (4,), 16)
    t = pool.acquire(spec)
    pool.release(t)
    pool.release(t)  # twice is harmless
    assert pool.acquire(spec).data_ptr() == t.data_ptr()
    big = pool.acquire(TensorSpec("float32", (32,), 128))
    pool.release(big)
    stats = pool.statistics()
    assert (stats.cached_bytes, stats.in_use_bytes, stats.reuses) == (0, 16, 1)


def test_buffer_pool_view_aliases_the_tensor_and_is_reused() -> None:
    from hetmesh.transport.codec import TensorSpec

    pool = BufferPool()
    spec = TensorSpec("bfloat16", (2, 3), 12)
    t, view = pool.acquire_view(spec)
    assert (t.dtype, t.shape, len(view)) == (torch.bfloat16, (2, 3), 12)
    view[:] = bytes(range(12))
    assert t.reshape(-1).view(torch.uint8).tolist() == list(range(12))
    pool.release(t)
    again, view2 = pool.acquire_view(spec)
    assert again.data_ptr() == t.data_ptr()
    assert view2 is view


def test_spin_recv_into_polls_then_gives_up() -> None:
    from hetmesh.transport.links import spin_recv_into

    a, b = socket.socketpair()
    with a, b:
        target = memoryview(bytearray(16))
        assert spin_recv_into(b, target, 200_000) == -1  # nothing within 0.2 ms
        a.send(b"hello")
        assert spin_recv_into(b, target, 200_000) == 5
        assert bytes(target[:5]) == b"hello"


@pytest.mark.gpu
async def test_link_cuda_tensor_is_staged_through_pinned_memory() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    async with planes("tcp") as (a, b):
        la, lb = await link_pair(a, b)
        t = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
        await la.send(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
        frame = await lb.receive()
        assert isinstance(frame, Activations)
        assert frame.tensors[0].device.type == "cpu"
        assert torch.equal(frame.tensors[0].view(torch.int16), t.cpu().view(torch.int16))


@pytest.mark.gpu
async def test_link_torchdist_uses_nccl_between_two_gpus() -> None:
    from hetmesh.transport.torchdist import nccl_available

    if not nccl_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices and NCCL")
    async with (
        open_data_plane(
            DataPlaneConfig(peer_id="A", backends=("torchdist",), device="cuda:0")
        ) as a,
        open_data_plane(
            DataPlaneConfig(peer_id="B", backends=("torchdist",), device="cuda:1")
        ) as b,
    ):
        la, lb = await link_pair(a, b)
        assert "NCCL" in la.reason
        t = torch.randn(1 << 20, device="cuda:0")
        await la.send(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
        frame = await lb.receive()
        assert isinstance(frame, Activations)
        assert frame.tensors[0].device == torch.device("cuda:1")
        assert torch.equal(frame.tensors[0].cpu(), t.cpu())


async def test_shm_reused_views_survive_in_place_changes() -> None:
    """The receiver caches its tensor views of a segment; an in-place reshape must not leak."""
    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        shape = (64, 64)  # 16 KiB, over INLINE_BYTES: in a segment, whose views are cached
        for step in range(3):
            t = torch.full(shape, float(step))
            await la.send(Activations(session_id="s", step=step, positions=(), tensors=(t,)))
            frame = await lb.receive()
            assert isinstance(frame, Activations)
            assert frame.tensors[0].shape == shape
            assert torch.equal(frame.tensors[0], t)
            frame.tensors[0].unsqueeze_(0)  # the receiver's business, until release
            lb.release(frame)
            await wait_until(lambda: any(la._free.values()))  # the next send reuses it
        assert la.statistics().cached_bytes == MIN_SEGMENT  # one segment, reused
        for link in (la, lb):
            await link.aclose()


async def test_shm_close_leaves_files_that_reuse_a_received_segment_descriptor() -> None:
    """The receiver closes a peer's segment descriptor once mapped; its number is then
    free for any file. Closing the link must not close it a second time (that once cut
    the surviving links of a node whose neighbour died)."""
    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        t = torch.arange(4096, dtype=torch.float32)
        await la.send(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
        frame = await lb.receive()
        assert torch.equal(frame.tensors[0], t)
        lb.release(frame)
        # the lowest free numbers go first, so one of these takes the segment's old number
        others = [os.open(os.devnull, os.O_RDONLY) for _ in range(32)]
        try:
            await la.aclose()
            await lb.aclose()
            for fd in others:
                os.fstat(fd)  # raises EBADF if the link closed it
        finally:
            for fd in others:
                os.close(fd)


async def test_shm_close_with_unread_packets_still_delivers_the_goodbye() -> None:
    """A seqpacket socket closed with packets still queued for it resets its peer, whose
    next read then fails with ECONNRESET before the packets it was sent last. Closing a
    link whose reader holds back (no credit left) must still leave the peer a Goodbye."""

    def queued(link: Link) -> int:  # frames its reader took that the application has not
        return int(link._receive_items.statistics().current_buffer_used)  # type: ignore[attr-defined]

    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        assert isinstance(lb, ShmLink)
        t = torch.ones(16)
        inflight = la.max_inflight
        # both readers take max_inflight frames, then wait for credit: lb cannot read
        # la's Goodbye before la closes, and lb's last frame stays unread on la's socket
        for step in range(inflight):
            await la.send(Activations(session_id="a", step=step, positions=(), tensors=(t,)))
        await wait_until(lambda: queued(lb) >= inflight)
        for step in range(inflight + 1):
            await lb.send(Activations(session_id="b", step=step, positions=(), tensors=(t,)))
        await wait_until(lambda: queued(la) >= inflight)
        await la.aclose()
        held = []
        with trio.fail_after(10):
            for step in range(inflight):
                frame = await lb.receive()  # held, not released: lb sends nothing to la
                assert isinstance(frame, Activations)
                assert frame.step == step
                held.append(frame)
            last = await lb.receive()
        assert last.__class__.__name__ == "Goodbye"
        for frame in held:
            lb.release(frame)
        await lb.aclose()


def test_shm_checks_a_whole_doorbell_packet_before_mapping_any_descriptor() -> None:
    """A packet whose head, segment ids or descriptors are bad maps nothing."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = ShmLink(right, "peer", DEFAULT_LIMITS)
    fd = new_segment_fd(1, MIN_SEGMENT)
    try:
        t = torch.arange(4, dtype=torch.float32)
        head, _, _ = encode_parts(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
        refused = {
            "truncated head": [0, head[:-1], [1], [[1, MIN_SEGMENT]]],
            "tensor in an unknown segment": [0, head, [2], [[1, MIN_SEGMENT]]],
            "file smaller than declared": [0, head, [1], [[1, 2 * MIN_SEGMENT]]],
            "a segment per tensor missing": [0, head, [], [[1, MIN_SEGMENT]]],
        }
        for name, packet in refused.items():
            with pytest.raises(RemoteProtocolError):
                link._on_packet(msgpack.packb(packet), [fd])
            assert link._remote == {}, name
        view = memoryview(mmap.mmap(fd, MIN_SEGMENT))
        view[: t.nbytes] = t.numpy().tobytes()
        frame = link._on_packet(msgpack.packb([0, head, [1], [[1, MIN_SEGMENT]]]), [fd])
        assert set(link._remote) == {1}
        assert isinstance(frame, Activations)
        assert torch.equal(frame.tensors[0], t)
        link.release(frame)
    finally:
        os.close(fd)
        link._shutdown()
        left.close()


async def test_shm_segments_are_sealed_so_the_sender_cannot_shrink_them() -> None:
    """A peer that truncated a segment the receiver reads would crash it with SIGBUS."""
    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ShmLink)
        t = torch.arange(4096, dtype=torch.float32)
        await la.send(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
        frame = await lb.receive()
        (segment,) = la._own.values()
        for size in (0, segment.size // 2, segment.size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(segment.fd, size)
        assert torch.equal(frame.tensors[0], t)  # still readable, whole
        lb.release(frame)
        for link in (la, lb):
            await link.aclose()


def test_shm_maps_only_sealed_segments_and_at_most_its_budget() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = ShmLink(right, "peer", DEFAULT_LIMITS, budget_bytes=2 * MIN_SEGMENT)
    t = torch.arange(4, dtype=torch.float32)
    head, _, _ = encode_parts(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
    unsealed = os.memfd_create("hetmesh-test", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, MIN_SEGMENT)
    fds = [new_segment_fd(i, MIN_SEGMENT) for i in range(3)]
    try:
        with pytest.raises(RemoteProtocolError, match="sealed"):
            link._on_packet(msgpack.packb([0, head, [1], [[1, MIN_SEGMENT]]]), [unsealed])
        assert link._remote == {}
        for seg_id in (1, 2):  # the budget holds two segments of the peer's
            frame = link._on_packet(
                msgpack.packb([0, head, [seg_id], [[seg_id, MIN_SEGMENT]]]), [fds[seg_id - 1]]
            )
            link.release(frame)
        with pytest.raises(RemoteProtocolError, match="budget"):
            link._on_packet(msgpack.packb([0, head, [3], [[3, MIN_SEGMENT]]]), [fds[2]])
        assert set(link._remote) == {1, 2}
    finally:
        for fd in (unsealed, *fds):
            os.close(fd)
        link._shutdown()
        left.close()


async def test_torchdist_dialer_keeps_the_bytes_its_handshake_read_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The listener sends the store endpoint right after its proof; a dialer that reads
    late gets both in one recv. The link must read on from the handshake's buffer (a
    fresh reader once lost the endpoint and waited out the whole torchdist timeout)."""
    dial_blocking = handshake.dial_blocking

    def late_dialer(send: Any, receive: Any, credential: Credential) -> tuple[bytes, bytes]:
        seen: list[object] = []

        def late_receive() -> Any:
            if seen:  # the listener's proof: let its next frame arrive behind it
                time.sleep(0.5)
            seen.append(None)
            return receive()

        return dial_blocking(send, late_receive, credential)

    monkeypatch.setattr(handshake, "dial_blocking", late_dialer)
    async with planes("torchdist", torchdist_timeout_s=20.0) as (a, b):
        with trio.fail_after(15):  # the old reader waited 20 s, then failed
            la, lb = await link_pair(a, b)
        assert la.backend == "torchdist"
        await la.send(Tokens(session_id="s", step=0, token_ids=(3,)))
        assert await lb.receive() == Tokens(session_id="s", step=0, token_ids=(3,))
        for link in (la, lb):
            await link.aclose()


def _store_threads_cpu_ticks() -> int:
    """CPU ticks (user + system) used so far by this process's TCPStore server threads."""
    ticks = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == "pt_tcpstore_uv":
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
    return ticks


async def test_torchdist_store_takes_no_connection_once_the_group_is_formed() -> None:
    """gloo's TCPStore listened on the data-plane address for the life of each link,
    unauthenticated; now only until the link's group is formed. And its server thread
    sleeps after that: a store whose listening socket was shut down spun a whole core."""
    async with planes("torchdist") as (a, b):
        la, lb = await link_pair(a, b)
        assert la.backend == lb.backend == "torchdist"
        port = lb._store.port  # type: ignore[attr-defined]  # b listened: rank 0 ran the store
        with pytest.raises(TimeoutError):  # the store's socket answers no SYN
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        before, began = _store_threads_cpu_ticks(), time.monotonic()
        await trio.sleep(1.0)
        spent = _store_threads_cpu_ticks() - before
        # spinning, the thread took ~100 ticks a second (10 ms each), ~30 on a loaded machine
        assert spent <= 5, f"{spent} ticks in {time.monotonic() - began:.1f} s"
        t = torch.arange(1024, dtype=torch.float32)
        for step in range(3):  # the group carries on without it
            await la.send(Activations(session_id="s", step=step, positions=(), tensors=(t,)))
            frame = await lb.receive()
            assert torch.equal(frame.tensors[0], t)
            lb.release(frame)
        for link in (la, lb):
            await link.aclose()
