"""Same-host links: tensors handed over in shared memory, a doorbell on a unix socket.

Each side owns the ``memfd`` segments it sends from. A tensor payload lives
in one segment (size rounded up to a power of two, at least 64 KiB); a
segment's file descriptor travels once, with ``SCM_RIGHTS``, on the
``SOCK_SEQPACKET`` doorbell socket, and the receiver maps it once. A frame on
the doorbell is the frame's normal prefix+header plus the segment ids; the
receiver's tensors are views of its mapping (no copy), valid until
``release(frame)``, which tells the sender the segments are free again.

Zero-copy send: write the payload straight into :meth:`ShmLink.allocate`'s
tensor, then send it; any other tensor is copied into a segment once. The
sender must not touch a tensor's segment after sending it. Total segment
memory is capped (``budget_bytes``); a send waits for releases when full.

A same-host peer is trusted with nothing it could use to take the receiver
down: segments are sealed against shrinking and growing before their
descriptor leaves (``F_SEAL_SHRINK``: a truncated mapping would SIGBUS the
reader), the receiver maps only sealed memfds, and at most
``budget_bytes`` in ``MAX_SEGMENTS`` segments of a peer's per link (what an
honest sender with the same budget can own), and twice that over all of one
peer's links together (:class:`PeerMappings`: a peer opening many links gets
no more of our address space).

Per handoff: one doorbell packet each way (the frame; later a release),
none back for a frame whose tensors are all small (up to ``INLINE_BYTES`` each:
they travel inside the doorbell packet, copied once on each side),
no fd once a segment is known, the receiver's tensor views of a segment
cached by layout, and in blocking mode a receive that polls the doorbell
for ``spin_us`` before sleeping on it.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
import sys
import termios
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import msgpack
import torch

from hetmesh.errors import LocalProtocolError, RemoteProtocolError, StreamReset, TransportError
from hetmesh.transport.codec import DTYPES, ITEMSIZE, TensorSpec, as_tensor
from hetmesh.transport.frames import (
    Frame,
    Limits,
    decode_all,
    encode,
    encode_parts,
    flat_bytes,
    pack,
)
from hetmesh.transport.links import (
    LinkMode,
    LinkStatistics,
    ReceiveFrame,
    SendFrame,
    ThreadedLink,
    in_thread,
)
from hetmesh.transport.negotiation import Backend
from hetmesh.transport.shm_doorbell import (
    _FRAME,
    _RELEASE,
    INLINE_BYTES,
    INLINE_FRAME_BYTES,
    MAX_PACKET,
    parse_doorbell,
)

MIN_SEGMENT = 64 << 10
MAX_SEGMENTS = 4096  # per side of a link: mappings are a per-process kernel resource
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def segment_size(nbytes: int) -> int:
    return max(MIN_SEGMENT, 1 << max(0, nbytes - 1).bit_length())


@dataclass(slots=True)
class _Segment:
    seg_id: int
    size: int
    fd: int  # ours (sender side) to close; -1 for a peer's segment, closed once mapped
    map: mmap.mmap
    buffer: torch.Tensor  # uint8 view of the whole mapping
    view: memoryview  # byte view of the whole mapping
    # receiver side: tensor views of this segment by (dtype, shape), reused for the next
    # frame of the same layout (three torch view ops per tensor otherwise)
    tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)


def new_segment_fd(seg_id: int, size: int) -> int:
    """A memfd of ``size`` bytes, sealed so that no one can change its size again."""
    fd = os.memfd_create(f"hetmesh-{seg_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed(fd: int) -> bool:
    """Whether ``fd`` is a file whose size can no longer shrink (a sealed memfd)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memfd (or a file system without seals)
        return False
    return bool(seals & fcntl.F_SEAL_SHRINK)


def _map(fd: int, size: int, seg_id: int, *, owned: bool) -> _Segment:
    """Map a memfd; an ``owned`` one keeps its descriptor (to pass on), a peer's does not.

    A peer's descriptor is closed by the receive path right after mapping (the
    mapping stays valid): keeping its number would close whatever file reuses
    it later.
    """
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
    return _Segment(seg_id, size, fd if owned else -1, mapping, buffer, memoryview(mapping))


_MAX_VIEWS = 8  # cached tensor layouts per received segment


def _owned_bytes(data: bytes) -> torch.Tensor:
    """A ``uint8`` tensor of its own holding ``data`` (an inline payload: one copy)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _recv_fds(sock: socket.socket, flags: int) -> tuple[bytes, list[int], int]:
    """``recvmsg`` with passed file descriptors (``socket.recv_fds`` ignores ``flags``)."""
    data, ancillary, out_flags, _ = sock.recvmsg(
        MAX_PACKET, socket.CMSG_LEN(64 * array.array("i").itemsize), flags
    )
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    return data, list(fds), out_flags


def packet_framer(sock: socket.socket, limits: Limits) -> tuple[SendFrame, ReceiveFrame]:
    """``(send, receive)`` of whole frames, one per packet (handshake phase)."""

    def send(frame: Frame) -> None:
        sock.sendmsg([memoryview(p) for p in encode(frame, limits)])

    def receive() -> Frame:
        data = sock.recv(MAX_PACKET)
        if not data:
            raise StreamReset("peer closed the doorbell socket")
        frames = decode_all(data, limits)
        if len(frames) != 1:
            raise RemoteProtocolError("one frame per packet expected")
        return frames[0]

    return send, receive


class PeerMappings:
    """Segments and bytes mapped from each peer over all its shm links (thread-safe:
    links map on their reader threads). Refuses past ``max_segments`` / ``max_bytes``
    a peer; a link gives its share back when it shuts down."""

    def __init__(self, max_segments: int, max_bytes: int) -> None:
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}  # peer -> (segments, bytes)

    def take(self, peer: str, segments: int, nbytes: int) -> bool:
        with self._lock:
            held_segments, held_bytes = self._held.get(peer, (0, 0))
            if held_segments + segments > self.max_segments:
                return False
            if held_bytes + nbytes > self.max_bytes:
                return False
            self._held[peer] = (held_segments + segments, held_bytes + nbytes)
            return True

    def give_back(self, peer: str, segments: int, nbytes: int) -> None:
        with self._lock:
            held_segments, held_bytes = self._held.pop(peer, (0, 0))
            left = (held_segments - segments, held_bytes - nbytes)
            if left[0] > 0:
                self._held[peer] = left

    def held(self, peer: str) -> tuple[int, int]:
        with self._lock:
            return self._held.get(peer, (0, 0))


class ShmLink(ThreadedLink):
    """Frames whose tensors travel in shared memory (see the module docstring)."""

    backend = Backend.SHM

    def __init__(
        self,
        sock: socket.socket,
        remote_peer_id: str,
        limits: Limits,
        *,
        budget_bytes: int = 2 << 30,
        wait_s: float = 30.0,
        mappings: PeerMappings | None = None,
    ) -> None:
        super().__init__(remote_peer_id, limits)
        self._mappings = mappings  # shared by the peer's links: its total is bounded
        self.sock = sock
        self._sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        # HETMESH_SHM_INLINE=0: every tensor through a segment (for comparisons); a
        # receiver takes inline payloads either way
        self._inline_bytes = INLINE_BYTES if os.environ.get("HETMESH_SHM_INLINE") != "0" else -1
        self._budget = budget_bytes
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._own: dict[int, _Segment] = {}
        self._free: dict[int, list[int]] = {}
        self._own_bytes = 0
        self._next_id = 1
        self._announced: set[int] = set()
        self._allocated: dict[int, int] = {}  # data_ptr -> own seg id, allocated not yet sent
        self._remote: dict[int, _Segment] = {}
        self._remote_bytes = 0  # mapped from the peer: at most budget_bytes
        self._lent: dict[int, int] = {}  # a received tensor's data_ptr -> seg id (0: inline)
        self._lent_bytes = 0
        self._early: deque[Frame] = deque()
        self._pending_release: list[int] = []
        self._spin_ns = 0

    # --- sender side -----------------------------------------------------------
    def _take_segment(self, nbytes: int) -> _Segment:
        size = segment_size(nbytes)
        self._drain_nowait()
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while True:
                free = self._free.get(size)
                if free:
                    return self._own[free.pop()]
                if self._own_bytes + size <= self._budget and len(self._own) < MAX_SEGMENTS:
                    break
                if time.monotonic() > deadline:
                    raise TransportError("shared-memory budget exhausted: peer does not release")
                # blocking mode has no reader thread: poll the doorbell for releases ourselves
                self._cond.wait(0.005 if self._mode is LinkMode.BLOCKING else self._wait_s)
                self._cond.release()
                try:
                    self._drain_nowait()
                finally:
                    self._cond.acquire()
            seg_id = self._next_id
            self._next_id += 1
            self._own_bytes += size
        fd = new_segment_fd(seg_id, size)
        segment = _map(fd, size, seg_id, owned=True)
        with self._cond:
            self._own[seg_id] = segment
        return segment

    def allocate(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor in shared memory: fill it, then send it without any copy."""
        name = next((k for k, v in DTYPES.items() if v == dtype), None)
        if name is None:
            raise LocalProtocolError(f"dtype {dtype} is not sendable")
        nbytes = ITEMSIZE[name] * int(torch.Size(shape).numel())
        segment = self._take_segment(nbytes)
        tensor = segment.buffer[:nbytes].view(dtype).view(shape)
        if nbytes:
            self._allocated[tensor.data_ptr()] = segment.seg_id
        return tensor

    def _write_blocking(self, frame: Frame) -> int:
        head, buffers, total = encode_parts(frame, self.limits)
        seg_ids: list[int | memoryview] = []
        new: list[list[int]] = []
        fds: list[int] = []
        if buffers:
            allocated = self._allocated
            inline = INLINE_FRAME_BYTES
            for tensor, buffer in zip(frame.tensors_(), buffers, strict=True):
                seg_id = allocated.pop(tensor.data_ptr(), None) if tensor.nbytes else None
                if seg_id is None and tensor.nbytes <= min(self._inline_bytes, inline):
                    inline -= tensor.nbytes  # in the packet: nothing to give back
                    seg_ids.append(flat_bytes(buffer))  # packed as bin, like bytes: no copy
                    continue
                if seg_id is None:  # not from allocate(): one copy into a segment
                    data = flat_bytes(buffer)
                    segment = self._take_segment(len(data))
                    segment.view[: len(data)] = data
                    seg_id = segment.seg_id
                seg_ids.append(seg_id)
                if seg_id not in self._announced:
                    self._announced.add(seg_id)
                    segment = self._own[seg_id]
                    new.append([seg_id, segment.size])
                    fds.append(segment.fd)
        packet = pack([_FRAME, head, seg_ids, new])
        if len(packet) > MAX_PACKET:
            raise LocalProtocolError("frame header too large for the shm doorbell")
        if fds:
            socket.send_fds(self.sock, [packet], fds)
        else:
            self.sock.send(packet)
        return total

    async def _write(self, frame: Frame) -> int:
        # inline only when it cannot wait: a peer that releases nothing (frozen) would
        # otherwise hold the event loop in _take_segment for up to wait_s
        if self._write_lock.acquire(blocking=False):
            try:
                if self._writes_at_once(frame):
                    return self._write_blocking(frame)
            finally:
                self._write_lock.release()
        return await in_thread(self._write_blocking_locked, frame)

    def _writes_at_once(self, frame: Frame) -> bool:
        copy = 0
        inline = False
        for t in frame.tensors_():
            if t.data_ptr() not in self._allocated:
                copy += t.nbytes
                inline = inline or t.nbytes <= self._inline_bytes
        if inline and not self._doorbell_has_room():
            return False  # a worker thread waits for the peer to read (cancellable)
        return copy < (1 << 20) and self._segments_free_now(frame)

    def _doorbell_has_room(self) -> bool:
        """Whether a packet written now cannot block. Inline payloads make the
        doorbell, not the segment budget, what a peer that stops reading fills: the
        kernel makes a send wait only while this socket's unread packets fill its
        send buffer (the caller holds the write lock: nobody else adds to them)."""
        queued = int.from_bytes(
            fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, bytes(4)), sys.byteorder, signed=True
        )
        return queued + INLINE_FRAME_BYTES < self._sndbuf  # one more frame, with room

    def _segments_free_now(self, frame: Frame) -> bool:
        """Whether every segment ``frame``'s copies need is free or within the budget
        now (the caller holds the write lock: nobody else takes segments meanwhile)."""
        needed: dict[int, int] = {}
        inline = INLINE_FRAME_BYTES
        for t in frame.tensors_():
            if t.data_ptr() not in self._allocated and t.nbytes <= min(self._inline_bytes, inline):
                inline -= t.nbytes  # in the packet (as _write_blocking decides)
                continue
            if not t.nbytes or t.data_ptr() not in self._allocated:
                size = segment_size(t.nbytes)
                needed[size] = needed.get(size, 0) + 1
        if not needed:
            return True
        with self._cond:
            room, count = self._budget - self._own_bytes, len(self._own)
            for size, n in needed.items():
                new = max(0, n - len(self._free.get(size, ())))
                room -= new * size
                count += new
        return room >= 0 and count <= MAX_SEGMENTS

    def _on_release(self, seg_ids: list[object]) -> None:
        with self._cond:
            for seg_id in seg_ids:
                if type(seg_id) is not int or (segment := self._own.get(seg_id)) is None:
                    raise RemoteProtocolError("release of an unknown segment")
                self._free.setdefault(segment.size, []).append(seg_id)
            self._cond.notify_all()

    # --- receiver side ---------------------------------------------------------
    def _drain_nowait(self) -> None:
        """Blocking mode: process the packets already waiting (releases; frames are kept)."""
        self._flush_releases()
        if self._mode is not LinkMode.BLOCKING or not self._read_lock.acquire(blocking=False):
            return
        try:
            while True:
                frame = self._read_packet(socket.MSG_DONTWAIT)
                if frame is False:
                    return
                if isinstance(frame, Frame):
                    self._early.append(frame)
        finally:
            self._read_lock.release()

    def _set_spin(self, spin_ns: int) -> None:
        self._spin_ns = spin_ns

    def _read_frame_blocking(self) -> Frame:
        if self._pending_release:
            self._flush_releases()
        if self._early:
            return self._early.popleft()
        while True:
            frame: Frame | bool | None = False
            if self._spin_ns:  # poll the doorbell before sleeping on it
                deadline = time.perf_counter_ns() + self._spin_ns
                while frame is False and time.perf_counter_ns() < deadline:
                    frame = self._read_packet(socket.MSG_DONTWAIT)
                    if frame is False:
                        os.sched_yield()  # let a peer on this same CPU run
            if frame is False:
                frame = self._read_packet(0)
            if isinstance(frame, Frame):
                return frame

    def _read_packet(self, flags_in: int) -> Frame | bool | None:
        """One doorbell packet: a frame, None (a release), False (nothing waiting)."""
        while True:
            try:
                data, fds, flags = _recv_fds(self.sock, flags_in)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise StreamReset(f"doorbell socket broken: {exc}") from exc
            try:
                if not data:
                    raise StreamReset("peer closed the doorbell socket")
                if flags & socket.MSG_TRUNC or flags & socket.MSG_CTRUNC:
                    raise RemoteProtocolError("truncated doorbell packet")
                return self._on_packet(data, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _on_packet(self, data: bytes, fds: list[int]) -> Frame | None:
        """Handle one doorbell packet: a frame (returned) or a release (None).

        The whole packet (frame head, segment ids, new segment descriptors and
        their passed files) is checked before any descriptor is mapped, so a
        bad packet maps nothing. :class:`RemoteProtocolError` on any fault.
        """
        packet = parse_doorbell(data, len(fds), self.limits)
        if isinstance(packet, list):
            self._on_release(packet)
            return None
        pending, seg_ids, new = packet
        if new:
            self._map_new(new, fds, seg_ids, pending.specs)
        remote = self._remote
        tensors = []
        lent: list[int] = []
        for seg_id, spec in zip(seg_ids, pending.specs, strict=True):
            if type(seg_id) is bytes:  # in the packet (checked by parse_doorbell)
                lent.append(0)  # nothing to give back on release
                tensors.append(as_tensor(_owned_bytes(seg_id), spec))
                continue
            segment = remote.get(seg_id) if type(seg_id) is int else None
            # nothing is mapped here: a bad id fails the packet with nothing changed
            if segment is None or spec.nbytes > segment.size:
                raise RemoteProtocolError("tensor does not fit its segment")
            lent.append(segment.seg_id)
            key = (spec.dtype, spec.shape)
            tensor = segment.tensors.get(key)
            # a receiver may have changed a view in place (squeeze_, requires_grad_): check
            if tensor is None or tensor.shape != spec.shape or tensor.requires_grad:
                if len(segment.tensors) >= _MAX_VIEWS:
                    segment.tensors.clear()
                tensor = segment.tensors[key] = as_tensor(segment.buffer, spec)
            tensors.append(tensor)
        frame = pending.build(tensors)
        if tensors:
            with self._cond:
                for t, seg_id in zip(tensors, lent, strict=True):
                    self._lent[t.data_ptr()] = seg_id
                    self._lent_bytes += t.nbytes
        return frame

    def _map_new(
        self,
        new: list[list[int]],
        fds: list[int],
        seg_ids: list[object],
        specs: tuple[TensorSpec, ...],
    ) -> None:
        """Check the packet's new segments and every tensor's fit, then map them."""
        sizes: dict[int, int] = {}
        for (seg_id, size), fd in zip(new, fds, strict=True):
            if seg_id in self._remote or seg_id in sizes or os.fstat(fd).st_size < size:
                raise RemoteProtocolError("bad shared-memory segment")
            if not sealed(fd):  # the peer could truncate it under our reads (SIGBUS)
                raise RemoteProtocolError("shared-memory segment not sealed against shrinking")
            sizes[seg_id] = size
        if (
            self._remote_bytes + sum(sizes.values()) > self._budget
            or len(self._remote) + len(sizes) > MAX_SEGMENTS
        ):
            raise RemoteProtocolError("peer's shared-memory segments exceed the budget")
        if self._mappings is not None and not self._mappings.take(
            self.remote_peer_id, len(sizes), sum(sizes.values())
        ):
            raise RemoteProtocolError(
                "peer's shared-memory segments over all its links exceed the budget"
            )
        for target, spec in zip(seg_ids, specs, strict=True):
            if type(target) is bytes:  # in the packet: checked by parse_doorbell
                continue
            size = -1
            if type(target) is int:
                known = self._remote.get(target)
                size = known.size if known is not None else sizes.get(target, -1)
            if spec.nbytes > size:
                raise RemoteProtocolError("tensor does not fit its segment")
        for (seg_id, size), fd in zip(new, fds, strict=True):  # checked whole: map
            self._remote[seg_id] = _map(fd, size, seg_id, owned=False)
            self._remote_bytes += size

    def release(self, frame: Frame) -> None:
        """Hand the frame's segments back to the sender (tensors are invalid afterwards)."""
        seg_ids = []
        with self._cond:
            for t in frame.tensors_():
                seg_id = self._lent.pop(t.data_ptr(), None)
                if seg_id is not None:
                    self._lent_bytes -= t.nbytes
                    if seg_id:  # 0: the tensor came in the packet
                        seg_ids.append(seg_id)
        if seg_ids and not self._closed:
            with self._cond:
                self._pending_release.extend(seg_ids)
            self._flush_releases()

    def _flush_releases(self) -> None:
        """Send queued releases without blocking (a full socket keeps them for later)."""
        with self._cond:
            if not self._pending_release or self._closed:
                return
            packet = msgpack.packb([_RELEASE, self._pending_release])
            try:
                self.sock.send(packet, socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                return
            self._pending_release = []

    def _discard_unread(self) -> None:
        """Read away the packets queued for us before the socket closes.

        Closing a seqpacket socket with unread packets makes the kernel reset
        the peer, which then gets ``ECONNRESET`` *before* the packets we sent
        last, our Goodbye among them. Our reader stops reading while the
        application holds frames (credit), so a peer's late releases sit here.
        """
        for _ in range(1024):  # bounded: a peer cannot keep us here
            try:
                data, fds, _flags = _recv_fds(self.sock, socket.MSG_DONTWAIT)
            except OSError:  # nothing waiting (BlockingIOError), or already broken
                return
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if not data and not fds:  # the peer closed
                return

    def statistics(self) -> LinkStatistics:
        stats = super().statistics()
        with self._cond:  # shared memory lent to us / owned by us, not the pool's
            return replace(stats, in_use_bytes=self._lent_bytes, cached_bytes=self._own_bytes)

    def _shutdown(self) -> None:
        if self._mappings is not None:  # this link's share of the peer's mappings
            self._mappings.give_back(self.remote_peer_id, len(self._remote), self._remote_bytes)
            self._mappings = None
        self._discard_unread()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for segment in self._own.values():  # a peer's descriptors were closed on receipt
            fd, segment.fd = segment.fd, -1  # close each number once: it may be reused
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
