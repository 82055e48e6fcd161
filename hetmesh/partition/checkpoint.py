"""Reading one tensor of a model folder, whatever compact form it is stored in.

A model folder's safetensors hold each tensor ``name`` in one of three forms:

- ``name``: a float tensor (fp32, bf16 or fp16), as in any Hugging Face folder;
- ``name.q4_1.qs`` (uint8 ``(n, k/2)``), ``name.q4_1.d`` and ``name.q4_1.m``
  (fp16 ``(n, k/32)``): GGUF Q4_1 blocks, ``w = d * q + m`` per 32 inputs; a
  block's 16 bytes hold inputs 0..15 in their low nibbles and 16..31 in their
  high nibbles (GGUF's own order, copied without repacking). Q4_0 is stored
  the same way with ``m = -8 d``. ``name.q4_1.int4h64`` (or another tag of
  :data:`~hetmesh.partition.int4_direct.PACKED_TAGS`) instead of ``.qs``: the
  same nibbles already in torch's packed int4 layout that the tag names
  (``n`` a multiple of 64; what ``hetmesh model synth`` writes): an int4 stage on
  a CPU packing that way reads it as is (:meth:`CheckpointReader.q4_1_packed`),
  anything else unpacks it;
- ``name.q8_0.qs`` (int8 ``(n, k)``) and ``name.q8_0.d`` (fp16 ``(n, k/32)``):
  GGUF Q8_0 blocks, ``w = d * q``;
- ``name.q4_k.blocks``, ``name.q5_k.blocks``, ``name.q6_k.blocks`` (uint8, a
  row of GGUF super-blocks per row): K-quant blocks as the GGUF stores them
  (:mod:`hetmesh.partition.kquant`).

:class:`CheckpointReader` hands out rows of any of them as fp32 (dequantising
only the rows asked for) and 4-bit groups (Q4_1 blocks as they are, Q4_K's
per-32 scales and minimums exactly), so a stage loads into
any format one tensor (or one slice of rows) at a time.
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

from hetmesh.errors import CorruptModel, InvalidRequest
from hetmesh.partition.formats import (
    WeightFormat,
    check_supported,
    cpu_has_bf16,
    is_native,
    parse_weights,
)
from hetmesh.partition.int4_direct import PACKED_TAGS, PAD_ROWS, q4_1_from_packed
from hetmesh.partition.kquant import dequantize as _k_dequantize
from hetmesh.partition.kquant import logical_width as _k_width
from hetmesh.partition.kquant import q4_k_groups as _q4_k_groups
from hetmesh.partition.store import brief_error, shard_tensors, weight_files

Kind = Literal["float", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"]
K_KINDS: tuple[Kind, ...] = ("q4_k", "q5_k", "q6_k")
_SUFFIXES: tuple[str, ...] = (".q4_1.qs", ".q4_1.d", ".q4_1.m", ".q8_0.qs", ".q8_0.d")
_SUFFIXES += tuple(f".{kind}.blocks" for kind in K_KINDS)
_SUFFIXES += tuple(f".q4_1.{tag}" for tag in PACKED_TAGS.values())
_PACKED = {tag: layout for layout, tag in PACKED_TAGS.items()}
BLOCK = 32
ROW_CHUNK = 4096  # rows dequantised at once when reading a large table
_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
}
_MAX_HEADER_BYTES = 100 * 2**20
DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers on the device's blocks
DIRECT_MIN_BYTES = 256 << 10  # smaller reads go through the page cache (then dropped)


def open_direct(file: Path) -> int | None:
    """``file`` opened for reads that bypass the page cache (``O_DIRECT``), or None
    where the system or file system has none (then reads are buffered and their pages
    dropped, :func:`drop_read_pages`)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(file, os.O_RDONLY | flag)
    except OSError:
        return None


def read_direct(fd: int, offset: int, count: int) -> torch.Tensor:
    """Bytes ``[offset, offset + count)`` of the ``O_DIRECT`` file ``fd``, read straight
    from the device into the returned tensor's own storage: no page cache (charged to
    a cgroup like the node's own memory, and dropped after a buffered read only as far
    as nobody else is reading the same pages), no copy. The read covers whole blocks
    around the range; the tensor is a view of it (under 3 blocks more memory).

    Raises OSError where the file system refuses the read (the caller reads it
    buffered instead) and ValueError for a file shorter than the range.
    """
    lo = offset - offset % DIRECT_ALIGN
    span = -(-(offset + count - lo) // DIRECT_ALIGN) * DIRECT_ALIGN
    storage = torch.empty(span + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -storage.data_ptr() % DIRECT_ALIGN
    window = storage[skip : skip + span]
    view: memoryview = window.numpy().data
    done = 0
    while done < span:
        got = os.preadv(fd, [view[done:]], lo + done)
        if got <= 0:
            break
        done += got
    if done < offset + count - lo:
        raise ValueError("file shorter than its header says")
    return window[offset - lo : offset - lo + count]


def drop_read_pages(handle: BinaryIO, offset: int, count: int) -> None:
    """Tell the kernel the file's bytes ``[offset, offset + count)`` just read are not
    needed again (``POSIX_FADV_DONTNEED``): a node holds its stage in its own format,
    and the file's page cache would otherwise stay charged to its memory (a cgroup's
    limit counts it) after the load. A later read of the same bytes (a re-plan, a
    standby) reads the disk again. No-op where the call does not exist."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or count <= 0:
        return
    try:
        advise(handle.fileno(), offset, count, os.POSIX_FADV_DONTNEED)
    except (OSError, ValueError, AttributeError):  # not a real file: nothing to drop
        return


class _Entry:
    """Where one tensor's bytes lie in its safetensors file."""

    __slots__ = ("begin", "direct", "dtype", "end", "handle", "shape")

    def __init__(
        self, handle: BinaryIO, base: int, info: dict[str, Any], direct: _Direct | None = None
    ) -> None:
        self.handle = handle
        self.direct = direct
        self.dtype: torch.dtype = _DTYPES[info["dtype"]]
        self.shape = tuple(int(n) for n in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
        self.begin, self.end = base + begin, base + end

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """Rows ``[start, stop)`` (all of a 1-D tensor), read with one ``O_DIRECT``
        read where the file system allows (:func:`read_direct`), else one ``readinto``
        whose pages are then dropped.

        Plain reads instead of a memory map: the file's pages do not join
        this process's resident set while a stage loads.
        """
        total = self.shape[0] if self.shape else 1
        start, stop, _ = rows.indices(total)
        row_bytes = (self.end - self.begin) // max(total, 1)
        count = max(stop - start, 0) * row_bytes
        offset = self.begin + start * row_bytes
        out = self.direct.read(offset, count, self.dtype) if self.direct else None
        if out is None:
            out = torch.empty(count, dtype=torch.uint8)
            self.handle.seek(offset)
            if self.handle.readinto(out.numpy().data) != count:  # type: ignore[attr-defined]
                raise ValueError("file shorter than its header says")
            drop_read_pages(self.handle, offset, count)
        shape = (stop - start, *self.shape[1:]) if self.shape else ()
        return out.view(self.dtype).reshape(shape)


class _Direct:
    """One file's ``O_DIRECT`` descriptor; turned off at its first refused read."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def read(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The bytes, or None: too few to bother, or the file system refused."""
        if self.fd is None or count < DIRECT_MIN_BYTES:
            return None
        try:
            out = read_direct(self.fd, offset, count)
        except OSError:
            self.close()
            return None
        if out.storage_offset() % dtype.itemsize:  # viewed as dtype: must start aligned
            out = out.clone()
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class CheckpointReader:
    """Tensors of one model folder; use as a context manager (files stay open inside)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = weight_files(folder)
        # a partial folder's tensors are raw files, described by its manifest, not a header
        self._raw = {
            blob: (name, {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]})
            for name, (blob, dtype, shape, nbytes) in (shard_tensors(folder) or {}).items()
        }
        self._stack = ExitStack()
        self._headers: dict[Path, tuple[BinaryIO, int, dict[str, Any]]] = {}
        self._direct: dict[Path, _Direct | None] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        """Every logical tensor name (block-stored tensors once, without suffixes)."""
        found = set()
        for name in self.files:
            for suffix in _SUFFIXES:
                if name.endswith(suffix):
                    name = name.removesuffix(suffix)
                    break
            found.add(name)
        return sorted(found)

    def kind(self, name: str) -> Kind | None:
        if name in self.files:
            return "float"
        if f"{name}.q4_1.qs" in self.files or self._packing(name) is not None:
            return "q4_1"
        if f"{name}.q8_0.qs" in self.files:
            return "q8_0"
        for kind in K_KINDS:
            if f"{name}.{kind}.blocks" in self.files:
                return kind
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical (dequantised) shape of ``name``."""
        kind = self._require(name)
        if kind == "float":
            return tuple(self._slice(name).get_shape())
        if kind in K_KINDS:
            rows, stored = self._slice(f"{name}.{kind}.blocks").get_shape()
            return (rows, _k_width(kind, stored))
        packing = self._packing(name) if kind == "q4_1" else None
        qs = f"{name}.q4_1.{PACKED_TAGS[packing]}" if packing else f"{name}.{kind}.qs"
        rows, width = self._slice(qs).get_shape()
        return (rows, width * 2) if kind == "q4_1" else (rows, width)

    def _packing(self, name: str) -> str | None:
        """The packed int4 layout ``name``'s Q4_1 nibbles are stored in (None: Q4_1's)."""
        for tag, layout in _PACKED.items():
            if f"{name}.q4_1.{tag}" in self.files:
                return layout
        return None

    def _qs(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a Q4_1 tensor's nibbles in Q4_1's byte order."""
        layout = self._packing(name)
        if layout is None:
            return self._slice(f"{name}.q4_1.qs")[start:stop]  # type: ignore[no-any-return]
        first = start - start % PAD_ROWS  # packed rows come in whole blocks of 64
        last = stop + -stop % PAD_ROWS
        packed = self._slice(f"{name}.q4_1.{PACKED_TAGS[layout]}")[first:last]
        return q4_1_from_packed(packed, layout)[start - first : stop - first]

    def q4_1_packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_1 matrix stored in the packed int4 layout this process's torch uses, as
        stored: ``(packed uint8 (n, k/2), d fp16, m fp16)``, ready for the int4 kernel
        but for the scales; None if it is stored otherwise."""
        from hetmesh.partition.quant import int4_layout_name

        layout = self._packing(name)
        if layout is None or layout != int4_layout_name():
            return None
        try:
            return (
                self._slice(f"{name}.q4_1.{PACKED_TAGS[layout]}")[:],
                self._slice(f"{name}.q4_1.d")[:],
                self._slice(f"{name}.q4_1.m")[:],
            )
        except Exception as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``name`` (the whole of a 1-D tensor) as fp32."""
        kind = self._require(name)
        try:
            if kind == "float":
                part = self._slice(name)
                if len(part.get_shape()) == 1:
                    return part[:].float()  # type: ignore[no-any-return]
                return part[start:stop].float()  # type: ignore[no-any-return]
            if kind == "q4_1":
                q, d, m = self._q4_rows(name, start, stop)
                n, k = q.shape
                w = q.float().reshape(n, k // BLOCK, BLOCK) * d[..., None] + m[..., None]
                return w.reshape(n, k)
            if kind in K_KINDS:
                return _k_dequantize(kind, self._slice(f"{name}.{kind}.blocks")[start:stop])
            qs: torch.Tensor = self._slice(f"{name}.q8_0.qs")[start:stop]
            d = self._slice(f"{name}.q8_0.d")[start:stop].float()
            n, k = qs.shape
            w8: torch.Tensor = qs.float().reshape(n, k // BLOCK, BLOCK) * d[..., None]
            return w8.reshape(n, k)
        except CorruptModel:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def rows_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows ``[start, stop)`` of a 2-D ``name`` written into ``out``, as :meth:`rows`
        gives them (then cast to ``out``'s dtype).

        A Q4_1 tensor into contiguous fp32 rows is dequantised in place, each 4-bit
        half straight into its place (``d * q + m``, the same two fp32 roundings as
        :meth:`rows`): no uint8, fp32 or product temporaries of the whole slice.
        """
        fast = out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous()
        if self.kind(name) != "q4_1" or not fast:
            out.copy_(self.rows(name, start, stop))
            return
        try:
            qs = self._qs(name, start, stop)  # (n, k/2) uint8
            d = self._slice(f"{name}.q4_1.d")[start:stop].float()[..., None, None]
            m = self._slice(f"{name}.q4_1.m")[start:stop].float()[..., None, None]
            n, half = qs.shape
            if out.shape != (n, half * 2):
                raise CorruptModel(f"{self.folder}: {name} rows have shape {tuple(out.shape)}")
            blocks = qs.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
            halves = out.view(n, half // (BLOCK // 2), 2, BLOCK // 2)  # low nibbles, then high
            torch.mul(blocks & 0xF, d, out=halves[:, :, :1])
            torch.mul(blocks >> 4, d, out=halves[:, :, 1:])
            halves.add_(m)
        except CorruptModel:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def tensor(self, name: str) -> torch.Tensor:
        """All of ``name`` as fp32."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0])

    def q4_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q4_1 or Q4_K tensor's own 4-bit groups of 32: ``(q uint8 (n, k) in 0..15,
        d fp32, m fp32)`` with ``w = d * q + m`` (Q4_K's ``d * sc`` and ``-dmin * m``,
        exact in fp32)."""
        return self.q4_rows(name, 0, self.shape(name)[0])

    def q4_rows(
        self, name: str, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``[start, stop)`` of :meth:`q4_blocks` (a loader packs a slice at a time)."""
        try:
            if self.kind(name) == "q4_k":
                return _q4_k_groups(self._slice(f"{name}.q4_k.blocks")[start:stop])
            return self._q4_rows(name, start, stop)
        except Exception as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def _q4_rows(
        self, name: str, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qs = self._qs(name, start, stop)  # (n, k/2) uint8
        d = self._slice(f"{name}.q4_1.d")[start:stop].float()
        m = self._slice(f"{name}.q4_1.m")[start:stop].float()
        n, half = qs.shape
        blocks = qs.reshape(n, half // (BLOCK // 2), BLOCK // 2)
        q = torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, half * 2)
        return q, d, m

    def q4_1_bytes(
        self, name: str, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``[start, stop)`` of a Q4_1 tensor as stored: ``(qs uint8 (n, k/2), d fp16
        (n, k/32), m fp16 (n, k/32))`` (see the module docstring for the byte order)."""
        if self.kind(name) != "q4_1":
            raise CorruptModel(f"{self.folder}: {name} is not stored as Q4_1 blocks")
        try:
            return (
                self._qs(name, start, stop),
                self._slice(f"{name}.q4_1.d")[start:stop],
                self._slice(f"{name}.q4_1.m")[start:stop],
            )
        except Exception as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def q8_0_bytes(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[start, stop)`` of a Q8_0 tensor as stored: ``(qs int8 (n, k), d fp16
        (n, k/32))``."""
        if self.kind(name) != "q8_0":
            raise CorruptModel(f"{self.folder}: {name} is not stored as Q8_0 blocks")
        try:
            return (
                self._slice(f"{name}.q8_0.qs")[start:stop],
                self._slice(f"{name}.q8_0.d")[start:stop],
            )
        except Exception as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def k_blocks(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a K-quant tensor's blocks, as stored (uint8)."""
        kind = self._require(name)
        if kind not in K_KINDS:
            raise CorruptModel(f"{self.folder}: {name} is not stored as K-quant blocks")
        try:
            blocks: torch.Tensor = self._slice(f"{name}.{kind}.blocks")[start:stop]
        except Exception as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc
        return blocks

    def stored_bytes(self, name: str) -> bytes:
        """The bytes of one stored tensor (a name as stored, suffix included), as on disk."""
        entry = self._slice(name)
        try:
            entry.handle.seek(entry.begin)
            data = entry.handle.read(entry.end - entry.begin)
        except OSError as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc
        if len(data) != entry.end - entry.begin:
            raise CorruptModel(f"{self.folder}: {name} is shorter than its header says")
        return data

    def _require(self, name: str) -> Kind:
        kind = self.kind(name)
        if kind is None:
            raise CorruptModel(f"{self.folder}: tensor {name} missing from the checkpoint")
        return kind

    def _slice(self, name: str) -> _Entry:
        if name not in self.files:
            raise CorruptModel(f"{self.folder}: tensor {name} missing from the checkpoint")
        file = self.files[name]
        if file not in self._headers:
            self._headers[file] = self._open(file)
            fd = open_direct(file)
            self._direct[file] = direct = None if fd is None else _Direct(fd)
            if direct is not None:
                self._stack.callback(direct.close)
        handle, base, header = self._headers[file]
        try:
            return _Entry(handle, base, header[name], self._direct[file])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModel(f"{file}: bad header entry for {name} ({exc!r})") from exc

    def _open(self, file: Path) -> tuple[BinaryIO, int, dict[str, Any]]:
        """The open file, where its data starts, and its parsed JSON header."""
        if file in self._raw:
            name, info = self._raw[file]
            try:
                handle = self._stack.enter_context(open(file, "rb"))  # noqa: SIM115
            except OSError as exc:
                raise CorruptModel(f"{file}: unreadable ({brief_error(exc)})") from exc
            return handle, 0, {name: info}
        try:
            handle = self._stack.enter_context(open(file, "rb"))  # noqa: SIM115
        except OSError as exc:
            raise CorruptModel(f"{file}: unreadable safetensors ({brief_error(exc)})") from exc
        start, header = read_safetensors_header(handle, file)
        return handle, start, header


def read_safetensors_header(handle: BinaryIO, file: Path) -> tuple[int, dict[str, Any]]:
    """Where the data of an open safetensors file starts, and its parsed JSON header
    (``__metadata__`` included); ``CorruptModel`` naming ``file`` if it is not one."""
    try:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > _MAX_HEADER_BYTES:
            raise ValueError(f"header of {size} bytes")
        header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise CorruptModel(f"{file}: unreadable safetensors ({brief_error(exc)})") from exc
    if not isinstance(header, dict):
        raise CorruptModel(f"{file}: unreadable safetensors (header is not an object)")
    return 8 + size, header


_FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_matrix_kind(folder: Path) -> str | None:
    """How ``folder`` stores its decoder's matrices: ``"q4_1"``, ``"q4_k"``, ``"q8_0"``,
    ``"q5_k"``, ``"q6_k"``, or the float dtype's name (``"float32"``, ``"bfloat16"``,
    ``"float16"``); None if it has none. A file mixing block kinds (Q4_K_M: Q4_K with
    some Q6_K matrices) is named by its 4-bit kind, the one most of it is in.

    Read off the safetensors headers (or, for a partial folder fetched from peers,
    its manifest, which lists every tensor whether fetched yet or not): no tensor
    data is read.
    """
    from hetmesh.partition.store import SHARDS_MARKER

    marker = folder / SHARDS_MARKER
    entries: list[tuple[str, str, int]] = []  # (name, safetensors dtype, dimensions)
    if marker.is_file():
        try:
            listed = json.loads(marker.read_text())["manifest"]["tensors"]
            entries = [(str(e[0]), str(e[2]), len(e[3])) for e in listed]
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise CorruptModel(f"{marker}: unreadable shard list ({brief_error(exc)})") from exc
    else:
        with CheckpointReader(folder) as reader:
            for name in sorted(reader.files):
                if ".layers." in name:
                    entry = reader._slice(name)
                    dtype = next((k for k, v in _DTYPES.items() if v == entry.dtype), "")
                    entries.append((name, dtype, len(entry.shape)))
    found: list[str] = []
    for name, dtype, dims in sorted(entries):
        if ".layers." not in name:
            continue
        packed = (f".q4_1.{tag}" for tag in _PACKED)
        for suffix in (".q4_1.qs", ".q8_0.qs", *(f".{k}.blocks" for k in K_KINDS), *packed):
            if name.endswith(suffix):
                found.append(suffix.split(".")[1])
        if name.endswith(".weight") and dims == 2 and dtype in _FLOAT_NAMES:
            found.append(_FLOAT_NAMES[dtype])
    for kind in ("q4_1", "q4_k", "q8_0", "q6_k", "q5_k"):
        if kind in found:
            return kind
    return found[0] if found else None


def settle_weights(
    text: str | None, model_dir: str | os.PathLike[str], device: str
) -> WeightFormat | None:
    """``text`` as a format for the model in ``model_dir`` on ``device``: ``"native"``
    read off the folder (:func:`native_weights`), ``None`` for ``"auto"``."""
    if is_native(text):
        return native_weights(model_dir, device)
    return parse_weights(text)


def native_weights(model_dir: str | os.PathLike[str], device: str) -> WeightFormat:
    """The format ``model_dir`` stores its decoder's matrices in, where ``device`` runs it.

    Why this is the default: a model shipped compact is served compact, never
    inflated. The default model's GGUF is Q4_1, so it is held as ``int4`` (the
    shipped 4-bit levels, kept exactly; 1/7 of fp32's bytes, and its decode is
    about twice fp32's on the CPUs measured, docs/benchmarks.md). A Q8_0
    checkpoint is held as ``int8``; a float checkpoint in its own dtype where the
    device multiplies it natively (bf16 on CUDA and on CPUs with AVX-512 BF16 or
    AMX, fp16 on CUDA), else ``float32``. Off a CPU the integer kernels are not
    this project's fast path, so a compact checkpoint becomes ``bfloat16`` on
    CUDA and ``float32`` elsewhere. A format the device has no kernel for falls
    back to ``float32``.
    """
    return native_for_kind(stored_matrix_kind(Path(model_dir)), device)


def native_for_kind(kind: str | None, device: str) -> WeightFormat:
    """:func:`native_weights` for matrices stored as ``kind`` (what
    :func:`stored_matrix_kind` reads off a folder), e.g. a synth model not yet written."""
    on = str(device).split(":", 1)[0]
    if kind in ("q4_1", "q8_0", *K_KINDS):
        if on == "cpu":
            fmt = WeightFormat.INT4 if kind in ("q4_1", "q4_k") else WeightFormat.INT8
        else:
            fmt = WeightFormat.BFLOAT16 if on == "cuda" else WeightFormat.FLOAT32
    elif kind == "bfloat16" and (on == "cuda" or (on == "cpu" and cpu_has_bf16())):
        fmt = WeightFormat.BFLOAT16
    elif kind == "float16" and on == "cuda":
        fmt = WeightFormat.FLOAT16
    else:
        fmt = WeightFormat.FLOAT32
    try:
        check_supported(fmt, on)
    except InvalidRequest:
        return WeightFormat.FLOAT32
    return fmt


def float_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder as fp32 (for references and exports, not serving)."""
    with CheckpointReader(folder) as reader:
        return {name: reader.tensor(name) for name in reader.names()}


__all__ = [
    "BLOCK",
    "K_KINDS",
    "ROW_CHUNK",
    "CheckpointReader",
    "Kind",
    "float_state_dict",
    "native_for_kind",
    "native_weights",
    "settle_weights",
    "stored_matrix_kind",
]
