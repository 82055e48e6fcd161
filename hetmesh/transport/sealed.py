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

    def seal(self, parts: list[Any]) -> list[memoryview]:
        """The records carrying ``parts`` (buffers), in one reused buffer.

        The views stay valid until the next call: send them first.
        """
        views = [memoryview(p).cast("B") for p in parts]
        sizes = [len(v) for v in views if len(v)]
        records = sum((n + RECORD_BYTES - 1) // RECORD_BYTES for n in sizes)
        total = sum(sizes) + records * (_LENGTH.size + TAG_BYTES)
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


class OpenedSocket:
    """The receiving half: reads records from ``sock``, hands out their plaintext."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self._sock = sock
        self._aead = AESGCM(key)
        self._counter = _Counter()
        self._sealed = bytearray(RECORD_BYTES + TAG_BYTES)
        self._plain = bytearray(RECORD_BYTES)
        self._start = self._end = 0  # plaintext not yet handed out

    def recv_into(self, target: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Like ``socket.recv_into``: up to ``len(target)`` plaintext bytes; 0 at EOF.

        Blocks for a whole record. :class:`RemoteProtocolError` for a record
        that fails its tag or its length check; ``OSError`` from the socket.
        """
        view = memoryview(target).cast("B")
        if nbytes:
            view = view[:nbytes]
        if self._start == self._end:
            length = self._read_length()
            if length is None:
                return 0
            sealed = memoryview(self._sealed)[:length]
            self._read_exact(sealed)
            size = length - TAG_BYTES
            if len(view) >= size:  # straight into the reader's memory
                self._open(sealed, view[:size])
                return size
            self._open(sealed, memoryview(self._plain)[:size])
            self._start, self._end = 0, size
        n = min(len(view), self._end - self._start)
        view[:n] = memoryview(self._plain)[self._start : self._start + n]
        self._start += n
        return n

    def _open(self, sealed: memoryview, into: memoryview) -> None:
        try:
            self._aead.decrypt_into(self._counter.next_nonce(), sealed, None, into)
        except InvalidTag:
            raise RemoteProtocolError("a sealed record failed authentication") from None

    def _read_length(self) -> int | None:
        header = bytearray(_LENGTH.size)
        got = self._sock.recv_into(header)
        if got == 0:
            return None  # closed between records
        if got < len(header):
            self._read_exact(memoryview(header)[got:])
        length: int = _LENGTH.unpack(header)[0]
        if not TAG_BYTES < length <= RECORD_BYTES + TAG_BYTES:
            raise RemoteProtocolError(f"sealed record of {length} bytes")
        return length

    def _read_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise StreamReset("peer closed the connection inside a sealed record")
            got += n


__all__ = ["RECORD_BYTES", "OpenedSocket", "Sealer"]
