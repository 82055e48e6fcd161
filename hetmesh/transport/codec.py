"""Tensor codec: dtype whitelist, raw byte views of tensors, and a receive-buffer pool.

A tensor crosses the wire as a msgpack description ``(dtype, shape, nbytes)``
followed by its raw bytes, read straight out of the tensor's memory (a
``uint8`` view, which also makes ``bfloat16`` work without numpy support).
The receiver takes a ``uint8`` buffer of ``nbytes`` from a :class:`BufferPool`,
reads into it, and reinterprets it with ``.view(dtype).view(shape)``: no
intermediate ``bytes``, no pickle.

Pure: imports torch (host tensors only), never trio or libp2p.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from hetmesh.errors import LocalProtocolError, RemoteProtocolError

#: Wire name -> torch dtype. The only dtypes a peer may send.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the header says about one tensor."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; :class:`LocalProtocolError` if we cannot send it."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise LocalProtocolError(f"dtype {dtype} is not sendable") from None


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    """The header description of a tensor we are about to send."""
    name = dtype_name(tensor.dtype)
    return TensorSpec(name, tuple(tensor.shape), tensor.numel() * ITEMSIZE[name])


def checked_spec(
    dtype: object, shape: object, nbytes: object, *, max_dims: int, max_elements: int
) -> TensorSpec:
    """Validate a peer's tensor description before anything is allocated.

    Raises :class:`RemoteProtocolError` for unknown dtypes, too many or
    negative dims, too many elements, or an ``nbytes`` that does not match.
    """
    item = ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    if item is None or not isinstance(dtype, str):
        raise RemoteProtocolError(f"unknown dtype {dtype!r}")
    if type(shape) is not list or len(shape) > max_dims:
        raise RemoteProtocolError("tensor shape missing or has too many dims")
    elements = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise RemoteProtocolError(f"bad tensor dim {d!r}")
        elements *= d
    if elements > max_elements:
        raise RemoteProtocolError(f"tensor of {elements} elements exceeds {max_elements}")
    expected = elements * item
    if type(nbytes) is not int or nbytes != expected:
        raise RemoteProtocolError(f"tensor nbytes {nbytes!r} != {expected}")
    return TensorSpec(dtype, tuple(shape), expected)


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same contents; CUDA goes through pinned memory."""
    if tensor.device.type == "cuda":
        staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staging.copy_(tensor)
        return staging
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    return tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable/readable ``memoryview`` of a contiguous CPU tensor's bytes (no copy)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise LocalProtocolError("byte_view needs a contiguous CPU tensor")
    if tensor.dtype == torch.bfloat16 or tensor.dim() != 1:
        tensor = tensor.reshape(-1)
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.uint8)
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]


def as_tensor(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Reinterpret a ``uint8`` buffer of ``spec.nbytes`` as the described tensor (no copy)."""
    return buffer[: spec.nbytes].view(DTYPES[spec.dtype]).view(spec.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaNs with equal payloads compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ha, hb = host_tensor(a), host_tensor(b)
    return bool(torch.equal(ha.reshape(-1).view(torch.uint8), hb.reshape(-1).view(torch.uint8)))


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """Receive-buffer pool occupancy."""

    in_use_bytes: int
    cached_bytes: int
    allocations: int
    reuses: int


# dtype and shape; a landing's (see BufferPool.add_landing) also has its lead bytes
_Key = tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], int]
# key, tensor, its byte view, its data_ptr, its nbytes (torch calls cost on the hot path)
_Entry = tuple[_Key, torch.Tensor, memoryview, int, int]


class BufferPool:
    """Reusable receive tensors keyed by dtype and shape (thread-safe).

    Fresh 64 MiB allocations pay page faults (3-4x a reused buffer), and
    activations of one pipeline repeat the same sizes, so buffers released
    with :meth:`release` are kept (up to ``max_cached_bytes``) and handed out
    again. Release a tensor only when nobody reads it any more.
    """

    def __init__(self, max_cached_bytes: int = 512 << 20) -> None:
        self._max_cached = max_cached_bytes
        self._lock = threading.Lock()
        self._free: dict[_Key, list[_Entry]] = defaultdict(list)
        self._in_use: dict[int, _Entry] = {}
        self._in_use_bytes = 0
        self._cached_bytes = 0
        self._allocations = 0
        self._reuses = 0

    def acquire(self, spec: TensorSpec) -> torch.Tensor:
        """A tensor of ``spec``'s dtype and shape (contents undefined)."""
        return self.acquire_view(spec)[0]

    def acquire_view(self, spec: TensorSpec) -> tuple[torch.Tensor, memoryview]:
        """Like :meth:`acquire`, plus a writable byte view of the tensor (cached with it)."""
        if spec.nbytes == 0:
            # writable even when empty: readers assign into it (a read-only b"" raised)
            return torch.empty(spec.shape, dtype=DTYPES[spec.dtype]), memoryview(bytearray())
        key = (spec.dtype, spec.shape)
        with self._lock:
            free = self._free.get(key)
            if free:
                entry = free.pop()
                self._cached_bytes -= spec.nbytes
                self._reuses += 1
                self._in_use[entry[3]] = entry
                self._in_use_bytes += spec.nbytes
                return entry[1], entry[2]
        tensor = torch.empty(spec.shape, dtype=DTYPES[spec.dtype])  # outside the lock
        entry = (key, tensor, byte_view(tensor), tensor.data_ptr(), spec.nbytes)
        with self._lock:
            self._allocations += 1
            self._in_use[entry[3]] = entry
            self._in_use_bytes += spec.nbytes
        return entry[1], entry[2]

    def add_landing(self, spec: TensorSpec, lead: int) -> None:
        """Keep a *landing* for ``spec``, unless one is free already: a tensor of ``spec``
        with ``lead`` writable bytes just before its data (which starts 64-byte aligned).

        A sealed link opens a record of a known layout (``lead`` bytes of frame head,
        then the tensor) straight into one, so the tensor needs no copy. Landings are
        made here only, after an authenticated frame showed the layout; they are
        released like any tensor and kept apart from plain buffers of their spec.
        """
        key = (spec.dtype, spec.shape, lead)
        with self._lock:
            if self._free.get(key) or self._cached_bytes + spec.nbytes > self._max_cached:
                return
        raw = torch.empty(lead + spec.nbytes + 64, dtype=torch.uint8)
        start = -(raw.data_ptr() + lead) % 64
        tensor = raw[start + lead : start + lead + spec.nbytes]
        tensor = tensor.view(DTYPES[spec.dtype]).view(spec.shape)
        landing = byte_view(raw)[start : start + lead + spec.nbytes]
        entry = (key, tensor, landing, tensor.data_ptr(), spec.nbytes)
        with self._lock:
            self._allocations += 1
            self._free[key].append(entry)
            self._cached_bytes += spec.nbytes

    def take_landing(self, spec: TensorSpec, lead: int) -> tuple[torch.Tensor, memoryview] | None:
        """A free landing (:meth:`add_landing`) and its ``lead + spec.nbytes`` bytes; None
        if there is none free (this never allocates)."""
        with self._lock:
            free = self._free.get((spec.dtype, spec.shape, lead))
            if not free:
                return None
            entry = free.pop()
            self._cached_bytes -= spec.nbytes
            self._reuses += 1
            self._in_use[entry[3]] = entry
            self._in_use_bytes += spec.nbytes
        return entry[1], entry[2]

    def release(self, tensor: torch.Tensor) -> None:
        """Give back the buffer under ``tensor`` (a view from :func:`as_tensor` is fine).

        Unknown tensors are ignored, so releasing twice is harmless.
        """
        ptr = tensor.data_ptr()
        with self._lock:
            entry = self._in_use.get(ptr)
            # an empty view may share its data pointer with a buffer: never release by it
            if entry is None or (entry[4] and not tensor.numel()):
                return
            del self._in_use[ptr]
            nbytes = entry[4]
            self._in_use_bytes -= nbytes
            if self._cached_bytes + nbytes <= self._max_cached:
                self._free[entry[0]].append(entry)
                self._cached_bytes += nbytes

    def statistics(self) -> PoolStatistics:
        with self._lock:
            return PoolStatistics(
                self._in_use_bytes, self._cached_bytes, self._allocations, self._reuses
            )
