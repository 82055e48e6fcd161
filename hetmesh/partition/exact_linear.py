"""Float linear layers whose result for a row does not depend on the other rows.

A CPU's BLAS picks its kernel by the call's shape, and each kernel sums a
row's products in its own order, so in ``float32`` and ``bfloat16`` one token's
projections differed in their last bits between a prompt prefilled whole and
in chunks, a session decoding alone and beside others, a history replayed and
the same tokens decoded one at a time (issue 44; the int4 and int8 kernels do
not have this: their rows are independent at every size). Measured on the
project's Xeon (torch 2.13, MKL 2024.2, oneDNN 3.12; docs/weights.md,
"Exactness"), for every matrix of the default model:

* ``float32`` ``F.linear`` (MKL) has three classes of call: 1 row (a
  matrix-vector kernel), 2 to 15 rows (one small-matrix kernel), 16 rows or
  more (the blocked kernel); within a class a row's result is the same, across
  them it differs. MKL's *packed* product (``cblas_sgemm_compute`` on a weight
  packed once at load, torch's ``mkl::_mkl_linear``) has one class for every
  call of 2 rows or more, and is as fast as ``F.linear`` from 2 rows to
  hundreds (faster for a decode round: the weight is not repacked per call).
  :func:`exact_linear` computes fp32 rows that way, in tiles of up to
  :data:`FLOAT32_PACKED_TILE` rows. A lone row (a decode step) takes a 1-row
  packed call: on this Xeon it gives the row the bits of every larger call
  (every shape probed, 1 and 2 threads) and, weights streamed from memory, is
  ~3 % faster than torch's matrix-vector kernel, where a row padded with a zero
  row (the fallback, where the probe refuses the 1-row call) is ~7 % slower.
  The packed copy replaces the layer's weight (kept only where another module
  shares its bytes, as a tied head does).
  Without MKL's packed product the rows go in tiles of 2 to 15 rows (the
  small-matrix class; a long prefill then pays ~2.5x).
* ``bfloat16`` ``F.linear`` (oneDNN) gives a row the same result for up to 32
  rows and not beyond; ``weight @ x.T`` gives the single row's result for up
  to 128 rows, but a prefill's 291 rows cost ~2x ``F.linear``'s that way (the
  product transposed, copied back). oneDNN's *prepacked* product (torch's
  ``mkldnn._linear_pointwise`` on a weight reordered once at load for one row,
  ``mkldnn._reorder_linear_weight(w, 1)``) gives a row the single row's result
  in every call up to 600 rows for most of the default model's shapes (up to
  128 for 576 x 1,536), bit-identical to ``weight @ x.T``'s, at 1 and 2
  threads, and costs about ``F.linear``'s in one call: :func:`make_exact` takes
  it where the probe proves it, in calls of up to the largest of
  :data:`BFLOAT16_PACKED_TILES` that holds (else ``weight @ x.T`` in tiles of
  128 as before). On AMD's EPYC (Zen 4: AVX-512 with bf16 dot products, no
  AMX) the same product gives 576 x 1,536 (the MLP's down projection) a lone
  row's bits in calls of up to 16 rows only, and neither ``F.linear`` nor
  ``weight @ x.T`` holds past 16 either: calls of 16 there (a 291-row prefill
  ~12 % over one call, where one row per call cost 5x).
* On AMD's EPYC fp32's ``F.linear`` (the same MKL) computes rows in blocks of 4
  and, in a call of under 12 rows, a block's 1 to 3 leftover rows by other
  kernels (at 1 thread only calls of 1 to 3 rows): every call of 12 rows or more
  or of a multiple of 4 gives a row one result (up to 1,200 rows, 1 and 2
  threads, every shape; the head column-major too), and MKL's packed product
  holds only from 4 rows, its copies ~1.7x the weight's bytes. So
  :func:`make_exact` first tries ``F.linear`` on the weight as stored, a call of
  under 12 rows padded with zero rows to a multiple of 4 (a decode step's lone
  row to 4): no copy, a prefill and a round at torch's speed. MKL sums every
  output of those calls in one order (chains of 192 inputs, fused, the chains'
  sums added in order), so a call of up to 8 rows is computed in that very
  order by :mod:`hetmesh.partition.exact_kernel` (a small C kernel built at
  first use), where its probe holds: a lone row the bits of a large call at a
  matrix-vector's cost, where padded to 4 it paid 1.3 to 1.7x.

Other shapes draw the classes elsewhere (MKL treats a small matrix, K = 64,
its own way; its packed product differs at 3 rows for K = 2,048; oneDNN's
``weight @ x.T`` differs past 3 rows at K = 8,192), and so may another CPU or
BLAS. So :func:`make_exact` probes each distinct weight shape once, at load:
random rows computed in calls of 1 to 300 rows must equal the same rows
computed one by one, else the next way is probed (``F.linear`` padded to a
multiple of 4, packed with 1-row calls, packed with a lone row padded to 2, then
small tiles,
then one row per call: invariant by construction, every call has the same
shape; slower for a prefill, unchanged for a decode step).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetmesh.partition import exact_kernel

FLOAT32_TILE = 15  # MKL's small-matrix kernel: 2 to 15 rows
FLOAT32_PACKED_TILE = 256  # MKL's packed product: rows per call (2 to 256)
BFLOAT16_TILE = 128  # oneDNN's weight @ x.T: a row's sums as alone, up to 128 rows
BFLOAT16_PACKED_TILES = (512, 128, 32, 16)  # oneDNN's prepacked product: rows per call, tried
PACKED_FOR = 512  # the row count MKL packs the weight for (its blocking; not a limit)


def _float32_tiles(rows: int, tile: int = FLOAT32_TILE, least: int = 2) -> list[int]:
    """Tile sizes for ``rows`` rows, each ``least`` to ``tile`` (fewer rows than ``least``
    are one call, which the caller pads)."""
    if rows <= tile:
        return [rows]
    sizes = [tile] * (rows // tile)
    rest = rows % tile
    if 0 < rest < least:  # 15 + 1 -> 14 + 2 (least 2); 256 + 1 -> 253 + 4 (least 4)
        sizes[-1] -= least - rest
        rest = least
    if rest:
        sizes.append(rest)
    return sizes


def mkl_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed form of an fp32 CPU ``weight`` (out x in), or None where this torch
    build has no packed product."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    try:
        packed: torch.Tensor = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_FOR)
    except (RuntimeError, AttributeError):
        return None
    return packed


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked form of a bf16 CPU ``weight`` (out x in), reordered for one
    row (the blocking whose rows are invariant furthest), or None where this torch build
    has none."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    except (RuntimeError, AttributeError):
        return None
    return packed


def _onednn_linear() -> Any:
    """torch's op for oneDNN's prepacked product (looked up once)."""
    global _ONEDNN_LINEAR
    if _ONEDNN_LINEAR is None:
        _ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default
    return _ONEDNN_LINEAR


_ONEDNN_LINEAR: Any = None


def _onednn(rows: torch.Tensor, packed: torch.Tensor, tile: int, lone: bool = True) -> torch.Tensor:
    """``rows @ weight.T`` by oneDNN's prepacked product, in calls of up to ``tile`` rows;
    a lone row in a 1-row call where ``lone``, else every call 2 rows or more (a lone row
    padded with a zero row)."""
    mm = _onednn_linear()
    rows = rows.contiguous()
    count = rows.shape[0]
    if count == 1 and not lone:
        pair = torch.cat((rows, _zero_row(rows.shape[1], rows.dtype)))
        padded: torch.Tensor = mm(pair, packed, None, "none", [], "")[:1]
        return padded
    if count <= tile:
        out: torch.Tensor = mm(rows, packed, None, "none", [], "")
        return out
    tiles = torch.split(rows, tile if lone else _float32_tiles(count, tile))
    return torch.cat([mm(t, packed, None, "none", [], "") for t in tiles])


# a few rows' padding, per width, dtype and count (never written)
_ZERO_ROWS: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}


def _zero_row(width: int, dtype: torch.dtype = torch.float32, count: int = 1) -> torch.Tensor:
    key = (width, dtype, count)
    row = _ZERO_ROWS.get(key)
    if row is None:
        with torch.inference_mode(False):  # a plain tensor, usable in and out of it
            row = _ZERO_ROWS.setdefault(key, torch.zeros(count, width, dtype=dtype))
    return row


def _mkl_linear() -> Any:
    """torch's op for MKL's packed product (looked up once)."""
    global _MKL_LINEAR
    if _MKL_LINEAR is None:
        _MKL_LINEAR = torch.ops.mkl._mkl_linear.default
    return _MKL_LINEAR


_MKL_LINEAR: Any = None


def _packed(
    rows: torch.Tensor,
    packed: torch.Tensor,
    shape_of: torch.Tensor,
    tile: int,
    lone: bool,
    least: int = 2,
) -> torch.Tensor:
    """``rows @ weight.T`` by MKL's packed product, every call ``least`` to ``tile`` rows
    (fewer padded with zero rows), a lone row in a call of its own where ``lone``.
    ``shape_of`` only gives the weight's shape (the call reads no other of its data
    when the row count passed is the call's own)."""
    mm = _mkl_linear()
    count = rows.shape[0]
    if count == 1 and lone:
        alone: torch.Tensor = mm(rows.contiguous(), packed, shape_of, None, 1)
        return alone
    if count < least:  # a decode step: the lean path (its overhead shows per step)
        pad = _zero_row(rows.shape[1], count=least - count)
        out: torch.Tensor = mm(torch.cat((rows, pad)), packed, shape_of, None, least)[:count]
        return out
    rows = rows.contiguous()
    if count <= tile:
        out = mm(rows, packed, shape_of, None, count)
        return out
    tiles = torch.split(rows, _float32_tiles(count, tile, least))
    return torch.cat([mm(t, packed, shape_of, None, t.shape[0]) for t in tiles])


HEAD_SLICE = 2048  # a large weight's output rows per F.linear call (a row's bits unchanged)


def _sliced(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(rows, weight)``, a large row-major weight (a head) in slices of
    :data:`HEAD_SLICE` output rows: each output's sum is the same (MKL blocks the
    outputs, not the sum), and a few rows' call streams it ~1.5x faster (AMD's EPYC,
    the head 49,152 x 576, 4 rows: 13.5 against 18.2 ms whole, 21.9 column-major;
    so load_stage keeps an fp32 head row-major where its linear layers are exact)."""
    if weight.shape[0] < 4 * HEAD_SLICE or weight.stride(1) != 1:
        return F.linear(rows, weight)
    return torch.cat([F.linear(rows, part) for part in torch.split(weight, HEAD_SLICE)], dim=-1)


def _quanta(
    rows: torch.Tensor,
    weight: torch.Tensor,
    tile: int,
    least: int,
    quantum: int,
    kernel: int = 0,
) -> torch.Tensor:
    """``rows @ weight.T`` by torch's own ``F.linear``, every call ``least`` to ``tile``
    rows or a multiple of ``quantum`` (a call of fewer than ``least`` rows padded with
    zero rows to the next multiple): AMD's EPYC, where MKL computes rows in blocks of 4
    and, below 12 rows, a block's 1 to 3 leftover rows by other kernels. Where
    ``kernel`` (its chains' length), a call of up to :data:`exact_kernel.ROWS` rows
    (8 with AVX-512) is computed by :mod:`hetmesh.partition.exact_kernel` in MKL's order instead
    (a decode step at a matrix-vector's cost, where padded it paid ~1.4x)."""
    count = rows.shape[0]
    if kernel and count <= exact_kernel.ROWS and exact_kernel.fits(rows, weight):
        return exact_kernel.kernel_rows(rows, weight, kernel)
    short = -count % quantum
    if count < least and short:  # a decode step or a small round
        padded = torch.cat((rows, _zero_row(rows.shape[1], count=short)))
        out: torch.Tensor = _sliced(padded, weight)[:count]
        return out
    if count <= tile:
        out = _sliced(rows, weight)
        return out
    tiles = torch.split(rows, _float32_tiles(count, tile, least))
    return torch.cat([_sliced(t, weight) for t in tiles])


def exact_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    tiled: bool = True,
    packed: torch.Tensor | None = None,
    tile: int = FLOAT32_PACKED_TILE,
    lone: bool = False,
    least: int = 2,
    quantum: int = 0,
    kernel: int = 0,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every row is computed as it would be alone:
    by MKL's ``packed`` product (fp32, :func:`mkl_pack` of ``weight``; ``weight`` then
    only gives the shape) in calls of up to ``tile`` rows (a lone row in a 1-row call
    where ``lone``, else every call ``least`` rows or more, padded), or oneDNN's (bf16,
    :func:`onednn_pack`) in calls of up to ``tile`` rows (a lone row in its own call
    where ``lone``, else padded to 2), or fp32's ``F.linear`` on the weight as stored
    where ``quantum`` (calls of ``least`` to ``tile`` rows or a multiple of
    ``quantum``, padded; a few rows by :mod:`~hetmesh.partition.exact_kernel` where
    ``kernel``, its chains' length), else in tiles (see the module's docstring), or
    one row per call where not ``tiled``."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    count = rows.shape[0]
    if packed is not None and rows.dtype == torch.float32:
        out = _packed(rows, packed, weight, tile, lone, least)
    elif quantum and rows.dtype == torch.float32:
        out = _quanta(rows, weight, tile, least, quantum, kernel)
    elif packed is not None and rows.dtype == torch.bfloat16:
        out = _onednn(rows, packed, tile, lone)
    elif not tiled and rows.dtype in (torch.float32, torch.bfloat16):
        parts = [F.linear(row, weight) for row in torch.split(rows, 1)]
        out = torch.cat(parts) if count > 1 else parts[0]
    elif rows.dtype == torch.float32:
        if count == 1:
            out = F.linear(F.pad(rows, (0, 0, 0, 1)), weight)[:1]
        else:
            tiles = _float32_tiles(count)
            if len(tiles) == 1:
                out = F.linear(rows, weight)
            else:
                out = torch.cat([F.linear(t, weight) for t in torch.split(rows, tiles)])
    elif rows.dtype == torch.bfloat16:
        parts = [torch.mm(weight, t.t()).t() for t in torch.split(rows, BFLOAT16_TILE)]
        out = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])


# calls the probe makes: every fp32 tile size, the tile splits around 15 and 30,
# bf16's classes up to and past one tile of 128, fp32's packed tile of 256 and past
PROBE_ROWS = (*range(1, 18), 29, 30, 31, 33, 46, 64, 127, 128, 129, 130, 255, 256, 257, 300)
PROBE_LARGE = 1 << 24  # weights of more elements: calls of up to 33 rows only
LARGE_TILE = 32  # and packed calls of up to 32 rows (the probe's reach)


class ExactLinear(nn.Linear):
    """An ``nn.Linear`` computed by :func:`exact_linear` (same parameters; a packed
    layer's ``weight`` is a placeholder of its shape, its data in ``packed``)."""

    tiled: bool = True
    packed: torch.Tensor | None = None
    tile: int = FLOAT32_PACKED_TILE
    lone: bool = False  # a lone row takes a 1-row packed call (proved per shape)
    least: int = 2  # else fp32's packed calls have this many rows at least (zeros added)
    quantum: int = 0  # fp32's F.linear, calls under `least` rows padded to a multiple
    kernel: int = 0  # and a few rows by exact_kernel, chains this long (0: padded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if (
            self.kernel
            and x.numel() == self.in_features
            and x.dtype == torch.float32
            and x.is_cpu
            and self.weight.is_cpu
            and self.weight.stride(1) == 1
        ):
            # a decode step's lone row in MKL's order (the weight's layout proved at load)
            few = exact_kernel.kernel_rows(x.reshape(1, -1), self.weight, self.kernel)
            if self.bias is not None:
                few = few + self.bias
            return few.view(*x.shape[:-1], self.out_features)
        if self.quantum and x.numel() == self.in_features and x.dtype == torch.float32:
            # a decode step's lone row, padded with zero rows (exact_linear's call)
            pad = _zero_row(self.in_features, count=self.quantum - 1)
            four = torch.cat((x.reshape(1, -1), pad))
            row: torch.Tensor = _sliced(four, self.weight)[:1]
            if self.bias is not None:
                row = row + self.bias
            return row.view(*x.shape[:-1], self.out_features)
        if (
            packed is not None
            and self.bias is None
            and x.numel() == self.in_features
            and x.dtype == torch.float32
        ):
            # a decode step's lone row: the same call as exact_linear's, without its
            # reshapes and checks (~6 of its ~15 us, on each of a step's ~200 products)
            if self.lone:
                row = x.reshape(1, -1).contiguous()
                one: torch.Tensor = _mkl_linear()(row, packed, self.weight, None, 1)
                return one.view(*x.shape[:-1], self.out_features)
            pad = _zero_row(self.in_features, count=self.least - 1)
            pair = torch.cat((x.reshape(1, -1), pad))
            out: torch.Tensor = _mkl_linear()(pair, packed, self.weight, None, self.least)[:1]
            return out.view(*x.shape[:-1], self.out_features)
        if packed is not None and self.bias is None and x.dtype == torch.bfloat16:
            rows = x.reshape(-1, self.in_features)
            # one call (a decode step, a round, a chunk; a lone row where it may be)
            if rows.shape[0] <= self.tile and (self.lone or rows.shape[0] > 1):
                one = _onednn_linear()(rows.contiguous(), packed, None, "none", [], "")
                return one.view(*x.shape[:-1], self.out_features)
        return exact_linear(
            x,
            self.weight,
            self.bias,
            tiled=self.tiled,
            packed=self.packed,
            tile=self.tile,
            lone=self.lone,
            least=self.least,
            quantum=self.quantum,
            kernel=self.kernel,
        )

    def extra_repr(self) -> str:
        if self.packed is not None and self.weight.dtype == torch.bfloat16:
            how = f", oneDNN's prepacked product, calls of up to {self.tile} rows"
            how += "" if self.lone else ", a lone row padded to 2"
        elif self.quantum:
            how = f", calls of {self.least} to {self.tile} rows or a multiple of {self.quantum}"
            if self.kernel:
                how += f", up to {exact_kernel.ROWS} rows by the kernel ({self.kernel})"
        elif self.packed is not None:
            how = f", packed product, calls of up to {self.tile} rows"
            how += ", a lone row alone" if self.lone else f", a lone row padded to {self.least}"
        else:
            how = ", row tiles" if self.tiled else ", one row per call"
        return super().extra_repr() + how


def _probe_sizes(weight: torch.Tensor, tile: int = FLOAT32_PACKED_TILE) -> list[int]:
    sizes = [m for m in PROBE_ROWS if weight.numel() <= PROBE_LARGE or m <= 33]
    if tile > PROBE_ROWS[-1]:  # calls up to the tile and past it too
        sizes += [tile - 1, tile, tile + 1, tile + 88]
    return sizes


def tiles_are_exact(
    weight: torch.Tensor,
    packed: torch.Tensor | None = None,
    tile: int = FLOAT32_PACKED_TILE,
    lone: bool = False,
    least: int = 2,
    quantum: int = 0,
    kernel: int = 0,
) -> bool:
    """Whether :func:`exact_linear` gives ``weight``'s rows their lone results (random
    rows, the calls of :data:`PROBE_ROWS`): by its ``packed`` form if given (then with a
    placeholder for ``weight``: proof that the call reads only the packed copy; a lone
    row in a 1-row call where ``lone``, else fp32's calls ``least`` rows at least), by
    fp32's ``F.linear`` in calls of ``least`` rows or a multiple of ``quantum`` where
    ``quantum`` (a few rows by the kernel where ``kernel``: then every lone row is the
    kernel's, every call of 12 rows or more MKL's), else in tiles. Fails fast: the calls
    go from the fewest rows up, each row's lone result computed only once a call needs
    it, so a way refused at 2 rows costs a few products, not hundreds (an fp32 stage's
    load took 6.6 s CPU probing each refused way in full)."""
    sizes = _probe_sizes(weight, tile if packed is not None or quantum else FLOAT32_PACKED_TILE)
    g = torch.Generator().manual_seed(44)
    x = torch.randn(max(sizes), weight.shape[1], generator=g).to(weight.dtype)
    w = weight if packed is None else _placeholder(weight)
    kw: dict[str, Any] = {
        "packed": packed,
        "tile": tile,
        "lone": lone,
        "least": least,
        "quantum": quantum,
        "kernel": kernel,
    }
    with torch.no_grad():
        alone: list[torch.Tensor] = []

        def lone_rows(m: int) -> torch.Tensor:
            alone.extend(exact_linear(x[n : n + 1], w, None, **kw) for n in range(len(alone), m))
            return torch.cat(alone[:m])

        first = lone_rows(min(8, len(x)))  # is it the product at all?
        if packed is not None and weight.dtype == torch.bfloat16:
            reference = F.linear(x[:8].float(), weight.float())
            if (first.float() - reference).abs().max() > 2**-6 * reference.abs().max():
                return False  # not the product at all (bf16: a few roundings apart)
        elif packed is not None and not torch.allclose(
            first, F.linear(x[:8], weight), rtol=1e-3, atol=1e-3
        ):
            return False  # not the product at all
        return all(
            torch.equal(exact_linear(x[:m], w, None, **kw), lone_rows(m)) for m in sorted(sizes)
        )


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of ``weight``'s shape and dtype holding one element."""
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def _storage_counts(module: nn.Module) -> dict[int, int]:
    """Per storage (its data pointer): how many of ``module``'s tensors use it. Holds no
    tensor once it returns: each weight :func:`make_exact` replaces is freed at once,
    and the next packed copy reuses its pages (a load peaks near the stage's bytes;
    with a list of the tensors kept, a bf16 stage's load peaked at 2x)."""
    counts: dict[int, int] = {}
    named = module.named_parameters(remove_duplicate=False)
    for t in itertools.chain((t for _, t in named), module.buffers()):
        ptr = t.untyped_storage().data_ptr()
        counts[ptr] = counts.get(ptr, 0) + 1
    return counts


LINEAR_LEAST = 12  # fp32 F.linear on AMD's EPYC: any call of 12 rows or more, ...
LINEAR_QUANTUM = 4  # ... or of a multiple of 4 rows, gives a row one result
QUANTA = (False, LINEAR_LEAST, LINEAR_QUANTUM)  # tiles_are_exact's lone, least, quantum
# ... in calls of up to this many rows (a longer prompt in such tiles): MKL sums a row the
# same way in any call of the class, so the tile only bounds a call; 256 cut a 291-token
# prefill into 256 + 35 rows, 5-11 % dearer than one call (AMD's EPYC, one thread)
QUANTA_TILE = 512


def make_exact(module: nn.Module, *, packed: bool = True) -> int:
    """Turn every plain float ``nn.Linear`` under ``module`` into an :class:`ExactLinear`
    in place. Per distinct weight shape, the first way :func:`tiles_are_exact` proves
    is taken: fp32 by ``F.linear`` on the weight as stored, calls of 12 rows or more or
    a multiple of 4, up to 8 rows by the exact kernel where it holds for the shape
    (AMD's EPYC; no copy), else by MKL's packed product, a lone row in
    a 1-row call, else padded to 2 rows (where ``packed``; the layer's weight is
    then packed and, unless another tensor of ``module`` shares its bytes, replaced by a
    placeholder), else row tiles, else one row per call; bf16 by oneDNN's prepacked
    product likewise. Returns how many layers compute one row per call."""
    verdicts: dict[tuple[object, ...], str] = {}
    shared = _storage_counts(module)
    untiled = 0
    for sub in module.modules():
        if type(sub) is not nn.Linear or sub.weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        w = sub.weight
        tile = FLOAT32_PACKED_TILE if w.numel() <= PROBE_LARGE else LARGE_TILE
        bf16 = w.dtype == torch.bfloat16
        key = (w.dtype, w.device, tuple(w.shape), w.stride())
        quanta = not bf16 and w.device.type == "cpu"
        quanta_tile = QUANTA_TILE if w.numel() <= PROBE_LARGE else LARGE_TILE
        if key not in verdicts and quanta:
            # AMD's EPYC: no packed copy at all; a few rows by the kernel where it holds
            chain = exact_kernel.kernel_block() if exact_kernel.fits(w[:1], w) else 0
            if chain and tiles_are_exact(w.detach(), None, quanta_tile, *QUANTA, kernel=chain):
                verdicts[key] = f"quanta{chain}"
            elif tiles_are_exact(w.detach(), None, quanta_tile, *QUANTA):
                verdicts[key] = "quanta"
        pack = None
        if packed and not verdicts.get(key, "").startswith("quanta"):
            pack = (onednn_pack if bf16 else mkl_pack)(w.detach())
        if key not in verdicts:
            if w.device.type != "cpu":
                verdicts[key] = "tiles"
            elif bf16 and pack is not None:
                # the largest tile that holds (calls of up to 33 rows for a large weight),
                # a lone row alone, else padded to 2 (AMD's EPYC: 576 x 1,536)
                tiles = [t for t in BFLOAT16_PACKED_TILES if w.numel() <= PROBE_LARGE or t <= 32]
                ways = [(t, lone) for lone in (True, False) for t in tiles]
                proven = (
                    f"onednn{t}{'' if lone else 'pad'}"
                    for t, lone in ways
                    if tiles_are_exact(w.detach(), pack, t, lone=lone)
                )
                way = next(proven, "")
                if way:
                    verdicts[key] = way
                else:
                    verdicts[key] = "tiles" if tiles_are_exact(w.detach()) else "rows"
            elif pack is not None and tiles_are_exact(w.detach(), pack, tile, lone=True):
                verdicts[key] = "packed_lone"
            elif pack is not None and tiles_are_exact(w.detach(), pack, tile):
                verdicts[key] = "packed"
            else:
                verdicts[key] = "tiles" if tiles_are_exact(w.detach()) else "rows"
        sub.__class__ = ExactLinear
        if verdicts[key].startswith("onednn"):
            sub.packed = pack  # type: ignore[assignment]
            tile_of = verdicts[key].removeprefix("onednn").removesuffix("pad")
            sub.tile = int(tile_of)  # type: ignore[assignment]
            sub.lone = not verdicts[key].endswith("pad")  # type: ignore[assignment]
            if shared.get(w.untyped_storage().data_ptr(), 0) <= 1:
                sub._parameters["weight"] = nn.Parameter(_placeholder(w), requires_grad=False)
        elif verdicts[key].startswith("quanta"):
            sub.tile = quanta_tile  # type: ignore[assignment]
            sub.least, sub.quantum = LINEAR_LEAST, LINEAR_QUANTUM  # type: ignore[assignment]
            sub.kernel = int(verdicts[key].removeprefix("quanta") or 0)  # type: ignore[assignment]
        elif verdicts[key] in ("packed", "packed_lone"):
            sub.packed = pack  # type: ignore[assignment]
            sub.tile = tile  # type: ignore[assignment]
            sub.lone = verdicts[key] == "packed_lone"  # type: ignore[assignment]
            if shared.get(w.untyped_storage().data_ptr(), 0) <= 1:
                # straight into the table, not through register_parameter: another
                # thread building a skeleton under accelerate's init_empty_weights has
                # it patched process-wide, and it would put the placeholder on meta
                sub._parameters["weight"] = nn.Parameter(_placeholder(w), requires_grad=False)
        elif verdicts[key] == "rows":
            sub.tiled = False  # type: ignore[assignment]
            untiled += 1
    return untiled


__all__ = [
    "BFLOAT16_PACKED_TILES",
    "BFLOAT16_TILE",
    "FLOAT32_PACKED_TILE",
    "FLOAT32_TILE",
    "LINEAR_LEAST",
    "LINEAR_QUANTUM",
    "PROBE_ROWS",
    "ExactLinear",
    "exact_linear",
    "make_exact",
    "mkl_pack",
    "onednn_pack",
    "tiles_are_exact",
]
