"""The link probe over real loopback sockets: bandwidth of a paced sender, honestly."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import trio

from hetmesh.discovery.probe import (
    CHALLENGE_BYTES,
    SocketChannel,
    enable_timestamps,
    probe_answer,
    probe_link,
    probe_token,
    receive_bulk,
    serve_probe,
)
from tests.unit.discovery.pacing import NBYTES, backlog_listener, paced_sender

SECRET = "probe-test-secret"


@pytest.mark.slow
async def test_a_starved_receiver_still_measures_the_link_rate() -> None:
    """The receiving process gets no CPU for the first 0.3 s of a paced transfer (as
    under a cgroup quota), while the kernel buffers what arrives; it then reads the
    backlog at once. Timing reads in user space made such a link look twice as fast
    (the CI testbed's 50 Mbit/s link); the kernel's arrival times do not."""
    listener = backlog_listener()
    out: dict[str, float] = {}
    sender = threading.Thread(target=paced_sender, args=(listener.getsockname()[1], out))
    sender.start()
    try:
        conn, _ = listener.accept()
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        assert enable_timestamps(stream.socket)
        time.sleep(0.3)  # noqa: ASYNC251 - starved: nothing in this process runs
        await receive_bulk(SocketChannel(stream, stamped=True), NBYTES)
        await trio.to_thread.run_sync(sender.join)
        await stream.aclose()
    finally:
        listener.close()
    bandwidth = (NBYTES - NBYTES // 4) / out["tail_s"]
    sent = out["sent_bps"]  # RATE unless the sender itself was starved
    print(f"measured {bandwidth / 1e6:.2f} MB/s, sent at {sent / 1e6:.2f} MB/s")
    # the backlog read at once must not make the link look faster than it is
    assert 0.75 * sent < bandwidth < 1.25 * sent


async def test_probe_link_reports_rtt_and_a_fast_loopback() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_probe, "127.0.0.1", SECRET)
        measured = await probe_link("127.0.0.1", port, SECRET)
        nursery.cancel_scope.cancel()
    assert 0 < measured.rtt_s < 0.1
    assert measured.bandwidth_bps > 50e6  # loopback moves far more than a shaped link


async def _connect(port: int, source: str = "127.0.0.1") -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return sock


async def _read_to_end(sock: trio.socket.SocketType) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    data = b""
    while True:
        try:
            chunk = await sock.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


async def test_probe_refuses_a_replayed_token() -> None:
    """The old fixed token, as a stranger who saw one probe would send it, gets no echo."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_probe, "127.0.0.1", SECRET)
        sock = await _connect(port)
        with sock:
            await sock.send(probe_token(SECRET) + b"P")
            with trio.fail_after(30):
                received = await _read_to_end(sock)
        assert len(received) == CHALLENGE_BYTES  # its challenge, then the door shut: no echo
        nursery.cancel_scope.cancel()


async def test_probe_answer_is_bound_to_its_connection() -> None:
    """An answer recorded on one connection does not open the next one."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_probe, "127.0.0.1", SECRET)
        first = await _connect(port)
        with first:
            challenge = await first.recv(CHALLENGE_BYTES)
            answer = probe_answer(probe_token(SECRET), challenge)
            await first.send(answer + b"P")
            assert await first.recv(1) == b"p"  # the answer works where it was asked for
        second = await _connect(port)
        with second:
            await second.send(answer + b"P")
            with trio.fail_after(30):
                received = await _read_to_end(second)
        assert len(received) == CHALLENGE_BYTES
        assert received != challenge
        nursery.cancel_scope.cancel()


async def test_probe_caps_and_times_out_silent_strangers() -> None:
    """Silent connections: those over the per-address cap are closed at once, the rest
    at the answer deadline; a member's probe still measures meanwhile."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            functools.partial(
                serve_probe,
                "127.0.0.1",
                SECRET,
                auth_timeout_s=60.0,
                max_pending=16,
                max_pending_per_address=4,
            )
        )
        strangers = [await _connect(port, "127.0.0.2") for _ in range(6)]
        # the two over the cap: closed without waiting for the 60 s deadline
        with trio.fail_after(30):
            for sock in strangers[4:]:
                assert await _read_to_end(sock) == b""
        for sock in strangers[:4]:  # the admitted ones were challenged
            assert len(await sock.recv(CHALLENGE_BYTES)) == CHALLENGE_BYTES
        measured = await probe_link("127.0.0.1", port, SECRET, nbytes=1 << 20, timeout_s=30)
        assert measured.rtt_s > 0
        for sock in strangers:
            sock.close()
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            functools.partial(serve_probe, "127.0.0.1", SECRET, auth_timeout_s=0.5)
        )
        sock = await _connect(port)
        with sock, trio.fail_after(30):
            assert len(await _read_to_end(sock)) == CHALLENGE_BYTES
        nursery.cancel_scope.cancel()
