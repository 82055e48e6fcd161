"""Links: one long-lived, authenticated data-plane connection between two peers.

Every backend gives the same small async interface (:class:`Link`):
``send(frame)``, ``receive() -> frame``, ``release(frame)``,
``statistics()``, ``aclose()``. A received frame's tensors live in pooled
(or shared) memory and stay valid until ``release(frame)``.

Socket backends (tcp, shm, torchdist) run a dedicated blocking reader thread
per link that reads each frame straight into pooled tensors and hands it to
trio with one ``run_sync_soon``; sends try a non-blocking ``sendmsg`` from the
trio thread first and only fall back to a worker thread when the socket
buffer is full. Measured (docs/benchmarks.md): trio's own socket loop adds
~100 µs per message, the reader thread a few µs.

The blocking API (``send_blocking`` / ``receive_blocking``, for a stage loop
in its own worker thread) is the latency path: one ``sendmsg`` per frame
(header + tensor memory), one ``recv_into`` per small frame, and a receive
that polls the socket for ``spin_us`` before sleeping in the kernel, because
on this kind of VM a wake-up from a blocking ``recv`` plus the cache-cold
Python after it costs more than the frame codec itself.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import fcntl
import logging
import math
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import torch
import trio

from hetmesh.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    StreamReset,
    TransportError,
)
from hetmesh.transport.codec import BufferPool
from hetmesh.transport.frames import (
    DEFAULT_LIMITS,
    NEED_DATA,
    Decoder,
    Frame,
    Goodbye,
    Limits,
    encode,
    encode_parts,
    flat_bytes,
)
from hetmesh.transport.negotiation import Backend
from hetmesh.transport.priority import data_path_thread
from hetmesh.transport.readers import BufferedReader as BufferedReader
from hetmesh.transport.readers import SealedReader as SealedReader
from hetmesh.transport.readers import spin_recv_into as spin_recv_into
from hetmesh.transport.sealed import SMALL_BYTES, Sealer
from hetmesh.transport.threads import in_thread as in_thread
from hetmesh.transport.threads import in_thread_always

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# blocking (send, receive) of whole frames, for a handshake before a link exists
SendFrame = Callable[[Frame], None]
ReceiveFrame = Callable[[], Frame]


class ByteStream(Protocol):
    """What the data plane needs of a control stream (trio streams, ``Libp2pStream``)."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def receive_some(self, max_bytes: int) -> bytes | bytearray: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStatistics:
    """Counters of one link, kept by :class:`Link` itself (no backend counts on its own).

    ``frames_*``: frames handed to / returned by the link's API (a cancelled or
    failed send is not counted). ``bytes_sent``: encoded bytes of each frame
    sent (prefix + header + tensor bytes, what :func:`encode` produces);
    ``bytes_received``: tensor bytes of each frame received.
    """

    backend: str
    reason: str
    remote_peer_id: str
    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    in_use_bytes: int  # received tensor bytes not yet released
    cached_bytes: int  # pooled receive buffers kept for reuse
    errors: int
    closed: bool


class LinkMode(enum.Enum):
    """How a socket link's frames are received; fixed for the link's life."""

    ASYNC = "async"  # receive() from trio: a reader thread hands frames over
    BLOCKING = "blocking"  # receive_blocking() from one worker thread, which reads itself


class Link(abc.ABC):
    """One long-lived data-plane link to a peer; every backend subclasses it.

    Not constructed directly: :class:`~hetmesh.transport.dataplane.DataPlane`
    opens links. One task may send while another receives; concurrent sends
    are serialised. Every error below is fatal to this link only and is for
    the link's owner to handle (close the link; reroute or reconnect).

    ``send(frame)``
        Returns once the frame is handed to the backend; its tensors may then
        be reused. Raises :class:`StreamReset` if the link is closed or the
        peer is gone, :class:`LocalProtocolError` for a frame that cannot be
        encoded (nothing is sent; the link stays usable),
        :class:`TransportError` for other failures (shm: segment budget
        exhausted). Cancellation: socket backends (tcp, shm, torchdist)
        finish writing a frame they started in the background, so the peer
        gets it whole and the link stays usable (the frame is not counted);
        on a byte stream (libp2p) part of the frame may already be out, so a
        cancelled send fails the link: later calls raise :class:`StreamReset`.
    ``receive() -> Frame``
        The next frame, in the order sent. Its tensors live in pooled or
        shared memory until :meth:`release`. Raises :class:`StreamReset` when
        the link was closed by us, the peer vanished (also mid-frame: partial
        buffers are released first) or an earlier receive failed;
        :class:`RemoteProtocolError` for malformed input (later receives then
        raise :class:`StreamReset`). A peer's :meth:`aclose` arrives as a
        :class:`Goodbye` frame, and the receive after it raises
        :class:`StreamReset`. Cancellation: socket backends lose nothing (the
        next receive returns the frame the cancelled one would have), as does
        a libp2p link over a cancel-safe byte stream (trio's); over a real
        libp2p stream, whose read may drop bytes when cancelled
        (:class:`~hetmesh.transport.p2p.Libp2pStream`), a cancelled receive
        fails the link: later receives raise :class:`StreamReset`, never
        return a frame with a gap in it.
    ``send_nowait(frame) -> bool``
        Synchronous, from any thread: writes the frame at once when that cannot
        wait on the peer (the write lock is free and the backend can take the
        whole frame without blocking) and returns True; returns False, having
        written nothing, otherwise (the caller then uses :meth:`send`). Raises
        like :meth:`send`. The stage loop sends from its device thread this
        way, with no hop through trio per frame.
    ``release(frame)``
        Gives a received frame's buffers back. Never raises; tensors of other
        links or already released ones are ignored. Synchronous.
    ``aclose()``
        Sends :class:`Goodbye` (best effort, at most ~1 s, shielded), then
        closes. Idempotent; never raises for a broken link. Cancellation: the
        link is closed all the same.
    ``statistics() -> LinkStatistics``
        Counters (kept here, in one place: :meth:`_count_sent`,
        :meth:`_count_received`, :meth:`_count_failure`) and buffer occupancy.
    """

    backend: ClassVar[Backend]

    def __init__(self, remote_peer_id: str, limits: Limits) -> None:
        self.remote_peer_id = remote_peer_id
        self.reason = ""
        self.limits = limits
        self.pool = BufferPool()
        self._frames_sent = self._frames_received = 0
        self._bytes_sent = self._bytes_received = 0
        self._errors = 0
        self._closed = False
        self._failure: BaseException | None = None  # the error that ended receiving
        self._send_lock = trio.Lock()

    @abc.abstractmethod
    async def send(self, frame: Frame) -> None:
        """Send one frame (see the class docstring for errors and cancellation)."""

    @abc.abstractmethod
    async def receive(self) -> Frame:
        """The next frame from the peer (see the class docstring)."""

    def send_nowait(self, frame: Frame) -> bool:
        """Write ``frame`` now if that cannot wait (see the class docstring); a byte
        stream (libp2p) is written from trio only: always False here."""
        return False

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Say Goodbye and close (see the class docstring)."""

    def release(self, frame: Frame) -> None:
        """Give the frame's receive buffers back (to the pool, or to the sending peer)."""
        for t in frame.tensors_():
            self.pool.release(t)

    # --- accounting and state, for the backends -------------------------------------
    def _count_sent(self, nbytes: int) -> None:
        self._frames_sent += 1
        self._bytes_sent += nbytes

    def _count_received(self, frame: Frame) -> Frame:
        self._frames_received += 1
        for t in frame.tensors_():
            self._bytes_received += t.nbytes
        return frame

    def _count_failure(self, exc: BaseException, *, fatal: bool) -> None:
        """Count an error; a ``fatal`` one ends the link (later calls raise StreamReset)."""
        self._errors += 1
        if fatal and self._failure is None:
            self._failure = exc

    def _check_open(self) -> None:
        """:class:`StreamReset` if we closed the link or an earlier failure ended it."""
        if self._failure is not None:
            raise StreamReset(f"link failed earlier: {self._failure}") from self._failure
        if self._closed:
            raise StreamReset("link closed")

    def statistics(self) -> LinkStatistics:
        pool = self.pool.statistics()
        return LinkStatistics(
            backend=self.backend.value,
            reason=self.reason,
            remote_peer_id=self.remote_peer_id,
            frames_sent=self._frames_sent,
            frames_received=self._frames_received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            in_use_bytes=pool.in_use_bytes,
            cached_bytes=pool.cached_bytes,
            errors=self._errors,
            closed=self._closed,
        )

    async def __aenter__(self) -> Link:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --- blocking socket helpers ---------------------------------------------------------


def _advance(parts: list[memoryview], n: int) -> list[memoryview]:
    while n and parts:
        if n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        else:
            parts[0] = parts[0][n:]
            n = 0
    return parts


def sendmsg_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """Blocking gathering write of every part (loops over partial writes)."""
    parts = [p for p in parts if len(p)]
    while parts:
        n = sock.sendmsg(parts[:512])
        _advance(parts, n)


def try_sendmsg(sock: socket.socket, parts: list[memoryview]) -> list[memoryview]:
    """Write what the kernel takes right now; returns what is left (non-blocking)."""
    parts = [p for p in parts if len(p)]
    while parts:
        try:
            n = sock.sendmsg(parts[:512], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return parts
        _advance(parts, n)
    return parts


def write_frame(sock: socket.socket, frame: Frame, limits: Limits) -> int:
    """Blocking write of one frame with one ``sendmsg`` (more on partial writes); bytes sent."""
    head, buffers, total = encode_parts(frame, limits)
    sent = sock.sendmsg([head, *buffers]) if buffers else sock.send(head)
    if sent < total:
        sendmsg_all(sock, _advance([memoryview(head), *map(flat_bytes, buffers)], sent))
    return total


# --- threaded links ----------------------------------------------------------------


class ThreadedLink(Link):
    """A link over a blocking socket, usable from trio or from one worker thread.

    Async mode (``receive``, the default): a dedicated reader thread reads
    frames and hands each to trio with one ``run_sync_soon``.
    Blocking mode (``receive_blocking`` / ``send_blocking``): the calling
    thread does the I/O itself, with no thread hand-off at all — the fastest
    path for a stage loop that already runs in a worker thread. The mode is
    fixed when the link is opened (``connect/accept(..., blocking=True)``);
    the other receive call raises :class:`LocalProtocolError`;
    sends of both kinds may be mixed and are serialised.
    """

    max_inflight = 8

    def __init__(self, remote_peer_id: str, limits: Limits) -> None:
        super().__init__(remote_peer_id, limits)
        self._token: trio.lowlevel.TrioToken | None = None
        self._send_items, self._receive_items = trio.open_memory_channel[Frame | BaseException](
            math.inf
        )
        self._credit = threading.Semaphore(self.max_inflight)
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._mode: LinkMode | None = None
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        # async mode: the reader thread offers each frame here first; True takes it
        # (released by whoever took it), False hands it to trio as usual
        self.sink: Callable[[Frame], bool] | None = None
        # frames handed to trio (counted by the reader) and received there (by trio):
        # each counter has one writer
        self._handed = self._taken = 0

    def start(self, blocking: bool = False, spin_us: float = 0.0) -> None:
        """Pick the receive mode; async mode starts the reader thread (call from trio).

        ``spin_us`` (blocking mode only): each ``receive_blocking`` polls the
        socket this long before it sleeps in the kernel.
        """
        self._set_mode(LinkMode.BLOCKING if blocking else LinkMode.ASYNC)
        if blocking:
            self._set_spin(int(spin_us * 1000))
            return
        self._token = trio.lowlevel.current_trio_token()
        self._reader = threading.Thread(
            target=self._read_loop, name=f"hetmesh-{self.backend}-reader", daemon=True
        )
        self._reader.start()

    def _set_mode(self, mode: LinkMode) -> None:
        if self._mode is not None and self._mode is not mode:
            raise LocalProtocolError(f"this link already receives in {self._mode.value} mode")
        self._mode = mode

    def _set_spin(self, spin_ns: int) -> None:
        """Subclasses with a pollable receive path take the spin budget."""

    # each socket backend implements these three (blocking, from any one thread)
    @abc.abstractmethod
    def _read_frame_blocking(self) -> Frame:
        """Read one whole frame: StreamReset if the peer is gone, RemoteProtocolError."""

    @abc.abstractmethod
    def _write_blocking(self, frame: Frame) -> int:
        """Write one whole frame; its encoded size in bytes. OSError/TransportError."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Close the socket(s) so a blocked reader returns; never raises."""

    async def _write(self, frame: Frame) -> int:
        """Default: the whole write in a worker thread."""
        return await in_thread(self._write_blocking_locked, frame)

    def _write_blocking_locked(self, frame: Frame) -> int:
        with self._write_lock:
            return self._write_blocking(frame)

    def _read_loop(self) -> None:
        torch.set_num_threads(1)
        data_path_thread()  # it may compute a stage's step (the lane): trio's nice is not its
        while not self._stop.is_set():
            self._credit.acquire()
            item: Frame | BaseException
            try:
                item = self._read_frame_blocking()
            except (TransportError, RemoteProtocolError) as exc:
                item = exc
            except Exception as exc:  # boundary: anything else ends this link only
                log.exception("%s link reader failed", self.backend)
                item = StreamReset(f"reader failed: {exc!r}")
            if self._stop.is_set():
                if isinstance(item, Frame):
                    self.release(item)
                return
            if isinstance(item, Frame) and self._sunk(item):
                continue
            assert self._token is not None
            self._handed += 1
            try:
                self._token.run_sync_soon(self._send_items.send_nowait, item)
            except trio.RunFinishedError:
                return
            if isinstance(item, BaseException):
                return

    def _sunk(self, frame: Frame) -> bool:
        """On the reader thread: whether :attr:`sink` took ``frame``. Only while trio has
        every earlier frame of this link, so frames are taken in the order sent."""
        sink = self.sink
        if sink is None or self._handed != self._taken:
            return False
        try:
            taken = sink(frame)
        except Exception:  # a bug there: the frame goes the usual way
            log.exception("%s link: the frame sink failed", self.backend)
            return False
        if taken:
            self._count_received(frame)
            self._credit.release()
        return taken

    def _account_received(self, item: Frame | BaseException) -> Frame:
        if isinstance(item, BaseException):
            self._count_failure(item, fatal=True)
            raise item
        return self._count_received(item)

    async def receive(self) -> Frame:
        self._check_open()
        self._set_mode(LinkMode.ASYNC)
        if self._reader is None:
            raise LocalProtocolError("link not started")
        item = await self._receive_items.receive()
        self._taken += 1
        self._credit.release()
        return self._account_received(item)

    def receive_blocking(self) -> Frame:
        """Like :meth:`receive`, from a worker thread, doing the read in that thread."""
        if self._mode is not LinkMode.BLOCKING:
            self._set_mode(LinkMode.BLOCKING)
        if self._failure is not None or self._closed:
            self._check_open()
        with self._read_lock:
            try:
                frame = self._read_frame_blocking()
            except (TransportError, RemoteProtocolError) as exc:
                self._count_failure(exc, fatal=True)
                raise
        return self._count_received(frame)

    def send_nowait(self, frame: Frame) -> bool:
        """Write ``frame`` from the calling thread if the write lock is free and the
        backend says the whole frame goes without waiting on the peer; else False."""
        if self._failure is not None or self._closed:
            return False  # send() reports why
        if not self._write_lock.acquire(blocking=False):
            return False  # another write is under way: keep the frames in order behind it
        try:
            if not self._writes_at_once(frame):
                return False
            n = self._write_counted(frame)
        finally:
            self._write_lock.release()
        self._count_sent(n)
        return True

    def _write_counted(self, frame: Frame) -> int:
        """:meth:`_write_blocking`, its failures counted (the caller holds the write lock)."""
        try:
            return self._write_blocking(frame)
        except OSError as exc:
            self._count_failure(exc, fatal=False)
            raise StreamReset(f"send failed: {exc}") from exc
        except TransportError as exc:
            self._count_failure(exc, fatal=False)
            raise

    def _writes_at_once(self, frame: Frame) -> bool:
        """Whether :meth:`_write_blocking` of ``frame`` would not wait on the peer now
        (the caller holds the write lock). Backends that can tell override it."""
        return False

    def send_blocking(self, frame: Frame) -> None:
        """Like :meth:`send`, from a worker thread."""
        if self._failure is not None or self._closed:
            self._check_open()
        with self._write_lock:
            n = self._write_counted(frame)
        self._count_sent(n)

    async def send(self, frame: Frame) -> None:
        if self._closed:
            raise StreamReset("link closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        # nothing queued on trio and the backend takes it now: written before trio
        # schedules anything else (the lock's checkpoint would run every other ready
        # task first: a decode step's hop waited behind them), then the checkpoint
        if not self._send_lock.locked() and self.send_nowait(frame):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        async with self._send_lock:
            try:
                n = await self._write(frame)
            except OSError as exc:
                self._count_failure(exc, fatal=False)
                raise StreamReset(f"send failed: {exc}") from exc
            except TransportError as exc:
                self._count_failure(exc, fatal=False)
                raise
        self._count_sent(n)

    async def aclose(self) -> None:
        if self._closed:
            return
        with (
            trio.CancelScope(deadline=trio.current_time() + 1, shield=True),
            contextlib.suppress(Exception),
        ):
            await self.send(Goodbye(reason="closing"))
        self._closed = True
        self._stop.set()
        self._shutdown()
        self._credit.release()
        reader = self._reader
        if reader is not None:
            await in_thread(reader.join, 2.0)
        while True:
            try:
                item = self._receive_items.receive_nowait()
            except trio.WouldBlock:
                break
            if isinstance(item, Frame):
                self.release(item)


class TcpLink(ThreadedLink):
    """Frames over one TCP (or any stream) socket, read with ``recv_into``."""

    backend = Backend.TCP

    def __init__(
        self,
        sock: socket.socket,
        remote_peer_id: str,
        limits: Limits,
        reader: BufferedReader | None = None,
        keys: tuple[bytes, bytes] | None = None,
    ) -> None:
        """``reader``: the one the handshake read through (it may hold bytes already);
        ``keys``: (send, receive) keys from the handshake, for :meth:`seal`."""
        super().__init__(remote_peer_id, limits)
        self.sock = sock
        self._reader_io = reader or BufferedReader(sock, limits, self.pool)
        self._reader_io._pool = self.pool
        self._keys = keys
        self._sealer: Sealer | None = None
        self._queued_at = _meminfo_queued_at(sock)

    @property
    def encrypted(self) -> bool:
        return self._sealer is not None

    def seal(self) -> None:
        """Encrypt and authenticate every frame from now on (:mod:`~hetmesh.transport.sealed`).

        Both ends call it after the handshake and before the link starts.
        """
        if self._keys is None:
            raise LocalProtocolError("no handshake keys to seal this link with")
        reader = self._reader_io
        if self._mode is not None or reader._start != reader._end:
            raise LocalProtocolError("a link is sealed before it reads or starts")
        send_key, receive_key = self._keys
        self._sealer = Sealer(send_key)
        self._reader_io = SealedReader(self.sock, receive_key, reader._limits, self.pool)

    def _set_spin(self, spin_ns: int) -> None:
        self._reader_io.spin_ns = spin_ns

    def _writes_at_once(self, frame: Frame) -> bool:
        # a small frame into an empty send queue with room for twice its size: the
        # kernel takes it whole, so the write never waits on a slow or frozen peer
        nbytes = tensors_nbytes(frame.tensors_()) + (4 << 10)  # + a generous header
        if nbytes > NOWAIT_MAX_BYTES:
            return False
        try:
            if self._queued_at >= 0:  # one getsockopt: 0.9 µs where these two took 3.8
                info = _MEMINFO.unpack_from(
                    self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size)
                )
                unread: int = info[self._queued_at]
                return unread == 0 and 2 * nbytes <= info[_SNDBUF]
            queued = bytearray(4)
            fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, queued)
            room = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            return False  # closed meanwhile: send() says so
        return int.from_bytes(queued, "little") == 0 and 2 * nbytes <= room

    def _read_frame_blocking(self) -> Frame:
        return self._reader_io.read_frame()

    def _write_blocking(self, frame: Frame) -> int:
        sealer = self._sealer
        if sealer is not None:
            head, buffers, total = encode_parts(frame, self.limits)
            if total <= SMALL_BYTES:  # a decode step's: Sealer.send's first case, inline
                self.sock.sendall(sealer.seal_frame(head, buffers, total))
            else:
                sealer.send(self.sock, head, buffers, total)
            return total
        return write_frame(self.sock, frame, self.limits)

    async def _write(self, frame: Frame) -> int:
        if self._sealer is not None:
            return await self._write_sealed(frame, self._sealer)
        if not self._write_lock.acquire(blocking=False):
            return await in_thread(self._write_blocking_locked, frame)
        try:
            head, buffers, total = encode_parts(frame, self.limits)
            try:
                sent = self.sock.sendmsg([head, *buffers], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            left = []
            if sent < total:
                parts = [memoryview(head), *map(flat_bytes, buffers)]
                left = try_sendmsg(self.sock, _advance(parts, sent))
        except BaseException:
            self._write_lock.release()
            raise
        return await self._send_rest_locked(left, total)

    async def _write_sealed(self, frame: Frame, sealer: Sealer) -> int:
        """Small frames are sealed on the trio thread and sent without blocking if the
        socket takes them; large ones are sealed and sent in a worker thread."""
        if tensors_nbytes(frame.tensors_()) > (64 << 10) or not self._write_lock.acquire(
            blocking=False
        ):
            return await in_thread(self._write_blocking_locked, frame)
        try:
            head, buffers, total = encode_parts(frame, self.limits)
            left = try_sendmsg(self.sock, [sealer.seal_frame(head, buffers, total)])
        except BaseException:
            self._write_lock.release()
            raise
        return await self._send_rest_locked(left, total)

    async def _send_rest_locked(self, left: list[memoryview], total: int) -> int:
        """Send what the socket did not take at once (in a worker thread), then release
        the write lock, which the caller holds; returns ``total``."""
        if not left:
            self._write_lock.release()
            return total

        def finish() -> None:
            try:
                sendmsg_all(self.sock, left)
            finally:
                self._write_lock.release()

        # part of the frame is on the wire: the rest goes even if this send is
        # cancelled (before, a cancel that came first left the lock held for good)
        await in_thread_always(finish)
        return total

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


NOWAIT_MAX_BYTES = 64 << 10  # TcpLink.send_nowait writes frames up to this size

# Linux's SO_MEMINFO: a socket's memory counters, in one getsockopt
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)
_MEMINFO = struct.Struct("=6I")  # rmem_alloc, rcvbuf, wmem_alloc, sndbuf, fwd_alloc, wmem_queued
_SNDBUF = 3


def _meminfo_queued_at(sock: socket.socket) -> int:
    """Where SO_MEMINFO says how many sent bytes the peer has yet to take (what TIOCOUTQ
    says): TCP's write queue, acknowledged bytes gone (wmem_queued, 0 exactly when
    TIOCOUTQ is), or a Unix socket's bytes unread (wmem_alloc); -1 where SO_MEMINFO
    is missing."""
    try:
        if len(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size)) < _MEMINFO.size:
            return -1
    except OSError:
        return -1
    return 5 if sock.family in (socket.AF_INET, socket.AF_INET6) else 2


def tune_tcp(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def blocking_framer(
    sock: socket.socket, limits: Limits, reader: BufferedReader
) -> tuple[SendFrame, ReceiveFrame]:
    """``(send, receive)`` for the handshake on a blocking stream socket.

    The link opened on ``sock`` afterwards must take over ``reader``: bytes the
    peer sent right after its last handshake frame may already sit in it.
    """

    def send(frame: Frame) -> None:
        sendmsg_all(sock, [memoryview(p) for p in encode(frame, limits)])

    return send, reader.read_frame


# --- links over an async byte stream (libp2p) ---------------------------------------


class FramedStream:
    """Frames over any trio-style byte stream (``send_all`` / ``receive_some`` / ``aclose``)."""

    def __init__(
        self,
        stream: ByteStream,
        limits: Limits = DEFAULT_LIMITS,
        pool: BufferPool | None = None,
        *,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        self.stream = stream
        self.limits = limits
        self.pool = pool or BufferPool()
        self._decoder = Decoder(limits, allocate=self.pool.acquire, release=self.pool.release)
        self._chunk = chunk_bytes

    async def send(self, frame: Frame) -> int:
        total = 0
        try:
            for part in encode(frame, self.limits):
                view = memoryview(part)
                for i in range(0, len(view), self._chunk):
                    await self.stream.send_all(bytes(view[i : i + self._chunk]))
                total += len(view)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise StreamReset(f"stream broken while sending: {exc!r}") from exc
        return total

    async def receive(self) -> Frame:
        while True:
            frame = self._decoder.next_frame()
            if frame is not NEED_DATA:
                assert isinstance(frame, Frame)
                return frame
            try:
                data = await self.stream.receive_some(self._chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._decoder.abort()
                raise StreamReset(f"stream broken: {exc!r}") from exc
            except trio.Cancelled:
                raise  # no byte is lost: the next receive resumes the partial frame
            except BaseException:
                self._decoder.abort()
                raise
            if not data:
                mid = self._decoder.in_frame
                self._decoder.abort()
                raise StreamReset("peer closed the stream" + (" mid-frame" if mid else ""))
            self._decoder.receive_data(data)


class StreamLink(Link):
    """A link over an async byte stream: the encrypted libp2p fallback."""

    backend = Backend.LIBP2P

    def __init__(self, framed: FramedStream, remote_peer_id: str) -> None:
        super().__init__(remote_peer_id, framed.limits)
        self.pool = framed.pool
        self._framed = framed
        self._receive_lock = trio.Lock()
        self._send_cut = False  # a cancelled send left part of a frame on the stream

    async def send(self, frame: Frame) -> None:
        async with self._send_lock:
            if self._closed or self._send_cut:
                self._check_open()
            try:
                n = await self._framed.send(frame)
            except TransportError as exc:
                self._count_failure(exc, fatal=False)
                raise
            except trio.Cancelled:
                # part of the frame may be on the stream, so nothing can follow it
                self._send_cut = True
                self._count_failure(StreamReset("a send was cancelled part-way"), fatal=True)
                raise
        self._count_sent(n)

    async def receive(self) -> Frame:
        self._check_open()
        async with self._receive_lock:
            self._check_open()
            try:
                frame = await self._framed.receive()
            except (TransportError, RemoteProtocolError) as exc:
                self._count_failure(exc, fatal=True)
                raise
        return self._count_received(frame)

    async def aclose(self) -> None:
        if self._closed:
            return
        with trio.CancelScope(deadline=trio.current_time() + 1, shield=True):
            if not self._send_cut:  # after part of a frame, a Goodbye would be garbage
                with contextlib.suppress(Exception):
                    await self.send(Goodbye(reason="closing"))
            self._closed = True
            with contextlib.suppress(Exception):
                await self._framed.stream.aclose()
        self._closed = True


def now_ns() -> int:
    """Monotonic clock shared by processes on one host (for one-way latency)."""
    return time.perf_counter_ns()


def tensors_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)
