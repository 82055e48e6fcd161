"""A holder's reply to a shard request over libp2p, streamed from disk.

A tensor (or side file) is located on disk as a :class:`Span` and written in
chunks of :data:`CHUNK_BYTES` as one length-prefixed frame
(:func:`hetmesh.discovery.wire.write_frame`'s framing), so a reply holds a chunk
in memory, not the tensor: a requester that reads slowly (or not at all: the
caller's deadline drops it) costs the holder a chunk and a stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from hetmesh.discovery import wire
from hetmesh.errors import CorruptModel, ModelNotFound

CHUNK_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Span:
    """``length`` bytes of ``path`` from ``begin``; ``stored`` for a checkpoint's own
    tensor (a holder's tests make those lie: :meth:`Shards._lie`)."""

    path: Path
    begin: int
    length: int
    stored: bool = False


def file_span(path: Path) -> Span:
    return Span(path, 0, path.stat().st_size)


def checkpoint_span(folder: Path, name: str) -> Span:
    """Where tensor ``name`` (as stored) lies in a whole converted folder's safetensors."""
    from hetmesh.partition.checkpoint import read_safetensors_header
    from hetmesh.partition.store import weight_files

    file = weight_files(folder).get(name)
    if file is None:
        raise ModelNotFound(f"no tensor {name!r} in this model")
    with file.open("rb") as handle:
        start, header = read_safetensors_header(handle, file)
    try:
        begin, end = (int(v) for v in header[name]["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModel(f"{file}: bad header entry for {name} ({exc!r})") from exc
    return Span(file, start + begin, end - begin, stored=True)


def read_span(span: Span, offset: int = 0, size: int | None = None) -> bytes:
    """``size`` bytes (all, by default) of ``span`` from ``offset``; ``CorruptModel``
    when the file is shorter than the span."""
    size = span.length - offset if size is None else size
    try:
        with span.path.open("rb") as handle:
            handle.seek(span.begin + offset)
            data = handle.read(size)
    except OSError as exc:
        raise CorruptModel(f"{span.path}: cannot read ({exc})") from exc
    if len(data) != size:
        raise CorruptModel(f"{span.path} is shorter than its header says")
    return data


async def write_span(
    stream: Any, lead: bytes, span: Span, first: Callable[[bytes], bytes] = bytes
) -> None:
    """One frame of ``lead`` then ``span``'s bytes, read a chunk at a time (``first``
    applied to the first chunk). The frame's length is sent first: a file that turns
    out short raises ``CorruptModel`` and the caller resets the stream."""
    await stream.write(wire.frame_prefix(len(lead) + span.length) + lead)
    offset = 0
    while offset < span.length:
        size = min(CHUNK_BYTES, span.length - offset)
        chunk = await trio.to_thread.run_sync(read_span, span, offset, size)
        await stream.write(first(chunk) if offset == 0 else chunk)
        offset += size


__all__ = ["CHUNK_BYTES", "Span", "checkpoint_span", "file_span", "read_span", "write_span"]
