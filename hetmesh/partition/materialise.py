"""Fill a stage's meta skeleton with its own tensors, each already in the stage's format.

Tensors are read one at a time (large tables a slice of rows at a time) from
the folder's checkpoint, converted to the stage's format and placed with
``accelerate.utils.set_module_tensor_to_device``; nothing holds a float copy
of more than one tensor (or slice), so loading a stage peaks close to the
stage's own resident bytes.

An int4 stage holds each decoder matrix stored as 4-bit groups (Q4_1, Q4_0,
Q4_K) as those groups, exactly; a matrix stored in a wider K-quant (Q5_K,
Q6_K: the tensors a Q4_K_M file keeps at more bits) is held in int8 per row
where the conversion recorded it so (``hetmesh_int8_linears`` in
``config.json``, what the planner charges: as many as keep the model within
1.09x the file, :func:`~hetmesh.partition.gguf_compact.wide_in_int8`;
:func:`hold_wide_blocks_in_int8`), else requantised to int4 groups fitted to its
values (:func:`~hetmesh.partition.quant.fit_groups_int4`: not exact, the error
is in docs/weights.md).

A load runs in a thread; :func:`cancel_on` gives it an event that, once set,
stops it at the next tensor (:class:`LoadCancelled`): a node whose plan moved on
does not finish a stage it will not serve.

Raises :class:`~hetmesh.errors.CorruptModel` for a missing or misshapen tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetmesh.errors import CorruptModel
from hetmesh.partition.checkpoint import BLOCK, K_KINDS, ROW_CHUNK, CheckpointReader
from hetmesh.partition.formats import bf16_int8_head
from hetmesh.partition.fused import fuse_layer
from hetmesh.partition.int4_direct import GROUP as INT4_GROUP
from hetmesh.partition.int4_direct import pack_q4_1_into, scales_zeros
from hetmesh.partition.kquant import KQuantEmbedding
from hetmesh.partition.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    fit_groups_int4,
    quantize_groups_int4,
    quantize_rows_int8,
)

# Held while accelerate's init_empty_weights patches nn.Module.register_parameter for
# the whole process, and while a parameter is assigned through it here: otherwise a
# stage loading in another thread meanwhile gets its assigned parameter put on meta.
META_PATCH_LOCK = threading.Lock()

# int4 packing: rows a slice (a multiple of the 64-row block packed matrices stack by)
# holding about this many weights; see _Loader.int4
INT4_ROW_BLOCK = 64
INT4_CHUNK_WEIGHTS = 4 << 20
# a table (embedding, head) is converted a slice of rows at a time of at most this
# many weights (and at most ROW_CHUNK rows): its fp32 temporaries stay ~4 MB each
TABLE_CHUNK_WEIGHTS = 1 << 20
# OpenMP threads of the thread that loads (see load_threads)
LOAD_THREADS = 1


_CANCEL = threading.local()  # .event: the calling thread's load's cancel event


class LoadCancelled(Exception):
    """The load's cancel event was set (:func:`cancel_on`); what it loaded is dropped."""


@contextmanager
def cancel_on(event: threading.Event) -> Iterator[None]:
    """Loads in the calling thread stop with :class:`LoadCancelled` once ``event`` is set
    (checked before each tensor: a load stops within one tensor's work)."""
    before = getattr(_CANCEL, "event", None)
    _CANCEL.event = event
    try:
        yield
    finally:
        _CANCEL.event = before


def check_cancelled() -> None:
    """Raise :class:`LoadCancelled` if the calling thread's load was cancelled."""
    event = getattr(_CANCEL, "event", None)
    if event is not None and event.is_set():
        raise LoadCancelled("the stage's load was cancelled")


def _rows_per_chunk(width: int) -> int:
    return max(1, min(ROW_CHUNK, TABLE_CHUNK_WEIGHTS // max(width, 1)))


def materialise(
    stage: Any,
    folder: Path,
    config: dict[str, Any],
    *,
    fuse: bool = False,
    column_major_head: bool = False,
) -> None:
    """Load ``stage``'s tensors from ``folder`` (see the module docstring).

    With ``fuse``, each decoder layer's projection groups are stacked
    (:func:`~hetmesh.partition.fused.fuse_layer`) as soon as the layer is
    loaded: the copies made then cost one layer, and the freed pieces are
    reused by the next layer's tensors.

    With ``column_major_head`` a float head matrix is written straight into
    column-major storage (``weight.t()`` contiguous; see
    :func:`hetmesh.partition.stage.load_stage`), and so is a tied embedding
    the head will share: no second copy is ever made.
    """
    with load_threads():
        _materialise(stage, folder, config, fuse=fuse, column_major_head=column_major_head)


@contextmanager
def load_threads(threads: int = LOAD_THREADS) -> Iterator[None]:
    """Run the calling thread's torch ops on ``threads`` OpenMP threads, then restore its count.

    Why: ``torch.set_num_threads`` sets the *calling* thread's OpenMP team, and a node
    loads its stages in a reused worker thread whose count is whatever ran there
    before (the CPU profile leaves it at the machine's core count). A load's work is
    copies and byte operations at memory speed; on a loaded machine a team of two
    spin-waits at every barrier of every op: one 8B stage's load used 4.5x the CPU
    time and 3x the wall time with two threads as with one
    (docs/journal/2026-12-06-bigmodel.md).
    """
    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _materialise(
    stage: Any, folder: Path, config: dict[str, Any], *, fuse: bool, column_major_head: bool
) -> None:
    tied = bool(config.get("tie_word_embeddings", False))
    check_cancelled()
    with CheckpointReader(folder) as reader:
        loader = _Loader(stage, reader, folder)
        shared_head = tied and stage.lm_head is not None and reader.kind("lm_head.weight") is None
        if stage.embed_tokens is not None and not shared_head:
            _keep_table_blocks(stage, reader)
        if isinstance(stage.embed_tokens, KQuantEmbedding):
            loader.blocks("embed_tokens", stage.embed_tokens, "model.embed_tokens.weight")
        elif stage.embed_tokens is not None:
            loader.table(
                "embed_tokens",
                stage.embed_tokens,
                "model.embed_tokens.weight",
                column_major=column_major_head and shared_head,
            )
        recorded = config.get(INT8_LINEARS_KEY) or {}
        for local, global_index in enumerate(stage.layer_range):
            layer = stage.layers[local]
            hold_wide_blocks_in_int8(layer, recorded.get(str(global_index), ()))
            for sub, module in layer.named_modules():
                path = f"layers.{local}.{sub}" if sub else f"layers.{local}"
                source = f"model.layers.{global_index}.{sub}" if sub else ""
                loader.module(path, module, source)
            if fuse:
                with META_PATCH_LOCK:  # new parameters: see META_PATCH_LOCK
                    fuse_layer(layer)
                _release_freed_memory()
        if stage.norm is not None:
            loader.module("norm", stage.norm, "model.norm")
        if stage.lm_head is not None:
            head_source = "lm_head.weight"
            if reader.kind(head_source) is None:
                if not tied:
                    raise CorruptModel(f"{folder}: no lm_head.weight and embeddings are not tied")
                head_source = "model.embed_tokens.weight"  # tied: the head reads the embedding
            if stage.embed_tokens is not None and head_source == "model.embed_tokens.weight":
                _share_table(stage)
            else:
                loader.table("lm_head", stage.lm_head, head_source, column_major=column_major_head)
    left = [name for name, t in _tensors(stage) if t.is_meta]
    if left:
        raise CorruptModel(f"{folder}: no tensors for {left[:3]}")


WIDE_KINDS = ("q5_k", "q6_k")  # stored at more than 4 bits: refitted to int4 groups
INT8_LINEARS_KEY = "hetmesh_int8_linears"  # gguf_compact's record: these stay int8


def hold_wide_blocks_in_int8(layer: nn.Module, names: Iterable[str]) -> int:
    """Swap ``layer``'s int4 linears named in ``names`` (``"mlp.down_proj"``: those an
    older conversion recorded as held in int8) for int8 ones (still on meta);
    returns how many.

    Such a folder's ``config.json`` makes the planner charge those matrices as
    int8, so the stage holds them so. Like the int4 format's head they take bf16
    activations where the CPU multiplies bf16 natively
    (:func:`~hetmesh.partition.formats.bf16_int8_head`), else W8A8.
    """
    wanted = set(names)
    swapped = 0
    for sub, module in list(layer.named_modules()):
        if not isinstance(module, Int4Linear) or sub not in wanted:
            continue
        parent_name, _, name = sub.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        wide = Int8Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device="meta",
            bf16_activations=bf16_int8_head(),
        )
        setattr(parent, name, wide)
        swapped += 1
    return swapped


def _keep_table_blocks(stage: Any, reader: CheckpointReader) -> None:
    """A compact stage's token table stored as K-quant blocks stays in them (exact, and
    4.5 bits a weight for Q4_K against int8's 8): :class:`KQuantEmbedding`. Not when
    the head shares the table (it multiplies by an int8 copy)."""
    table = stage.embed_tokens
    kind = reader.kind("model.embed_tokens.weight")
    if isinstance(table, Int8Embedding) and kind in K_KINDS:
        stage.embed_tokens = KQuantEmbedding(kind, table.num_embeddings, table.dim, device="meta")


def rows_into_int8(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`~hetmesh.partition.quant.quantize_rows_int8` of fp32 rows ``w`` into ``q``
    and ``scale``, bit for bit, computed in ``w``'s own storage (which it overwrites):
    no absolute-value, quotient or rounded temporaries of the slice."""
    amax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_())  # |w|'s largest, exactly
    torch.div(amax.clamp_min_(1e-30), 127.0, out=scale)
    w.div_(scale[:, None]).round_().clamp_(-127, 127)
    q.copy_(w)


def q8_0_into_int8(qs: torch.Tensor, d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`rows_into_int8` of Q8_0 rows (``qs`` int8 ``(n, k)``, ``d`` fp16
    ``(n, k/32)``) as :meth:`CheckpointReader.rows` dequantises them, bit for bit, with
    one fp32 copy of the slice instead of three: the row's largest ``|w|`` is read off
    the int8 blocks (``|q * d|`` rounds as ``|q| * |d|`` does, and rounding keeps the
    order), the product is taken in place."""
    n, k = qs.shape
    blocks = qs.view(n, k // BLOCK, BLOCK)
    df = d.float()
    largest = torch.maximum(blocks.amax(dim=2).float(), blocks.amin(dim=2).float().neg_())
    amax = largest.mul_(df.abs()).amax(dim=1)
    torch.div(amax.clamp_min_(1e-30), 127.0, out=scale)
    w = blocks.float()
    w.mul_(df[..., None]).div_(scale[:, None, None]).round_().clamp_(-127, 127)
    q.copy_(w.view(n, k))


def _tensors(stage: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*stage.named_parameters(), *stage.named_buffers()]


def _share_table(stage: Any) -> None:
    """A stage holding both ends of a tied model keeps one matrix for both."""
    with META_PATCH_LOCK:  # the assignment registers a parameter: see META_PATCH_LOCK
        if isinstance(stage.embed_tokens, Int8Embedding):
            stage.lm_head.weight_q = stage.embed_tokens.weight_q
            stage.lm_head.weight_scale = stage.embed_tokens.weight_scale
        else:
            stage.lm_head.weight = stage.embed_tokens.weight


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them after large frees).

    Without it the float temporaries of each converted tensor pile up in the
    allocator and loading a compact stage peaks at 3x its resident bytes.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


class _Loader:
    def __init__(self, stage: Any, reader: CheckpointReader, folder: Path) -> None:
        self.stage, self.reader, self.folder = stage, reader, folder
        self.device: torch.device = stage.device
        self.dtype: torch.dtype = stage.dtype

    def put(self, path: str, value: torch.Tensor) -> None:
        from accelerate.utils import set_module_tensor_to_device

        _release_freed_memory()
        check_cancelled()  # the tensors put so far go with the stage
        try:
            set_module_tensor_to_device(
                self.stage, path, self.device, value=value, dtype=value.dtype
            )
        except ValueError as exc:  # accelerate's shape check
            raise CorruptModel(f"{self.folder}: tensor for {path}: {exc}") from exc

    def expect(self, source: str, shape: tuple[int, ...]) -> None:
        found = self.reader.shape(source)
        if found != shape:
            raise CorruptModel(
                f"{self.folder}: tensor {source} has shape {found}, config says {shape}"
            )

    def module(self, path: str, module: nn.Module, source: str) -> None:
        """Own parameters of ``module`` (not its children), from ``source.<name>``."""
        if isinstance(module, Int8Linear):
            self.expect(f"{source}.weight", (module.out_features, module.in_features))
            q, scale = quantize_rows_int8(self.reader.tensor(f"{source}.weight"))
            self.put(f"{path}.weight_q", q)
            self.put(f"{path}.weight_scale", scale)
        elif isinstance(module, Int4Linear):
            self.int4(path, module, f"{source}.weight")
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta:
                self.float_param(f"{path}.{name}", f"{source}.{name}", tuple(param.shape))

    def float_param(
        self, path: str, source: str, shape: tuple[int, ...], *, column_major: bool = False
    ) -> None:
        self.expect(source, shape)
        if len(shape) == 1:
            self.put(path, self.reader.tensor(source).to(self.dtype))
            return
        if column_major:  # a (rows, cols) view of (cols, rows) storage
            out = torch.empty(shape[::-1], dtype=self.dtype, device=self.device).t()
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        step = _rows_per_chunk(shape[1])
        for start in range(0, shape[0], step):
            stop = min(start + step, shape[0])
            self.reader.rows_into(source, start, stop, out[start:stop])
        self.put(path, out)

    def int4(self, path: str, module: Int4Linear, source: str) -> None:
        """Packed a slice of rows at a time: packing goes through an int32 copy of its
        input (4 bytes a weight), so a whole 8B MLP matrix would cost 235 MB at once."""
        rows_n, k = module.out_features, module.in_features
        self.expect(source, (rows_n, k))
        if self.reader.kind(source) == "q4_1":
            self.int4_q4_1(path, source, rows_n, k)
            return
        # the shipped blocks (Q4_K's exact groups of 32), kept exactly; Q5_K/Q6_K
        # refitted (not exact); anything else (float) by Q4_1's min-max rule
        shipped = self.reader.kind(source) == "q4_k"
        fit = fit_groups_int4 if self.reader.kind(source) in WIDE_KINDS else quantize_groups_int4
        chunk = max(INT4_ROW_BLOCK, INT4_CHUNK_WEIGHTS // k // INT4_ROW_BLOCK * INT4_ROW_BLOCK)
        packed: torch.Tensor | None = None
        scales_zeros: torch.Tensor | None = None
        for start in range(0, rows_n, chunk):
            stop = min(start + chunk, rows_n)
            if shipped:
                q, d, m = self.reader.q4_rows(source, start, stop)
            else:
                q, d, m = fit(self.reader.rows(source, start, stop))
            part, part_sz = Int4Linear.pack(q, d, m)  # rows padded to a block of 64
            del q, d, m
            if packed is None or scales_zeros is None:
                padded = -(-rows_n // INT4_ROW_BLOCK) * INT4_ROW_BLOCK
                packed = torch.empty((padded, *part.shape[1:]), dtype=part.dtype)
                scales_zeros = torch.empty(
                    (part_sz.shape[0], padded, *part_sz.shape[2:]), dtype=part_sz.dtype
                )
            packed[start : start + part.shape[0]] = part
            scales_zeros[:, start : start + part.shape[0]] = part_sz
            del part, part_sz
            _release_freed_memory()
            check_cancelled()
        assert packed is not None
        assert scales_zeros is not None
        self.put(f"{path}.weight_packed", packed.to(self.device))
        self.put(f"{path}.scales_zeros", scales_zeros.to(self.device))

    def int4_q4_1(self, path: str, source: str, rows_n: int, k: int) -> None:
        """A Q4_1 matrix packed straight from its bytes (:mod:`hetmesh.partition.int4_direct`):
        no one-byte-a-weight or int32 copy; a slice of rows at a time. Stored already in
        this CPU's packed layout (:meth:`CheckpointReader.q4_1_packed`): read as it is,
        into the tensor the stage keeps; only the scales are converted."""
        stored = self.reader.q4_1_packed(source)
        if (
            stored is not None
            and stored[0].shape == (rows_n, k // 2)
            and rows_n % INT4_ROW_BLOCK == 0
        ):
            check_cancelled()
            self.put(f"{path}.weight_packed", stored[0].to(self.device))
            self.put(f"{path}.scales_zeros", scales_zeros(stored[1], stored[2]).to(self.device))
            return
        padded = -(-rows_n // INT4_ROW_BLOCK) * INT4_ROW_BLOCK
        packed = torch.empty((padded, k // 2), dtype=torch.uint8)
        d = torch.zeros((padded, k // INT4_GROUP), dtype=torch.float16)
        m = torch.zeros((padded, k // INT4_GROUP), dtype=torch.float16)
        chunk = max(INT4_ROW_BLOCK, INT4_CHUNK_WEIGHTS // k // INT4_ROW_BLOCK * INT4_ROW_BLOCK)
        for start in range(0, rows_n, chunk):
            stop = min(start + chunk, rows_n)
            qs, d[start:stop], m[start:stop] = self.reader.q4_1_bytes(source, start, stop)
            whole = -(-(stop - start) // INT4_ROW_BLOCK) * INT4_ROW_BLOCK
            if whole != stop - start:  # the last rows, padded with zero weights
                qs = torch.cat([qs, qs.new_zeros((whole - (stop - start), k // 2))])
            pack_q4_1_into(qs, packed[start : start + whole])
            del qs
            check_cancelled()
        self.put(f"{path}.weight_packed", packed.to(self.device))
        self.put(f"{path}.scales_zeros", scales_zeros(d, m).to(self.device))

    def blocks(self, path: str, module: KQuantEmbedding, source: str) -> None:
        """A table kept as its K-quant blocks, a slice of rows at a time."""
        self.expect(source, (module.num_embeddings, module.dim))
        out = torch.empty(module.blocks.shape, dtype=torch.uint8, device=self.device)
        for start in range(0, module.num_embeddings, ROW_CHUNK):
            stop = min(start + ROW_CHUNK, module.num_embeddings)
            out[start:stop] = self.reader.k_blocks(source, start, stop)
        self.put(f"{path}.blocks", out)

    def table(
        self, path: str, module: nn.Module, source: str, *, column_major: bool = False
    ) -> None:
        """The embedding or head matrix, a slice of rows at a time (float: optionally
        into column-major storage)."""
        if isinstance(module, (Int8Embedding, Int8Linear)):
            rows_n = module.weight_q.shape[0]
            self.expect(source, tuple(module.weight_q.shape))
            q = torch.empty(module.weight_q.shape, dtype=torch.int8, device=self.device)
            scale = torch.empty(rows_n, dtype=torch.float32, device=self.device)
            step = _rows_per_chunk(int(module.weight_q.shape[1]))
            q8_0 = self.reader.kind(source) == "q8_0"
            for start in range(0, rows_n, step):
                stop = min(start + step, rows_n)
                if q8_0:  # from its blocks: the same bytes, a third of the fp32 passes
                    qs, d = self.reader.q8_0_bytes(source, start, stop)
                    q8_0_into_int8(qs, d, q[start:stop], scale[start:stop])
                else:
                    rows = self.reader.rows(source, start, stop)
                    rows_into_int8(rows, q[start:stop], scale[start:stop])
                _release_freed_memory()  # the slice's fp32 temporaries
                check_cancelled()
            self.put(f"{path}.weight_q", q)
            self.put(f"{path}.weight_scale", scale)
            return
        weight = module.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{path} has no weight tensor")
        self.float_param(f"{path}.weight", source, tuple(weight.shape), column_major=column_major)


__all__ = [
    "INT8_LINEARS_KEY",
    "LOAD_THREADS",
    "WIDE_KINDS",
    "LoadCancelled",
    "cancel_on",
    "check_cancelled",
    "hold_wide_blocks_in_int8",
    "load_threads",
    "materialise",
]
