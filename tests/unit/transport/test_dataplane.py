"""The data plane's listeners facing strangers: bounded reads, caps and deadlines."""

from __future__ import annotations

import errno
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import torch
import trio
import trio.testing

from hetmesh.errors import PeerUnreachable, TransportError
from hetmesh.transport import Activations, DataPlane, DataPlaneConfig, open_data_plane
from hetmesh.transport.codec import BufferPool, TensorSpec
from hetmesh.transport.frames import MAGIC, PREFIX, VERSION, Hello

from .test_links import link_pair


async def wait_until(predicate: Callable[[], bool], seconds: float = 30.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - state changed by the listener's tasks
            await trio.sleep(0.01)


@asynccontextmanager
async def listener(**kw: Any) -> AsyncIterator[tuple[DataPlane, tuple[str, int]]]:
    # long handshake deadlines: a connection closed quickly was refused, not timed out
    config = {"handshake_timeout_s": 60.0, "preauth_timeout_s": 60.0, **kw}
    async with open_data_plane(
        DataPlaneConfig(peer_id="B", backends=("tcp", "libp2p"), **config)
    ) as plane:
        host, _, port = dict(plane.offer().endpoints)["tcp"].rpartition(":")
        yield plane, (host, int(port))


async def connect(address: tuple[str, int], source: str = "127.0.0.1") -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(address)
    return sock


async def closed_by_peer(sock: trio.socket.SocketType) -> bool:
    """Read until the listener closes; True when it sent nothing first."""
    got = b""
    while True:
        try:
            chunk = await sock.recv(4096)
        except ConnectionResetError:
            return not got
        if not chunk:
            return not got
        got += chunk


def data_frame_head(payload_bytes: int) -> bytes:
    """A well-formed head of an Activations frame carrying ``payload_bytes`` of float32."""
    header = msgpack.packb(
        ["s", 0, [0], [["float32", [payload_bytes // 4], payload_bytes]]], use_bin_type=True
    )
    return PREFIX.pack(MAGIC, VERSION, Activations.TAG, len(header), payload_bytes) + header


async def test_data_plane_reads_only_a_small_hello_before_authentication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger's 256 MiB data frame, or a Hello with a 1 MiB header, is refused from
    its prefix: no buffer is taken for it and the connection closes at once."""
    acquired: list[int] = []
    original = BufferPool.acquire_view

    def spy(self: BufferPool, spec: TensorSpec) -> Any:
        acquired.append(spec.nbytes)
        return original(self, spec)

    monkeypatch.setattr(BufferPool, "acquire_view", spy)
    huge_hello = PREFIX.pack(MAGIC, VERSION, Hello.TAG, 1 << 20, 0)
    async with listener() as (plane, address):
        for data in (data_frame_head(256 << 20), huge_hello):
            sock = await connect(address)
            with sock:
                await sock.send(data)
                with trio.fail_after(30):
                    assert await closed_by_peer(sock)
        await wait_until(lambda: plane.statistics().connections_refused == 2)
    assert acquired == []


async def test_data_plane_closes_a_silent_connection_at_the_preauth_deadline() -> None:
    async with listener(preauth_timeout_s=0.5) as (plane, address):
        sock = await connect(address)
        with sock, trio.fail_after(30):
            assert await closed_by_peer(sock)
        await wait_until(lambda: plane.statistics().pending_connections == 0)


async def test_data_plane_caps_unauthenticated_connections() -> None:
    async with listener(max_pending_connections=6, max_pending_per_address=4) as (plane, address):
        strangers = [await connect(address, "127.0.0.2") for _ in range(6)]
        strangers += [await connect(address, "127.0.0.3") for _ in range(2)]
        strangers.append(await connect(address, "127.0.0.4"))  # over the total
        try:
            with trio.fail_after(30):  # closed on accept, not at the 60 s deadline
                for sock in (*strangers[4:6], strangers[8]):
                    assert await closed_by_peer(sock)
            await wait_until(lambda: plane.statistics().pending_connections == 6)
            assert plane.statistics().connections_refused == 3
        finally:
            for sock in strangers:
                sock.close()
        await wait_until(lambda: plane.statistics().pending_connections == 0)


async def test_silent_strangers_hold_no_thread_and_do_not_stall_new_links() -> None:
    """48 silent connections (more than trio's 40 worker threads) from four addresses
    wait for their Hello; a member's tcp link opens and carries a frame meanwhile."""
    async with (
        listener() as (b, address),
        open_data_plane(DataPlaneConfig(peer_id="A", backends=("tcp", "libp2p"))) as a,
    ):
        strangers = [await connect(address, f"127.0.0.{2 + i % 4}") for i in range(48)]
        try:
            await wait_until(lambda: b.statistics().pending_connections == 48)
            with trio.fail_after(30):
                la, lb = await link_pair(a, b)
                assert la.backend == lb.backend == "tcp"
                t = torch.arange(16, dtype=torch.float32)
                await la.send(Activations(session_id="s", step=0, positions=(0,), tensors=(t,)))
                frame = await lb.receive()
                assert frame == Activations(session_id="s", step=0, positions=(0,), tensors=(t,))
                lb.release(frame)
            await la.aclose()
            await lb.aclose()
        finally:
            for sock in strangers:
                sock.close()


async def test_a_peer_gets_at_most_max_links_per_peer_open_links() -> None:
    async with (
        listener(max_links_per_peer=2) as (b, _),
        open_data_plane(DataPlaneConfig(peer_id="A", backends=("tcp", "libp2p"))) as a,
    ):
        pairs = [await link_pair(a, b) for _ in range(2)]
        left, right = trio.testing.memory_stream_pair()
        errors: dict[str, BaseException] = {}

        async def side(name: str, call: Any) -> None:
            try:
                await call()
            except Exception as exc:
                errors[name] = exc

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(side, "b", lambda: b.accept(right))
                nursery.start_soon(side, "a", lambda: a.connect(left))
        assert isinstance(errors["b"], TransportError)
        assert isinstance(errors["a"], PeerUnreachable)
        assert "2 links open" in str(errors["a"])
        for link in pairs[0]:  # one closes: its place is free again
            await link.aclose()
        la, lb = await link_pair(a, b)
        assert la.backend == "tcp"
        for link in (la, lb, *pairs[1]):
            await link.aclose()


async def test_a_failing_accept_does_not_stop_the_listener() -> None:
    """Out of descriptors (EMFILE) once: the listener logs it and accepts on."""

    class Listener:
        calls = 0

        def __enter__(self) -> Listener:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        async def accept(self) -> Any:
            self.calls += 1
            if self.calls == 1:
                raise OSError(errno.EMFILE, "Too many open files")
            await trio.sleep_forever()

    fake = Listener()
    async with listener() as (plane, _), trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(plane._accept_loop, fake, stream=True))  # type: ignore[arg-type]
        await wait_until(lambda: fake.calls == 2)
        nursery.cancel_scope.cancel()
