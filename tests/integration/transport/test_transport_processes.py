"""Two OS processes per backend: bit-exact tensors, refused credentials, killed senders."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

from hetmesh.errors import MeshError, TransportError
from hetmesh.transport import Activations, DataPlane, Goodbye, Link, open_data_plane
from tests.integration.transport.peer_server import ForkedPeer, PeerServer
from tests.integration.transport.transport_peer import config, payloads, reply

REPO = Path(__file__).resolve().parents[3]
BACKENDS = ["tcp", "shm", "torchdist", "libp2p"]
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


class Peers:
    """Child processes of one test; every one is killed and reaped at teardown.

    Forked by the module's peer server (``peer_server.py``), which imported torch,
    trio and the transport once: each is still its own OS process, without the
    ~2 CPU-s of imports a fresh interpreter spends.
    """

    def __init__(self, server: PeerServer) -> None:
        self.server = server
        self.procs: list[ForkedPeer] = []

    def start(self, mode: str, backend: str, address: str) -> ForkedPeer:
        proc = self.server.start(mode, backend, address)
        self.procs.append(proc)
        return proc


@pytest.fixture(scope="module")
def peer_server() -> Iterator[PeerServer]:
    server = PeerServer(str(REPO))
    yield server
    server.close()


@pytest.fixture
def peers(peer_server: PeerServer) -> Iterator[Peers]:
    p = Peers(peer_server)
    yield p
    for proc in p.procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


async def wait_exit(proc: ForkedPeer) -> int:
    return await trio.to_thread.run_sync(proc.wait, 90)


@asynccontextmanager
async def serving(
    backend: str,
) -> AsyncIterator[tuple[str, trio.MemoryReceiveChannel[Any], DataPlane]]:
    """Our data plane and a control listener; yields (address, accepted links/errors, plane)."""
    send, receive = trio.open_memory_channel[Any](16)
    async with open_data_plane(config("parent", backend)) as plane, trio.open_nursery() as nursery:

        async def accept(control: Any) -> None:
            try:
                link = await plane.accept(control)
            except MeshError as exc:  # a refused peer: report it, keep serving
                await send.send(exc)
                return
            await send.send(link)

        if backend == "libp2p":
            from hetmesh.transport.p2p import PROTOCOL_ID, Libp2pStream, guarded

            host = await nursery.start(_run_host)
            done = trio.Event()

            async def handler(stream: Any) -> None:
                await accept(Libp2pStream(stream))
                await done.wait()  # keep the stream's handler alive while the link is used

            host.set_stream_handler(PROTOCOL_ID, guarded(handler))
            address = str(host.get_addrs()[0])
        else:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

            async def loop() -> None:
                async with listeners[0]:
                    while True:
                        control = await listeners[0].accept()
                        nursery.start_soon(accept, control)

            nursery.start_soon(loop)
            address = str(listeners[0].socket.getsockname()[1])
        yield address, receive, plane
        nursery.cancel_scope.cancel()


async def _run_host(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from hetmesh.transport.p2p import open_p2p_host

    async with open_p2p_host() as host:
        task_status.started(host)
        await trio.sleep_forever()


async def next_link(links: trio.MemoryReceiveChannel[Any]) -> Link:
    with trio.fail_after(90):
        item = await links.receive()
    assert isinstance(item, Link), item
    return item


@pytest.mark.parametrize("backend", BACKENDS)
async def test_two_processes_move_tensors_bit_exactly(backend: str, peers: Peers) -> None:
    async with serving(backend) as (address, links, _):
        child = peers.start("exchange", backend, address)
        link = await next_link(links)
        assert link.backend == backend
        for i, expected in enumerate(payloads()):
            with trio.fail_after(60):
                frame = await link.receive()
            assert frame == Activations(session_id="s", step=i, positions=(i,), tensors=(expected,))
            link.release(frame)
        await link.send(Activations(session_id="back", step=0, positions=(), tensors=(reply(),)))
        with trio.fail_after(30):
            assert isinstance(await link.receive(), Goodbye)  # read before the peer exits
        assert await wait_exit(child) == 0
        stats = link.statistics()
        assert stats.frames_received == 7
        assert stats.in_use_bytes == 0
        await link.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_wrong_credential_refused_while_listener_serves(backend: str, peers: Peers) -> None:
    async with serving(backend) as (address, links, plane):
        good = peers.start("echo", backend, address)
        link = await next_link(links)
        bad = peers.start("wrongcred", backend, address)
        assert await wait_exit(bad) == 3
        if backend == "libp2p":
            with trio.fail_after(30):
                refused = await links.receive()
            assert isinstance(refused, TransportError)
        else:
            with trio.fail_after(30):
                refused = await links.receive()  # the negotiation that never got its link
            assert isinstance(refused, MeshError)
            assert plane.statistics().connections_refused >= 1
        assert plane.statistics().credentials.refused_wrong >= 1
        t = torch.randn(1 << 20).to(torch.bfloat16)
        await link.send(Activations(session_id="s", step=1, positions=(), tensors=(t,)))
        with trio.fail_after(30):
            echoed = await link.receive()
        assert echoed == Activations(session_id="s", step=1, positions=(), tensors=(t,))
        await link.aclose()
        assert await wait_exit(good) == 0


async def _in_process_link(plane: DataPlane) -> tuple[Link, Link]:
    left, right = trio.testing.memory_stream_pair()
    got: dict[str, Link] = {}
    async with open_data_plane(config("other", plane.config.backends[0])) as other:

        async def accept() -> None:
            got["ours"] = await plane.accept(right)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            got["theirs"] = await other.connect(left)
        t = torch.arange(1000, dtype=torch.int64)
        await got["theirs"].send(
            KV := Activations(session_id="k", step=0, positions=(), tensors=(t,))
        )
        assert await got["ours"].receive() == KV
        await got["theirs"].aclose()
        await got["ours"].aclose()
    return got["ours"], got["theirs"]


# The receiver must fail within a second of its sender's death; on a loaded
# 2-core machine this process may itself wait that long for the CPU, hence
# the slack. The time runs from the kill to the moment the link raised.
FAIL_WITHIN_S = 1.0
SLACK_S = 4.0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_sender_raises_within_a_second_and_frees_buffer(
    backend: str, peers: Peers
) -> None:
    async with serving(backend) as (address, links, plane):
        child = peers.start("partial", backend, address)
        link = await next_link(links)
        failure: list[BaseException] = []
        failed_at: list[float] = []
        failed = trio.Event()

        async def receiver() -> None:
            try:
                await link.receive()
            except TransportError as exc:
                failed_at.append(time.monotonic())  # when the link raised, as it raised
                failure.append(exc)
                failed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            assert child.stdout is not None
            line = ""
            with trio.fail_after(60):
                while "PARTIAL" not in line:
                    line = await trio.to_thread.run_sync(child.stdout.readline)
                    assert line, "peer exited early"
                if backend in ("tcp", "libp2p", "torchdist"):
                    while link.statistics().in_use_bytes == 0:  # noqa: ASYNC110 - set by another thread
                        await trio.sleep(0.001)
            killed = time.monotonic()
            child.send_signal(signal.SIGKILL)
            with trio.fail_after(60):  # a deadline for a hang; the bound is below
                await failed.wait()
            elapsed = failed_at[0] - killed
            print(f"{backend}: the receive failed {elapsed:.3f} s after SIGKILL")
            assert elapsed < FAIL_WITHIN_S + SLACK_S, f"failed {elapsed:.2f} s after the kill"
        assert link.statistics().in_use_bytes == 0
        assert link.statistics().errors == 1
        await link.aclose()
        # the process keeps serving other links
        await _in_process_link(plane)
