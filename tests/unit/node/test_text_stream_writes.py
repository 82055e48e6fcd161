"""The generate stream's writer (hetmesh.node.text_stream.write_frames): a message
alone goes at once; the messages that came while a write was in flight go out in one
write; a reader takes them back one by one."""

from __future__ import annotations

import trio
import trio.testing

from hetmesh.discovery import wire
from hetmesh.node.text_stream import WAITING_FRAMES, write_frames


class _Stream:
    """Records each write; a write waits while ``hold`` is closed (a write in flight)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.hold: trio.Event | None = None
        self._read = bytearray()

    async def write(self, data: bytes) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.writes.append(data)
        self._read += data

    async def read(self, n: int | None = None) -> bytes:  # what was written, as it came
        chunk = bytes(self._read[: n or len(self._read)])
        del self._read[: len(chunk)]
        return chunk


async def _frames_of(stream: _Stream, count: int) -> list[bytes]:
    reader = wire.FrameReader(stream)
    return [await reader.read_frame(max_bytes=1 << 20, timeout_s=1.0) for _ in range(count)]


async def test_a_message_alone_is_written_at_once() -> None:
    stream = _Stream()
    send, frames = trio.open_memory_channel[bytes](WAITING_FRAMES)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_frames, stream, frames)
        async with send:
            await send.send(b"one")
            await trio.testing.wait_all_tasks_blocked()
            assert stream.writes == [wire.frame_prefix(3) + b"one"]  # nothing waited for more
            await send.send(b"two")
            await trio.testing.wait_all_tasks_blocked()
            assert len(stream.writes) == 2
    assert await _frames_of(stream, 2) == [b"one", b"two"]


async def test_messages_that_came_during_a_write_go_out_together_in_order() -> None:
    stream = _Stream()
    stream.hold = trio.Event()
    send, frames = trio.open_memory_channel[bytes](WAITING_FRAMES)
    sent = [b"first", b"a", b"bb", b"", b"ccc"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_frames, stream, frames)
        async with send:
            await send.send(sent[0])
            await trio.testing.wait_all_tasks_blocked()  # its write is in flight
            for message in sent[1:]:
                await send.send(message)
            await trio.testing.wait_all_tasks_blocked()
            assert stream.writes == []
            stream.hold.set()
            await trio.testing.wait_all_tasks_blocked()
    assert len(stream.writes) == 2  # the first, then the four that waited, in one write
    assert stream.writes[0] == wire.frame_prefix(5) + b"first"
    assert await _frames_of(stream, len(sent)) == sent


async def test_a_slow_client_holds_back_the_sender_and_no_write_exceeds_the_bound() -> None:
    stream = _Stream()
    stream.hold = trio.Event()
    send, frames = trio.open_memory_channel[bytes](WAITING_FRAMES)
    total = 3 * WAITING_FRAMES
    queued = 0

    async def sender() -> None:
        nonlocal queued
        async with send:
            for i in range(total):
                await send.send(i.to_bytes(2, "big"))
                queued = i + 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_frames, stream, frames)
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        # a write in flight (at most the bound), the channel full, the sender waiting
        assert WAITING_FRAMES < queued <= 2 * WAITING_FRAMES
        stream.hold.set()
    counts = [len(await _frames_of(_replay(w), _count(w))) for w in stream.writes]
    assert sum(counts) == total
    assert max(counts) <= WAITING_FRAMES
    assert await _frames_of(stream, total) == [i.to_bytes(2, "big") for i in range(total)]


def _count(data: bytes) -> int:
    """How many length-prefixed messages ``data`` holds."""
    n, at = 0, 0
    while at < len(data):
        at += 4 + int.from_bytes(data[at : at + 4], "big")
        n += 1
    return n


def _replay(data: bytes) -> _Stream:
    stream = _Stream()
    stream._read += data
    return stream
