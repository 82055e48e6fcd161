"""int8 and int4 linear layers and embeddings for CPU (and CUDA) stages.

Why these kernels (measured on the project's CPU; docs/weights.md):

- **int8** (:class:`Int8Linear`): weights int8 with one fp32 scale per output
  row; activations quantised per token (row) to int8 at each call in two
  passes (the values, then their rounding residue, each with its own scale:
  ~15 bits of activation precision), both multiplied in one
  ``torch._int_mm`` call (int32 accumulation) and rescaled to fp32. Integer
  accumulation is exact, so a row's output does not depend on how many rows
  share the call: batching and chunking leave results bit-identical.
  ``_int_mm`` needs more than 16 rows, so a short input is padded with zero
  rows. Of the int8 kernels tried it is the fastest here; weight-only
  ``_weight_int8pack_mm`` was 3-4x slower. On CPUs where torch has no fast
  int8 kernel for it (an AVX2-only AMD EPYC: ~200x slower than an fp32
  product, 2 s for the LM head of one token) the same integer sums are taken
  by fp32 products of the int8 values, converted a block of rows at a time:
  every partial sum is an integer below 2**24, so fp32 adds them exactly and
  the result is bit-identical (:func:`int8_sums`; which one runs is probed
  once per process).
- **int4** (:class:`Int4Linear`): GGUF's Q4_1 layout (``w = d * q + m`` per
  32 inputs, q in 0..15, kept exactly) in torch's CPU int4 packing, run by
  ``aten._weight_int4pack_mm_for_cpu`` (which computes ``(q - 8) * s + z``,
  so ``s = d`` and ``z = m + 8 d``) with bf16 activations, scales and zero
  points: its bf16 path is ~30x faster than its fp32 one on this CPU and
  about as fast as an fp32 ``linear`` (relative error ~0.3 %). On other
  devices (no such kernel) the matrix is dequantised per call instead.
- Embedding tables (and the LM head, which may share them) are int8 with one
  scale per vocabulary row (:class:`Int8Embedding`). The int8 format's head is
  W8A8 like its other products (exact integer sums). Every LM head (``packed``)
  takes those sums from oneDNN's int8 product (VNNI/AMX) of a packed copy of its
  rows (exact for a row whose ``127 * sum(a + 128)`` is below 2**24, i.e. every
  head row seen; others take :func:`int8_sums`; checked once per process on
  extreme values; a second copy of at most 64 MiB): 1.1 against 1.8 ms for the
  default model's head (the bf16 kernel below) and 2.7 ms by ``_int_mm``, the same
  bits as :func:`int8_sums`, so the int4 format's head is W8A8 too wherever that
  holds.
  Elsewhere the int4 format's head takes bf16 activations, as its int4 products do
  (``Int8Linear(bf16_activations=True)``): torch's weight-only int8 kernel
  (``aten._weight_int8pack_mm``) with bf16 inputs computes the 576 x 49,152
  head of the default model 2.3x faster than the padded ``_int_mm`` (2.0
  against 4.7 ms for one row on an AVX-512 EPYC; 1.7 against 3.8 ms on a
  Xeon), about a tenth of an int4 decode step, with the same int8 rows and
  the fp32 row scales applied after it. Perplexity is unchanged (26.47 against
  26.50, fp32 26.57); each row's result is independent of the batch, as with
  int4. Where the CPU has no native bf16 (no AVX-512 BF16 or AMX) the head stays
  W8A8: the rule (:func:`hetmesh.partition.formats.bf16_int8_head`) is read off
  the CPU's flags, never timed, so every process on one machine computes the
  same logits.

Activations in and out are fp32.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hetmesh.errors import ComputeError

INT4_GROUP = 32
_INT_MM_MIN_ROWS = 17  # torch._int_mm rejects 16 rows or fewer
# int8 x int8 products summed over at most this many inputs stay below 2**24
# (1024 * 127 * 127 < 16,777,216): fp32 holds every partial sum exactly
_EXACT_FP32_K = 1024
_EXACT_ROW_BLOCK = 1024  # weight rows converted to fp32 at once (~2.4 MB at k = 576)
_INT4_BLOCK_N = 64  # int4 matrices are padded to whole blocks of 64 rows (see _INT4_LAYOUTS)


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(q int8 (n, k), scale fp32 (n,))`` with ``w ~= q * scale``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of 32 inputs (Q4_1's rule).

    Returns ``(q uint8 (n, k) in 0..15, d fp32 (n, k/32), m fp32 (n, k/32))``
    with ``w ~= d * q + m``.
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low, high = w.amin(dim=2), w.amax(dim=2)
    d = (high - low) / 15.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - low[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, low


def fit_groups_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like :func:`quantize_groups_int4`, with each group's ``(d, m)`` then refitted by
    least squares to the values its rounded ``q`` stand for, and ``q`` rounded again.

    For requantising a wider K-quant (Q5_K, Q6_K) to 4 bits: the min-max rule spends
    its 16 levels on a group's two extremes; the refit lowers the error against the
    file's values by about a third (Q6_K: 2.9 % -> 1.9 % relative RMS over the default
    model's ``down_proj``; docs/weights.md). One refit: a second changed nothing there.
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
    d = (high - low).div_(15.0)
    ones = torch.ones_like(d)
    q = (w - low).div_(torch.where(d > 0, d, ones)).round_().clamp_(0, 15)
    q_mean, w_mean = q.mean(dim=2, keepdim=True), w.mean(dim=2, keepdim=True)
    centred = q - q_mean
    spread = centred.square().sum(dim=2, keepdim=True)
    slope = (centred * (w - w_mean)).sum(dim=2, keepdim=True)
    del centred
    fitted = torch.where(spread > 0, slope / torch.where(spread > 0, spread, ones), d)
    # a group whose refit turned its slope non-positive keeps the min-max rule
    keep = fitted <= 0
    d = torch.where(keep, d, fitted)
    m = torch.where(keep, low, w_mean - fitted * q_mean)
    q = (w - m).div_(torch.where(d > 0, d, ones)).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), d.squeeze(2), m.squeeze(2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` uint8 (n, k) in 0..15, n a multiple of 64 -> torch's CPU int4 packing (n, k/2)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # type: ignore[no-any-return]


def _unpack_halves(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``block`` rows and per input k, ``block / 2`` bytes whose low
    nibbles are the block's first half of rows and high nibbles its second."""
    n, half = packed.shape
    k = half * 2
    flat = packed.reshape(n // block, k, block // 2)
    rows = torch.cat([flat & 0xF, flat >> 4], dim=2)  # (blocks, k, block)
    return rows.permute(0, 2, 1).reshape(n, k)


def _unpack_pairs(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``block`` rows and per input k, ``block / 2`` bytes each holding
    rows 2j (low nibble) and 2j + 1 (high)."""
    n, half = packed.shape
    k = half * 2
    flat = packed.reshape(n // block, k, block // 2, 1)
    rows = torch.cat([flat & 0xF, flat >> 4], dim=3).reshape(n // block, k, block)
    return rows.permute(0, 2, 1).reshape(n, k)


# torch packs by the CPU's vector width (its int4mm kernel: AVX-512 pairs rows n
# and n + 32 of each 64, AVX2 rows n and n + 16 of each 32, plain builds rows
# 2j and 2j + 1); each candidate divides 64, so a matrix padded to 64 rows never
# has a partial block, and packed matrices stack along their rows
_INT4_LAYOUTS: tuple[tuple[str, Callable[[torch.Tensor, int], torch.Tensor], int], ...] = (
    ("halves of 64", _unpack_halves, 64),
    ("halves of 32", _unpack_halves, 32),
    ("pairs in 32", _unpack_pairs, 32),
    ("pairs in 64", _unpack_pairs, 64),
)


@functools.cache
def _int4_layout() -> int:
    """Which of :data:`_INT4_LAYOUTS` this process's torch packs in (probed once)."""
    seeded = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (2 * _INT4_BLOCK_N, 64), dtype=torch.uint8, generator=seeded)
    packed = pack_int4(probe)
    for index, (_name, unpack, block) in enumerate(_INT4_LAYOUTS):
        if torch.equal(unpack(packed, block), probe):
            return index
    raise ComputeError(
        f"torch {torch.__version__} packs int4 weights in a layout hetmesh does not know "
        f"(CPU capability {torch.backends.cpu.get_cpu_capability()}); serve another format"
    )


def int4_layout_name() -> str:
    """The int4 packing this process uses, e.g. ``"halves of 64"`` on AVX-512."""
    return _INT4_LAYOUTS[_int4_layout()][0]


def unpack_int4(packed: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: (n, k/2) -> uint8 (n, k), n a multiple of 64.

    The layout is ``layout`` (one of :func:`int4_layout_name`'s names), by default the
    one this process's torch packs in (it follows the CPU's vector width), found once
    by packing a probe.
    """
    index = _int4_layout() if layout is None else [n for n, *_ in _INT4_LAYOUTS].index(layout)
    _name, unpack, block = _INT4_LAYOUTS[index]
    return unpack(packed, block)


def _sums_in_float32(a: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
    """``a (m, k) int8 @ weight_q (n, k).T`` as fp32, equal to ``_int_mm(...).float()``.

    Per chunk of at most :data:`_EXACT_FP32_K` inputs each sum is an exact fp32
    integer; chunks are added in fp64 (exact) and rounded to fp32 once, as the
    int32 sum's conversion rounds it.
    """
    m, k = a.shape
    n = weight_q.shape[0]
    chunks = range(0, k, _EXACT_FP32_K)
    parts = []
    for k0 in chunks:
        left = a[:, k0 : k0 + _EXACT_FP32_K].float()
        part = torch.empty(m, n)
        for r0 in range(0, n, _EXACT_ROW_BLOCK):
            block = weight_q[r0 : r0 + _EXACT_ROW_BLOCK, k0 : k0 + _EXACT_FP32_K].float()
            torch.mm(left, block.t(), out=part[:, r0 : r0 + _EXACT_ROW_BLOCK])
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    total = parts[0].double()
    for part in parts[1:]:
        total += part
    return total.float()


def _sums_by_int_mm(a: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
    rows = a.shape[0]
    if rows < _INT_MM_MIN_ROWS:
        a = F.pad(a, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
    return torch._int_mm(a, weight_q.t())[:rows].float()


@functools.cache
def int8_kernel() -> str:
    """``"int_mm"`` where torch's int8 kernel is fast on this CPU, else ``"float32"``.

    Probed once per process on a decode-sized product: both give the same bits,
    so the choice changes speed only. ``HETMESH_INT8_KERNEL`` forces one.
    """
    forced = os.environ.get("HETMESH_INT8_KERNEL", "")
    if forced in ("int_mm", "float32"):
        return forced
    seeded = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (2, 512), dtype=torch.int8, generator=seeded)
    w = torch.randint(-127, 128, (2048, 512), dtype=torch.int8, generator=seeded)

    def best(sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            sums(a, w)
            times.append(time.perf_counter() - start)
        return min(times)

    # a fast int8 kernel is within a small factor of fp32; the slow one is ~100x off
    return "int_mm" if best(_sums_by_int_mm) <= 4 * best(_sums_in_float32) else "float32"


def int8_sums(a: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
    """Exact ``a (m, k) int8 @ weight_q (n, k).T`` as fp32 ``(m, n)``, by the faster kernel."""
    if a.device.type != "cpu" or int8_kernel() == "int_mm":
        return _sums_by_int_mm(a, weight_q)
    return _sums_in_float32(a, weight_q)


PACKED_HEAD_ENV = "HETMESH_PACKED_INT8_HEAD"  # "0": heads keep int8_sums (A/B runs)
# the most int8 bytes a head keeps a packed copy of beside its rows (the default
# model's 49,152 x 576 head: 27 MiB; a 1B's 128,256 x 2,048: 250 MiB, not packed)
_PACKED_MAX_BYTES = 64 << 20
_PACKED_MAX_K = 1024  # wider: most rows would miss _PACKED_BOUND
_U8_ZERO = 128  # int8 activations a as uint8 a + 128 (oneDNN's u8 x s8 product)
# oneDNN sums (a + 128) * w in int32 and converts that to fp32 before taking
# 128 * sum(w) off: a sum is exact while |sum((a + 128) w)| < 2**24, which holds for a
# row whose 127 * sum(a + 128) is below it (checked with extreme values: tests)
_PACKED_BOUND = 2**24


def packed_head_bytes(rows: int, width: int) -> int:
    """Bytes of the packed copy an int head of ``(rows, width)`` keeps beside its rows
    (``Int8Linear(packed=True)`` where :func:`packed_int8_exact`; 0 where its shape
    takes none): the planner charges it (``WeightBytes.head_pack_bytes``)."""
    if width > _PACKED_MAX_K or rows * width > _PACKED_MAX_BYTES:
        return 0
    return rows * (width + 4)  # and oneDNN's int32 compensation per row


def _pack_for_onednn(weight_q: torch.Tensor) -> torch.Tensor:
    """``weight_q (n, k)`` int8 in oneDNN's blocked layout for its int8 product."""
    packed: torch.Tensor = torch.ops.onednn.qlinear_prepack(weight_q, [1, weight_q.shape[1]])
    return packed


def _sums_packed(a: torch.Tensor, packed: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
    """Exact ``a (m, k) int8 @ weight_q.T`` as fp32 ``(m, n)`` by oneDNN's product of
    ``packed`` (:func:`_pack_for_onednn` of ``weight_q``; unit scales, no zero point),
    equal to ``_int_mm(...).float()`` where :func:`packed_int8_exact` holds; a call
    with a row oneDNN could round (``127 * sum(a + 128)`` reaching 2**24: ~all of a
    row's inputs near +127, not seen in a head's activations) takes :func:`int8_sums`."""
    u8 = a.to(torch.int16).add_(_U8_ZERO)
    if a.shape[0] and int(u8.sum(1).max()) * 127 >= _PACKED_BOUND:
        return int8_sums(a, weight_q)
    return _onednn_sums(u8.to(torch.uint8), packed, weight_q.shape[0])


def _onednn_sums(u8: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """oneDNN's ``(u8 - 128) @ W.T`` as fp32 ``(m, n)``, W :func:`_pack_for_onednn`'d."""
    ones, zeros = _unit_weight_scales(n)
    out: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
        u8, 1.0, _U8_ZERO, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return out


@functools.cache
def _unit_weight_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n, dtype=torch.float32), torch.zeros(n, dtype=torch.int64)


@functools.cache
def packed_int8_exact() -> bool:
    """Whether heads take oneDNN's prepacked int8 product (:func:`_sums_packed`) here:
    where this torch has it and it sums exactly, checked once on extreme values (a CPU
    without VNNI would saturate its pairwise sums at 16 bits), never timed; off with
    ``HETMESH_PACKED_INT8_HEAD=0``. Its sums are :func:`int8_sums`' bits, so the
    choice changes speed only."""
    if os.environ.get(PACKED_HEAD_ENV, "").strip() == "0":
        return False
    seeded = torch.Generator().manual_seed(0)
    k = 576
    a = torch.randint(-127, 128, (6, k), dtype=torch.int8, generator=seeded)
    w = torch.randint(-127, 128, (96, k), dtype=torch.int8, generator=seeded)
    w[0], w[1] = 127, -127  # with a's 127s: pair sums past 16 bits (no VNNI saturates)
    w[2] = torch.randint(118, 128, (k,), dtype=torch.int8, generator=seeded)
    a[0, :400], a[1] = 127, -127
    a[2] = torch.randint(90, 101, (k,), dtype=torch.int8, generator=seeded)  # near the bound
    u8 = a.to(torch.int16).add_(_U8_ZERO)
    assert int(u8.sum(1).max()) * 127 < _PACKED_BOUND  # oneDNN's own sums are checked
    try:
        got = _onednn_sums(u8.to(torch.uint8), _pack_for_onednn(w), w.shape[0])
    except (AttributeError, NotImplementedError, RuntimeError):
        return False  # no oneDNN int8 product in this torch or on this CPU
    return torch.equal(got, _sums_in_float32(a, w))


def _row_scale(rows: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 scale ``(m, 1)``."""
    return rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0


class Int8Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W int8 per output row and x quantised per token
    (or, with ``bf16_activations``, on a CPU, x in bf16: see the module docstring)."""

    weight_q: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device: torch.device | str,
        bf16_activations: bool = False,
        packed: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bf16_activations = bf16_activations
        # an LM head: W8A8 by oneDNN's product from a packed copy of its rows (made at
        # the first call) where packed_int8_exact() holds and the rows fit
        # _PACKED_MAX_BYTES; before bf16_activations' rule
        self.packed = (
            packed
            and in_features <= _PACKED_MAX_K
            and in_features * out_features <= _PACKED_MAX_BYTES
        )
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, their pack)
        self.register_buffer(
            "weight_q", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer(
            "weight_scale", torch.empty(out_features, dtype=torch.float32, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
            if bias
            else None
        )

    def _packed_rows(self) -> torch.Tensor | None:
        """The packed copy of ``weight_q`` where this head takes it, else None."""
        if not self.packed or self.weight_q.device.type != "cpu" or not packed_int8_exact():
            return None
        held = self._packed
        if held is None or held[0] is not self.weight_q:  # (re)made for these rows
            held = self._packed = (self.weight_q, _pack_for_onednn(self.weight_q))
        return held[1]

    def packed_bytes(self) -> int:
        """Bytes of the packed copy this head makes at its first call here (0: none); a
        plain attribute, so not among the module's tensors (StageModule.resident_bytes)."""
        if not self.packed or self.weight_q.device.type != "cpu" or not packed_int8_exact():
            return 0
        return packed_head_bytes(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()  # (m, k)
        packed = self._packed_rows()
        if packed is None and self.bf16_activations and rows.device.type == "cpu":
            # unit scales in the kernel, the fp32 row scales after it: only the
            # activations and the raw sums are rounded to bf16
            sums: torch.Tensor = torch.ops.aten._weight_int8pack_mm(
                rows.to(torch.bfloat16), self.weight_q, _unit_scales(self.out_features)
            )
            out = sums.float() * self.weight_scale
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*lead, self.out_features)
        m = rows.shape[0]
        # Two int8 passes: the activations, then what their rounding left over.
        # One pass costs ~5 % perplexity on SmolLM2 (outlier activations); the
        # second brings it to ~0.3 % and rides in the same _int_mm call (a
        # decode row is padded to 17 rows anyway).
        x_scale = _row_scale(rows)  # (m, 1)
        xq = torch.round(rows / x_scale)
        rest = rows - xq * x_scale
        rest_scale = _row_scale(rest)
        rq = torch.round(rest / rest_scale)
        both = torch.cat([xq, rq]).to(torch.int8)  # (2m, k)
        if packed is not None:  # (2m, n), exact integer sums
            acc = _sums_packed(both, packed, self.weight_q)
        else:
            acc = int8_sums(both, self.weight_q)
        out = (acc[:m] * x_scale + acc[m : 2 * m] * rest_scale) * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = "bf16 activations" if self.bf16_activations else "W8A8 (two passes)"
        if self.packed:
            kind += ", W8A8 packed where exact"
        return f"in={self.in_features}, out={self.out_features}, int8 {kind}"


@functools.cache
def _unit_scales(n: int) -> torch.Tensor:
    sums_only: torch.Tensor = torch.ones(n, dtype=torch.bfloat16)
    return sums_only


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W in 4-bit groups of 32 (scale and minimum per group)."""

    weight_packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, device: torch.device | str
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # torch's packing works on blocks of 64 rows: pad with zero rows
        self.padded_out = -(-out_features // _INT4_BLOCK_N) * _INT4_BLOCK_N
        groups = in_features // INT4_GROUP
        self.register_buffer(
            "weight_packed",
            torch.empty(self.padded_out, in_features // 2, dtype=torch.uint8, device=device),
        )
        # (groups, n, 2): scale, and zero point z = m + 8 * d as the kernel wants,
        # in bf16: the kernel's bf16 path is ~30x faster here than its fp32 one
        self.register_buffer(
            "scales_zeros",
            torch.empty(groups, self.padded_out, 2, dtype=torch.bfloat16, device=device),
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
            if bias
            else None
        )

    @staticmethod
    def pack(
        q: torch.Tensor, d: torch.Tensor, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q (n, k), d (n, g), m (n, g))`` -> ``(weight_packed, scales_zeros)``."""
        n = q.shape[0]
        pad = -(-n // _INT4_BLOCK_N) * _INT4_BLOCK_N - n
        d, m = d.float(), m.float()
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
            d, m = F.pad(d, (0, 0, 0, pad)), F.pad(m, (0, 0, 0, pad))
        zeros = m + 8.0 * d
        scales_zeros = torch.stack([d.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        return pack_int4(q), scales_zeros

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight ``(out, in)`` this layer multiplies by."""
        q = unpack_int4(self.weight_packed).float()  # (n, k)
        n, k = q.shape
        scale = self.scales_zeros[..., 0].t().float()[..., None]  # (n, g, 1)
        zero = self.scales_zeros[..., 1].t().float()[..., None]
        w = (q.reshape(n, k // INT4_GROUP, INT4_GROUP) - 8.0) * scale + zero
        return w.reshape(n, k)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)  # (m, k)
        if rows.device.type == "cpu":
            # bf16 in, fp32 out; each row's result is independent of the others. As few
            # calls as the product needs: a decode step makes 210 of these.
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.weight_packed, INT4_GROUP, self.scales_zeros
            )
            if self.padded_out != self.out_features:
                out = out[:, : self.out_features]
            out = out.float()
        else:
            out = F.linear(rows.float(), self.dequantized())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group {INT4_GROUP}"


class Int8Embedding(nn.Module):
    """A token table in int8 with one fp32 scale per row; lookups return fp32 rows."""

    weight_q: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, num_embeddings: int, dim: int, *, device: torch.device | str) -> None:
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.register_buffer(
            "weight_q", torch.empty(num_embeddings, dim, dtype=torch.int8, device=device)
        )
        self.register_buffer(
            "weight_scale", torch.empty(num_embeddings, dtype=torch.float32, device=device)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_q[ids].float() * self.weight_scale[ids][..., None]


__all__ = [
    "INT4_GROUP",
    "PACKED_HEAD_ENV",
    "Int4Linear",
    "Int8Embedding",
    "Int8Linear",
    "fit_groups_int4",
    "int8_kernel",
    "int8_sums",
    "pack_int4",
    "packed_int8_exact",
    "quantize_groups_int4",
    "quantize_rows_int8",
    "unpack_int4",
]
