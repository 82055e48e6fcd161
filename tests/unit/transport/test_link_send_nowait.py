"""``Link.send_nowait``: the stage loop's write from its device thread, with no trio hop.

It writes a frame whole at once or writes nothing and says so; the frames a
peer receives are exactly those sent, in order, whichever way they went.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios

import pytest
import torch
import trio

from hetmesh.transport import Activations, Tokens
from hetmesh.transport.links import (
    NOWAIT_MAX_BYTES,
    SO_MEMINFO,
    ThreadedLink,
    _meminfo_queued_at,
    in_thread,
)
from tests.unit.transport.test_links import link_pair, planes, wait_until


def _frame(step: int, elements: int) -> Activations:
    tensor = torch.arange(elements, dtype=torch.float32) + step
    return Activations(session_id="s", step=step, positions=(step,), tensors=(tensor,))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_send_nowait_writes_small_frames_from_a_thread_and_refuses_large_ones(
    backend: str,
) -> None:
    async with planes(backend) as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ThreadedLink)
        small = _frame(1, 576)  # one decode step's hidden state of the default model
        assert await in_thread(la.send_nowait, small)
        # too large to be sure it never waits on the peer: nothing written, send() it
        large = _frame(2, 2 * NOWAIT_MAX_BYTES if backend == "tcp" else 1 << 19)
        assert not la.send_nowait(large)
        assert la.statistics().frames_sent == 1
        await la.send(large)
        for expected in (small, large):
            frame = await lb.receive()
            assert frame == expected
            lb.release(frame)
        after = Tokens(session_id="s", step=3, token_ids=(7,))
        # tcp: once the peer has taken (and acknowledged) the large frame's bytes
        await wait_until(lambda: la.send_nowait(after), seconds=30)
        assert await lb.receive() == after
        assert la.statistics().frames_sent == 3
        await la.aclose()
        await lb.aclose()


async def test_send_nowait_waits_for_no_other_writer() -> None:
    async with planes("tcp") as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(la, ThreadedLink)
        with la._write_lock:  # another thread's write is under way
            assert not la.send_nowait(_frame(1, 8))
        assert la.statistics().frames_sent == 0
        assert la.send_nowait(_frame(2, 8))
        frame = await lb.receive()
        assert frame == _frame(2, 8)  # the refused frame never went out, not even in part
        lb.release(frame)
        await la.aclose()
        await lb.aclose()


async def test_send_nowait_on_a_libp2p_link_leaves_it_to_send() -> None:
    async with planes("libp2p") as (a, b):
        la, lb = await link_pair(a, b)
        assert la.backend == "libp2p"
        assert not la.send_nowait(_frame(1, 8))
        await la.send(_frame(2, 8))
        with trio.fail_after(30):
            frame = await lb.receive()
        assert frame == _frame(2, 8)
        await la.aclose()
        await lb.aclose()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_send_with_nothing_queued_is_written_before_trio_runs_another_task(
    backend: str,
) -> None:
    async with planes(backend) as (a, b):
        la, lb = await link_pair(a, b)
        seen: list[int] = []
        for step in range(8):  # trio runs a batch's tasks in random order: 8 tries
            frame = _frame(step, 576)
            # the backend takes it now (tcp: once the last frame's bytes are acknowledged)
            await wait_until(lambda: la._writes_at_once(frame), 30)  # noqa: B023
            async with trio.open_nursery() as nursery:
                # runs at send's first yield: the frame is out by then, not after it
                nursery.start_soon(lambda: _note(seen, la))
                await la.send(frame)
        assert seen == list(range(1, 9))
        for step in range(8):
            frame = await lb.receive()
            assert frame == _frame(step, 576)
            lb.release(frame)
        await la.aclose()
        await lb.aclose()


async def _note(seen: list[int], link: ThreadedLink) -> None:
    seen.append(link.statistics().frames_sent)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_send_behind_one_in_flight_waits_its_turn(backend: str) -> None:
    async with planes(backend) as (a, b):
        la, lb = await link_pair(a, b)
        async with trio.open_nursery() as nursery:
            await la._send_lock.acquire()  # a send under way on trio (its frame unsent)

            async def send(step: int) -> None:
                await la.send(_frame(step, 8))

            nursery.start_soon(send, 1)
            await wait_until(lambda: la._send_lock.statistics().tasks_waiting == 1, 30)
            nursery.start_soon(send, 2)  # nothing queued? no: it must not overtake 1
            await wait_until(lambda: la._send_lock.statistics().tasks_waiting == 2, 30)
            assert la.statistics().frames_sent == 0
            la._send_lock.release()
        for step in (1, 2):
            frame = await lb.receive()
            assert frame == _frame(step, 8)
            lb.release(frame)
        await la.aclose()
        await lb.aclose()


def _outq(sock: socket.socket) -> int:
    queued = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)
    return int.from_bytes(queued, "little")


def _meminfo_unread(sock: socket.socket) -> int:
    at = _meminfo_queued_at(sock)
    assert at >= 0  # Linux
    info = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 24)
    return int(struct.unpack_from("=6I", info)[at])


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_meminfo_says_bytes_are_queued_exactly_when_tiocoutq_does(family: str) -> None:
    """TcpLink's send_nowait asks SO_MEMINFO (one call) what TIOCOUTQ said: whether
    the peer has yet to take bytes sent; both agree before, while and after."""
    if family == "tcp":
        with socket.create_server(("127.0.0.1", 0)) as server:
            left = socket.create_connection(server.getsockname())
            right, _ = server.accept()
    else:
        left, right = socket.socketpair()
    with left, right:
        assert _outq(left) == 0
        assert _meminfo_unread(left) == 0
        left.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            while True:  # the peer reads nothing: fill every buffer on the way
                sent += left.send(bytes(1 << 16))
        assert _outq(left) > 0
        assert _meminfo_unread(left) > 0
        got = 0
        while got < sent:
            got += len(right.recv(1 << 20))
        while True:  # acknowledgements come after the reads; the queues only drain now
            unread = _meminfo_unread(left)
            queued = _outq(left)  # read second: 0 here if SO_MEMINFO said 0 before
            assert queued == 0 or unread > 0  # never "empty" while TIOCOUTQ says not
            if unread == 0:
                break
