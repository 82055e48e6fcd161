"""Sealed records: authenticated encryption (AES-256-GCM) of a tcp link's byte stream.

A sealed link sends each frame's bytes (prefix + header, then each tensor's
memory) as records of at most :data:`RECORD_BYTES` plaintext bytes::

    length (4 bytes, big endian: ciphertext + 16-byte tag) | ciphertext | tag

Each direction has its own key (:func:`~hetmesh.transport.credentials.link_keys`)
and a 96-bit nonce that counts records from 0, so no (key, nonce) pair is
ever used twice; a record that was altered, dropped, replayed or reordered
fails its tag and ends the link (:class:`RemoteProtocolError`). Lengths are
checked before anything is read into memory.

The receiving half is a socket look-alike for
:class:`~hetmesh.transport.readers.BufferedReader` (``recv_into``): frames are
parsed exactly as on a plain link, and a record that fits the reader's
target is decrypted straight into it (a tensor's own memory). A decode step's
record, of a layout seen before, is decrypted into a pool tensor that has room
for the frame's head just before it (:meth:`OpenedSocket.land`): the head is
parsed from there, and the tensor needs no copy.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hetmesh.errors import LocalProtocolError, RemoteProtocolError, StreamReset
from hetmesh.transport.codec import BufferPool, TensorSpec
from hetmesh.transport.frames import (
    PREFIX_BYTES,
    Frame,
    Limits,
    flat_bytes,
    parse_header,
    parse_prefix,
)

RECORD_BYTES = 1 << 20  # plaintext per record: bounds what a peer makes us buffer
SMALL_BYTES = 64 << 10  # frames up to this size are sealed in the sealer's standing buffer
TAG_BYTES = 16
_LENGTH = struct.Struct(">I")  # 4 bytes
_NONCE = struct.Struct(">4xQ")  # 96 bits: 32 zero bits, then the record counter
_MAX_RECORDS = 1 << 64
_OVERHEAD = RECORD_OVERHEAD = _LENGTH.size + TAG_BYTES  # per record
_VIEW_SIZES = 64  # frame sizes whose views a Sealer keeps (then it starts over)


def _nbytes(parts: Sequence[Any]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


class Sealer:
    """Seals outgoing frames (one writer at a time: the link's write lock)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._sealed = 0  # records sealed so far: the next record's nonce
        self._small = memoryview(bytearray(SMALL_BYTES + _OVERHEAD))  # seal_frame's alone
        # seal_frame's views of _small per frame size: (plaintext, ciphertext + tag, record)
        self._frame_views: dict[int, tuple[memoryview, memoryview, memoryview]] = {}
        self._framed = -1  # the frame size whose record length _small holds
        self._buffer = bytearray()  # seal()'s, grown to the largest frame it sealed
        self._view = memoryview(self._buffer)
        self._window: memoryview | None = None  # large frames' records, for send()

    def _nonce(self) -> bytes:
        count = self._sealed
        if count >= _MAX_RECORDS:  # unreachable in practice; never wrap a nonce
            raise LocalProtocolError("sealed link ran out of nonces")
        self._sealed = count + 1
        return _NONCE.pack(count)

    def seal_frame(self, head: bytes, buffers: Sequence[Any], plain: int) -> memoryview:
        """``seal([head, *buffers], plain)`` for what :func:`encode_parts` returns: a frame
        of at most :data:`SMALL_BYTES` (a decode step's) with the fewest steps per frame.

        The record is built where it lies in the sealer's own buffer and sealed in place
        (OpenSSL's GCM reads each block before it writes it), through views kept per
        frame size: a decode step's frames all have one size, and every step saved here
        is saved twice per hop (it also slows the parsing that follows, measured).
        """
        views = self._frame_views.get(plain)
        if views is None:
            if plain > SMALL_BYTES:
                return self.seal([head, *buffers], plain)
            if plain <= 0:
                raise LocalProtocolError(f"parts of {_nbytes([head, *buffers])} bytes, not {plain}")
            if len(self._frame_views) >= _VIEW_SIZES:
                self._frame_views.clear()
            small = self._small
            views = (
                small[4 : 4 + plain],
                small[4 : 4 + plain + TAG_BYTES],
                small[: plain + _OVERHEAD],
            )
            self._frame_views[plain] = views
        text, sealed, record = views
        at = -1
        if len(buffers) == 1:  # a decode step's Activations: a head and one tensor
            try:
                at = len(head)
                text[:at] = head
                text[at:] = memoryview(buffers[0]).cast("B")  # ValueError unless it fills it
                at = plain
            except (TypeError, ValueError):  # an odd array, or sizes that disagree
                at = -1
        if at != plain and _gather(text, head, buffers) != plain:
            raise LocalProtocolError(f"parts of {_nbytes([head, *buffers])} bytes, not {plain}")
        count = self._sealed
        if count >= _MAX_RECORDS:  # unreachable in practice; never wrap a nonce
            raise LocalProtocolError("sealed link ran out of nonces")
        self._sealed = count + 1
        if plain != self._framed:
            _LENGTH.pack_into(record, 0, plain + TAG_BYTES)
            self._framed = plain
        self._aead.encrypt_into(_NONCE.pack(count), text, None, sealed)
        return record

    def seal(self, parts: Sequence[Any], plain: int = -1) -> memoryview:
        """The records carrying ``parts`` (buffers: bytes, memoryviews, C-contiguous
        arrays), ``plain`` bytes in all if the caller knows it, in one reused buffer.

        A frame that fits one record (a decode step's) goes as one record, so its
        receiver wakes once: its parts are copied to where their ciphertext goes
        and sealed there, one AES-GCM call. Larger ones get a record per part and
        per :data:`RECORD_BYTES`. The view stays valid until the next call: send
        it first.
        """
        if plain < 0:
            plain = _nbytes(parts)
        if 0 < plain <= RECORD_BYTES:
            total = plain + _OVERHEAD
            if len(self._buffer) < total:
                self._buffer = bytearray(total)
                self._view = memoryview(self._buffer)
            out = self._view
            at = _LENGTH.size
            view: bytes | memoryview
            for p in parts:
                if type(p) is bytes:  # the frame's head
                    view = p
                else:
                    try:
                        view = memoryview(p).cast("B")
                    except TypeError:  # an array with zeros in its shape
                        view = flat_bytes(p)
                end = at + len(view)
                if end > total:
                    break
                out[at:end] = view
                at = end
            else:
                if at == total - TAG_BYTES:
                    # sealed where it lies: OpenSSL's GCM reads each block before it writes it
                    _LENGTH.pack_into(out, 0, plain + TAG_BYTES)
                    self._aead.encrypt_into(self._nonce(), out[4:at], None, out[4:total])
                    return out[:total]
            raise LocalProtocolError(f"parts of {_nbytes(parts)} bytes, not {plain}")
        return self._records(parts, plain)

    def send(self, sock: socket.socket, head: bytes, buffers: Sequence[Any], plain: int) -> None:
        """Seal the frame ``encode_parts`` gave and write it to blocking ``sock``.

        A frame over :data:`RECORD_BYTES` is sealed and sent a record at a time
        through one standing window (the head's record rides with the first
        payload record): each record's ciphertext is still in cache when the
        kernel copies it, where sealing a whole frame first wrote it all to
        memory and read it back.
        """
        if plain <= RECORD_BYTES:
            sock.sendall(self.seal_frame(head, buffers, plain))
            return
        views = _checked_views([head, *buffers], plain)
        if self._window is None:
            self._window = memoryview(bytearray(RECORD_BYTES + SMALL_BYTES + 2 * _OVERHEAD))
        out = self._window
        at = 0
        for view in views:
            for start in range(0, len(view), RECORD_BYTES):
                chunk = view[start : start + RECORD_BYTES]
                sealed = len(chunk) + TAG_BYTES
                if at + _LENGTH.size + sealed > len(out):
                    sock.sendall(out[:at])
                    at = 0
                _LENGTH.pack_into(out, at, sealed)
                at += _LENGTH.size
                self._aead.encrypt_into(self._nonce(), chunk, None, out[at : at + sealed])
                at += sealed
        sock.sendall(out[:at])

    def _records(self, parts: Sequence[Any], plain: int) -> memoryview:
        views = _checked_views(parts, plain)
        records = sum((len(v) + RECORD_BYTES - 1) // RECORD_BYTES for v in views)
        total = plain + records * _OVERHEAD
        if len(self._buffer) < total:
            self._buffer = bytearray(total)
            self._view = memoryview(self._buffer)
        out = self._view
        at = 0
        for view in views:
            for start in range(0, len(view), RECORD_BYTES):
                chunk = view[start : start + RECORD_BYTES]
                sealed = len(chunk) + TAG_BYTES
                _LENGTH.pack_into(out, at, sealed)
                at += _LENGTH.size
                self._aead.encrypt_into(self._nonce(), chunk, None, out[at : at + sealed])
                at += sealed
        return out[:at]


class OpenedSocket:
    """The receiving half: reads records from ``sock``, hands out their plaintext.

    Raw bytes are read in as large pieces as the kernel has (one ``recv`` for
    a small frame's record), so a sealed link costs a plain one's wake-ups.
    """

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self._sock = sock
        self._aead = AESGCM(key)
        self._opened = 0  # records opened so far: the next record's nonce
        self._raw = bytearray(_OVERHEAD + RECORD_BYTES)
        self._raw_view = self.raw = memoryview(self._raw)  # raw: see open_alone
        self._raw_start = self._raw_end = 0  # received, not yet opened
        self._plain = bytearray(RECORD_BYTES)
        self._start = self._end = 0  # opened, not yet handed out
        self.idle = True  # nothing held (raw bytes or opened ones): a record starts next
        # open_alone's views per record size: a decode step's records all have one size
        self._alone_views: dict[int, tuple[memoryview, memoryview, memoryview]] = {}
        # land's layouts per record size: (head bytes, the one tensor's spec)
        self._layouts: dict[int, tuple[int, TensorSpec]] = {}

    def recv_into(self, target: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Like ``socket.recv_into``: up to ``len(target)`` plaintext bytes; 0 at EOF.

        Blocks for a whole record unless ``flags`` has ``MSG_DONTWAIT``
        (``BlockingIOError`` then, with what arrived kept for the next call).
        :class:`RemoteProtocolError` for a record that fails its tag or its
        length check; ``OSError`` from the socket.
        """
        if type(target) is memoryview and target.format == "B":
            view = target
        else:
            view = memoryview(target).cast("B")
        if nbytes:
            view = view[:nbytes]
        if self.idle:
            # nothing held: one recv, and a record that came whole and alone opens
            # straight into the target (a tensor's memory, or the reader's)
            raw = self._raw_view
            got = self._sock.recv_into(raw, 0, flags)
            size = got - _OVERHEAD  # got <= len(raw) bounds it by RECORD_BYTES
            if 0 < size <= len(view) and _LENGTH.unpack_from(raw)[0] == got - _LENGTH.size:
                self._open(raw[_LENGTH.size : got], view[:size])
                return size
            if got == 0:
                return 0
            self._raw_start, self._raw_end = 0, got
            self.idle = False
        try:
            return self._recv_held(view, flags)
        finally:
            self.idle = self._start == self._end and self._raw_start == self._raw_end

    def open_alone(self, got: int, into: memoryview) -> int:
        """``got`` bytes were just received into :attr:`raw` while :attr:`idle` (the
        link reader's own ``recv``): a record that came whole and alone (a decode step's
        frame) is opened into ``into`` and its size returned; anything else is held for
        :meth:`recv_into`, and 0 returned. Refusals as :meth:`recv_into`'s."""
        raw = self._raw_view
        views = None
        if _LENGTH.unpack_from(raw)[0] == got - _LENGTH.size:  # one whole record
            views = self._alone_views.get(got)  # (record, its plaintext's place, into)
            if views is None or views[2] is not into:
                size = got - _OVERHEAD  # got <= len(raw) bounds it by RECORD_BYTES
                if 0 < size <= len(into):
                    if len(self._alone_views) >= _VIEW_SIZES:
                        self._alone_views.clear()
                    views = self._alone_views[got] = (raw[4:got], into[:size], into)
                else:
                    views = None
        if views is not None:
            count = self._opened
            if count >= _MAX_RECORDS:  # unreachable in practice
                raise LocalProtocolError("sealed link ran out of nonces")
            self._opened = count + 1
            try:
                self._aead.decrypt_into(_NONCE.pack(count), views[0], None, views[1])
            except InvalidTag:
                raise RemoteProtocolError("a sealed record failed authentication") from None
            return got - _OVERHEAD
        if got > 0:
            self._raw_start, self._raw_end = 0, got
            self.idle = False
        return 0

    def land(self, got: int, pool: BufferPool, limits: Limits, staging: memoryview) -> Frame | int:
        """:meth:`open_alone` for a link reader that holds nothing: ``got`` bytes were just
        received into :attr:`raw`. A whole record of a size :meth:`learn` saw (a decode
        step's ``Activations``: a head, then one tensor) is opened into a free landing of
        ``pool`` (:meth:`BufferPool.add_landing`): the tensor's bytes arrive in its own
        memory, and the frame, parsed from the opened head, is returned. Anything else
        is :meth:`open_alone`'s (its size in ``staging``, or 0 and held); so is a record of
        that size laid out otherwise, once opened (copied to ``staging``). Refusals as
        :meth:`recv_into`'s, and a bad head's as the reader's."""
        layout = self._layouts.get(got)
        if layout is None or _LENGTH.unpack_from(self._raw_view)[0] != got - _LENGTH.size:
            return self.open_alone(got, staging)
        lead, spec = layout
        landing = pool.take_landing(spec, lead)
        if landing is None:  # all of them still held by the frames' readers
            return self.open_alone(got, staging)
        tensor, out = landing
        try:
            self._open(self._raw_view[_LENGTH.size : got], out)
            head = parse_prefix(out, limits)  # the record holds a frame from its first byte
            if head.header_bytes == lead - PREFIX_BYTES and head.payload_bytes == spec.nbytes:
                pending = parse_header(head, out[PREFIX_BYTES:lead], limits)
                specs = pending.specs  # a dtype and shape give the nbytes
                if len(specs) == 1:
                    read = specs[0]
                    if read.shape == spec.shape and read.dtype == spec.dtype:
                        return pending.build((tensor,))
        except BaseException:
            pool.release(tensor)
            raise
        size = got - _OVERHEAD  # authenticated, laid out otherwise: parsed from staging
        staging[:size] = out
        pool.release(tensor)
        return size

    def learn(self, got: int, lead: int, spec: TensorSpec, pool: BufferPool) -> None:
        """The reader parsed a record of ``got`` bytes, opened alone, as one frame of a
        ``lead``-byte head and a tensor of ``spec``. The second time in a row for that
        size (a decode step's frames repeat; a prefill chunk's may not), ``pool`` gets a
        landing for it, and :meth:`land` opens such records into one from then on. At
        most 64 sizes are kept, then it starts over."""
        if spec.nbytes <= 0 or lead < PREFIX_BYTES:
            return
        layout = (lead, spec)
        if self._layouts.get(got) == layout:
            pool.add_landing(spec, lead)  # none was free (or none made yet)
            return
        if len(self._layouts) >= _VIEW_SIZES and got not in self._layouts:
            self._layouts.clear()
        self._layouts[got] = layout

    def _recv_held(self, view: memoryview, flags: int) -> int:
        """:meth:`recv_into` from what is held (records in part or in number, or a record
        the target cannot take whole), and from the socket when that runs out."""
        if self._start == self._end:
            sealed = self._next_record(flags)
            if sealed is None:
                return 0
            size = len(sealed) - TAG_BYTES
            if len(view) >= size:  # straight into the reader's memory
                self._open(sealed, view[:size])
                return size
            self._open(sealed, memoryview(self._plain)[:size])
            self._start, self._end = 0, size
        n = min(len(view), self._end - self._start)
        view[:n] = memoryview(self._plain)[self._start : self._start + n]
        self._start += n
        return n

    def _next_record(self, flags: int) -> memoryview | None:
        """The next whole sealed record (a view of the raw buffer, valid until the next
        read); None if the peer closed between records."""
        raw = self._raw_view
        length = -1
        while True:
            have = self._raw_end - self._raw_start
            if length < 0 and have >= _LENGTH.size:
                length = _LENGTH.unpack_from(raw, self._raw_start)[0]
                if not TAG_BYTES < length <= RECORD_BYTES + TAG_BYTES:
                    raise RemoteProtocolError(f"sealed record of {length} bytes")
            if length >= 0 and have >= _LENGTH.size + length:
                start = self._raw_start + _LENGTH.size
                self._raw_start = start + length
                return raw[start : start + length]
            # a record's tail is read up to its end, no further: a large record then
            # starts at the buffer's head, where it fits, with nothing to move
            if (
                not have
                or self._raw_end == len(raw)
                or self._raw_start + _LENGTH.size + length > len(raw)
            ):  # what we hold goes to the head (a memmove)
                raw[:have] = raw[self._raw_start : self._raw_end]
                self._raw_start, self._raw_end = 0, have
            end = len(raw) if length < 0 else self._raw_start + _LENGTH.size + length
            got = self._sock.recv_into(raw[self._raw_end : end], 0, flags)
            if got == 0:
                if have:
                    raise StreamReset("peer closed the connection inside a sealed record")
                return None
            self._raw_end += got

    def _open(self, sealed: memoryview, into: memoryview) -> None:
        count = self._opened
        if count >= _MAX_RECORDS:  # unreachable in practice; never wrap a nonce
            raise LocalProtocolError("sealed link ran out of nonces")
        self._opened = count + 1
        try:
            self._aead.decrypt_into(_NONCE.pack(count), sealed, None, into)
        except InvalidTag:
            raise RemoteProtocolError("a sealed record failed authentication") from None


def _gather(text: memoryview, head: bytes, buffers: Sequence[Any]) -> int:
    """Copy ``head`` and ``buffers`` to the start of ``text``; the bytes they hold, or -1
    if they do not fit."""
    at = len(head)
    if at > len(text):
        return -1
    text[:at] = head
    for b in buffers:
        try:
            view = memoryview(b).cast("B")
        except TypeError:  # an array with zeros in its shape
            view = flat_bytes(b)
        start = at
        at += len(view)
        if at > len(text):
            return -1
        text[start:at] = view
    return at


def _checked_views(parts: Sequence[Any], plain: int) -> list[memoryview]:
    """The parts' non-empty byte views, refused unless they hold ``plain`` bytes."""
    views = [v for v in map(flat_bytes, parts) if len(v)]
    if sum(map(len, views)) != plain:
        raise LocalProtocolError(f"parts of {_nbytes(parts)} bytes, not {plain}")
    return views


__all__ = ["RECORD_BYTES", "RECORD_OVERHEAD", "OpenedSocket", "Sealer"]
