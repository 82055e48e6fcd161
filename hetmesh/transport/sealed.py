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
:class:`~hetmesh.transport.links.BufferedReader` (``recv_into``): frames are
parsed exactly as on a plain link, and a record that fits the reader's
target is decrypted straight into it (a tensor's own memory).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hetmesh.errors import LocalProtocolError, RemoteProtocolError, StreamReset

RECORD_BYTES = 1 << 20  # plaintext per record: bounds what a peer makes us buffer
TAG_BYTES = 16
_LENGTH = struct.Struct(">I")
_NONCE = struct.Struct(">4xQ")  # 96 bits: 32 zero bits, then the record counter
_MAX_RECORDS = 1 << 64


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def next_nonce(self) -> bytes:
        if self.value >= _MAX_RECORDS:  # unreachable in practice; never wrap a nonce
            raise LocalProtocolError("sealed link ran out of nonces")
        nonce = _NONCE.pack(self.value)
        self.value += 1
        return nonce


class Sealer:
    """Seals outgoing frames (one writer at a time: the link's write lock)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._counter = _Counter()
        self._buffer = bytearray(0)
        self._staging = bytearray(0)

    def seal(self, parts: list[Any]) -> list[memoryview]:
        """The records carrying ``parts`` (buffers), in one reused buffer.

        A frame that fits one record (a decode step's) goes as one record, so
        its receiver wakes once; larger ones get a record per part and per
        :data:`RECORD_BYTES`. The views stay valid until the next call: send
        them first.
        """
        plain = 0
        for p in parts:
            plain += memoryview(p).nbytes
        if 0 < plain <= RECORD_BYTES:
            return self._one_record(parts, plain)
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        records = sum((len(v) + RECORD_BYTES - 1) // RECORD_BYTES for v in views)
        total = plain + records * (_LENGTH.size + TAG_BYTES)
        if len(self._buffer) < total:
            self._buffer = bytearray(total)
        out = memoryview(self._buffer)
        at = 0
        for view in views:
            for start in range(0, len(view), RECORD_BYTES):
                chunk = view[start : start + RECORD_BYTES]
                sealed = len(chunk) + TAG_BYTES
                _LENGTH.pack_into(out, at, sealed)
                at += _LENGTH.size
                self._aead.encrypt_into(
                    self._counter.next_nonce(), chunk, None, out[at : at + sealed]
                )
                at += sealed
        return [out[:at]]

    def _one_record(self, parts: list[Any], plain: int) -> list[memoryview]:
        """:meth:`seal` of a frame that fits one record (a decode step's): the fewest
        Python steps, one copy into the staging buffer when it has several parts."""
        total = _LENGTH.size + plain + TAG_BYTES
        if len(self._buffer) < total:
            self._buffer = bytearray(max(total, 64 << 10))
        out = memoryview(self._buffer)
        if len(parts) == 1:
            source = memoryview(parts[0]).cast("B")
        else:
            if len(self._staging) < plain:
                self._staging = bytearray(max(plain, 64 << 10))
            staging = memoryview(self._staging)
            at = 0
            for p in parts:
                view = memoryview(p).cast("B")
                staging[at : at + len(view)] = view
                at += len(view)
            source = staging[:plain]
        _LENGTH.pack_into(out, 0, plain + TAG_BYTES)
        self._aead.encrypt_into(self._counter.next_nonce(), source, None, out[_LENGTH.size : total])
        return [out[:total]]


class OpenedSocket:
    """The receiving half: reads records from ``sock``, hands out their plaintext.

    Raw bytes are read in as large pieces as the kernel has (one ``recv`` for
    a small frame's record), so a sealed link costs a plain one's wake-ups.
    """

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self._sock = sock
        self._aead = AESGCM(key)
        self._counter = _Counter()
        self._raw = bytearray(_LENGTH.size + RECORD_BYTES + TAG_BYTES)
        self._raw_view = memoryview(self._raw)
        self._raw_start = self._raw_end = 0  # received, not yet opened
        self._plain = bytearray(RECORD_BYTES)
        self._start = self._end = 0  # opened, not yet handed out

    def recv_into(self, target: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Like ``socket.recv_into``: up to ``len(target)`` plaintext bytes; 0 at EOF.

        Blocks for a whole record unless ``flags`` has ``MSG_DONTWAIT``
        (``BlockingIOError`` then, with what arrived kept for the next call).
        :class:`RemoteProtocolError` for a record that fails its tag or its
        length check; ``OSError`` from the socket.
        """
        view = memoryview(target).cast("B")
        if nbytes:
            view = view[:nbytes]
        if self._start == self._end and self._raw_start == self._raw_end:
            # nothing held (a decode step's frame, most often): one recv, and a record
            # that came whole opens straight into the reader's memory
            got = self._sock.recv_into(self._raw_view, 0, flags)
            if got == 0:
                return 0
            self._raw_start, self._raw_end = 0, got
            if got > _LENGTH.size:
                length: int = _LENGTH.unpack_from(self._raw_view)[0]
                size = length - TAG_BYTES
                if got == _LENGTH.size + length and 0 < size <= min(len(view), RECORD_BYTES):
                    self._raw_start = got
                    self._open(self._raw_view[_LENGTH.size : got], view[:size])
                    return size
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
            if self._raw_end == len(raw) or not have:  # full (a record's tail to come): compact
                self._raw[:have] = self._raw[self._raw_start : self._raw_end]
                self._raw_start, self._raw_end = 0, have
            got = self._sock.recv_into(raw[self._raw_end :], 0, flags)
            if got == 0:
                if have:
                    raise StreamReset("peer closed the connection inside a sealed record")
                return None
            self._raw_end += got

    def _open(self, sealed: memoryview, into: memoryview) -> None:
        try:
            self._aead.decrypt_into(self._counter.next_nonce(), sealed, None, into)
        except InvalidTag:
            raise RemoteProtocolError("a sealed record failed authentication") from None


__all__ = ["RECORD_BYTES", "OpenedSocket", "Sealer"]
