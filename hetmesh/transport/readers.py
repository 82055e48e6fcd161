"""Blocking frame readers for socket links: :class:`BufferedReader` (plain) and
:class:`SealedReader` (sealed records, :mod:`~hetmesh.transport.sealed`).

A reader reads whole frames from a stream socket into pooled tensors, for a
link's reader thread or a stage loop's worker thread (``receive_blocking``).
Imports neither trio nor libp2p.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from hetmesh.errors import LocalProtocolError, StreamReset
from hetmesh.transport.codec import BufferPool
from hetmesh.transport.frames import (
    PREFIX_BYTES,
    Frame,
    Limits,
    Pending,
    parse_header,
    parse_prefix,
)
from hetmesh.transport.sealed import RECORD_OVERHEAD, OpenedSocket


def spin_recv_into(sock: socket.socket, target: memoryview, spin_ns: int) -> int:
    """Poll ``sock`` (non-blocking ``recv_into``) for up to ``spin_ns``; -1 if nothing came.

    Waking a thread blocked in ``recv`` costs tens of µs on a shared VM (the
    wake-up, then cache-cold Python): a receiver that expects a reply soon
    polls first. Only the blocking API does this, from a thread that would
    otherwise sleep; it burns at most ``spin_ns`` of CPU per receive.
    """
    deadline = time.perf_counter_ns() + spin_ns
    while True:
        try:
            return sock.recv_into(target, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter_ns() > deadline:
                return -1
            os.sched_yield()  # a peer on this same CPU runs now instead of waiting for us


class BufferedReader:
    """Blocking reads of whole frames from a stream socket into pooled tensors.

    Small reads (prefix, header, small payloads) go through one staging
    buffer so an 8 KiB frame costs one ``recv``; large payloads are read with
    ``recv_into`` straight into the destination tensor.
    """

    def __init__(self, sock: socket.socket, limits: Limits, pool: BufferPool) -> None:
        self._sock = sock
        self._limits = limits
        self._pool = pool
        self._buf = bytearray(256 << 10)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self.bytes_read = 0
        self.spin_ns = 0  # poll this long before a blocking recv (see ThreadedLink.start)

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        target = self._view[self._end :]
        try:
            got = spin_recv_into(self._sock, target, self.spin_ns) if self.spin_ns else -1
            if got < 0:
                got = self._sock.recv_into(target)
        except OSError as exc:
            raise StreamReset(f"connection broken: {exc}") from exc
        if got == 0:
            raise StreamReset("peer closed the connection")
        self._end += got
        self.bytes_read += got

    def read_small(self, n: int) -> bytes:
        while self._end - self._start < n:
            if n > len(self._buf):
                raise LocalProtocolError("read_small is for reads below the staging size")
            self._fill()
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    def read_into(self, target: memoryview) -> None:
        have = min(self._end - self._start, len(target))
        target[:have] = self._view[self._start : self._start + have]
        self._start += have
        got = have
        while got < len(target):
            if len(target) - got < (64 << 10):
                self._fill()
                n = min(self._end - self._start, len(target) - got)
                target[got : got + n] = self._view[self._start : self._start + n]
                self._start += n
                got += n
                continue
            try:
                n = self._sock.recv_into(target[got:])
            except OSError as exc:
                raise StreamReset(f"connection broken: {exc}") from exc
            if n == 0:
                raise StreamReset("peer closed the connection mid-frame")
            got += n
            self.bytes_read += n

    def read_pending(self) -> Pending:
        """Read and check one frame's head (the payload stays unread).

        :class:`RemoteProtocolError` for a bad head, :class:`StreamReset` if the peer goes.
        """
        while self._end - self._start < PREFIX_BYTES:
            self._fill()
        head = parse_prefix(self._buf, self._limits, self._start)
        self._start += PREFIX_BYTES
        n = head.header_bytes
        if n > len(self._buf):
            header = bytearray(n)
            self.read_into(memoryview(header))
            return parse_header(head, header, self._limits)
        while self._end - self._start < n:
            self._fill()
        start = self._start
        self._start += n
        return parse_header(head, self._view[start : self._start], self._limits)

    def read_frame(self) -> Frame:
        pending = self.read_pending()
        if not pending.specs:
            return pending.build()
        buffers: list[torch.Tensor] = []
        try:
            for spec in pending.specs:
                buffer, view = self._pool.acquire_view(spec)
                buffers.append(buffer)
                self.read_into(view)
        except BaseException:
            for b in buffers:
                self._pool.release(b)
            raise
        return pending.build(buffers)


class SealedReader(BufferedReader):
    """A sealed link's reader (:mod:`~hetmesh.transport.sealed`): a record that arrives
    whole with nothing held (a decode step's frame) is opened by the read itself, into
    the staging buffer (:meth:`OpenedSocket.open_alone`); the rest reads through the
    :class:`OpenedSocket`. A plain read's steps plus one AES-GCM call per frame."""

    def __init__(self, sock: socket.socket, key: bytes, limits: Limits, pool: BufferPool) -> None:
        self._opened = OpenedSocket(sock, key)
        self._raw_sock = sock
        super().__init__(self._opened, limits, pool)  # type: ignore[arg-type]

    def _receive(self) -> int:
        """One raw ``recv`` into the opened socket's buffer (it holds nothing)."""
        sock, raw = self._raw_sock, self._opened.raw
        try:
            got = spin_recv_into(sock, raw, self.spin_ns) if self.spin_ns else -1
            if got < 0:
                got = sock.recv_into(raw)
        except OSError as exc:
            raise StreamReset(f"connection broken: {exc}") from exc
        if got == 0:
            raise StreamReset("peer closed the connection")
        return got

    def _fill(self) -> None:
        opened = self._opened
        if self._start == self._end and opened.idle:
            size = opened.open_alone(self._receive(), self._view)
            if size:
                self._start, self._end = 0, size
                self.bytes_read += size
                return
        super()._fill()

    def read_frame(self) -> Frame:
        """A frame that comes as one record of a layout seen before opens straight into
        its tensor (:meth:`OpenedSocket.land`); one that came alone teaches its layout."""
        opened = self._opened
        if self._start != self._end or not opened.idle:
            return super().read_frame()
        got = self._receive()
        size = opened.land(got, self._pool, self._limits, self._view)
        if not isinstance(size, int):
            self.bytes_read += got - RECORD_OVERHEAD
            return size
        if not size:  # held: read through the opened socket
            return super().read_frame()
        self._start, self._end = 0, size
        self.bytes_read += size
        before = self.bytes_read
        pending = self.read_pending()
        lead = self._start  # the head's bytes, if no more were read
        buffers: list[torch.Tensor] = []
        try:
            for spec in pending.specs:
                buffer, view = self._pool.acquire_view(spec)
                buffers.append(buffer)
                self.read_into(view)
        except BaseException:
            for b in buffers:
                self._pool.release(b)
            raise
        if len(buffers) == 1 and self.bytes_read == before and self._start == size:
            opened.learn(got, lead, pending.specs[0], self._pool)  # the record was this frame
        return pending.build(buffers)


__all__ = ["BufferedReader", "SealedReader", "spin_recv_into"]
