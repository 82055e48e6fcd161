"""Exact attention by a few matrix products per forward (issue 44, item 5).

:func:`hetmesh.partition.attention.exact_attention` gives every query the same
result whatever else the forward holds. Its first way makes one
``scaled_dot_product_attention`` call per query position: exact, but a
291-token prefill of the default model then made 8,730 calls, each paying the
kernel's fixed cost (~14 us), and the prefill took 1.13x torch's (one call a
layer). This module computes fp32 attention for all of a forward's queries in
a few products, and a query's result is still the one it would get alone,
because every step is row-invariant, as measured on the project's Xeon (torch
2.13, MKL) and proven at first use on any other (:func:`gemm_is_exact`):

* scores ``q @ k.T`` (the head dimension summed, 64 in the default model):
  MKL gives a row the same sums in every call of 2 rows or more, and a column
  the same in every call of 4 keys or more (a lone row, or 1 to 3 keys, take
  other kernels: calls never have them, :data:`MIN_KEYS`). With 128-wide heads
  (Llama 3.x 8B), or one query head per key head, a decode step's call of 2 to
  4 rows takes another kernel again: the probe then pads every call to
  :data:`WIDE_ROWS` rows (zeros, dropped after);
* the softmax over a query's keys: torch's vectorised last-dimension softmax
  sums lane by lane from the row's start, so keys masked to ``-inf`` (weight
  exactly 0) past a query's own change nothing, from 16 keys on (a narrower
  row takes a scalar path: rows are at least :data:`MIN_KEYS` wide);
* weights ``@ values``, summed over the keys: MKL splits a long sum into
  blocks whose bounds follow the call's length, so the keys go in fixed blocks
  at absolute positions (:func:`key_block`), each block's product summed in
  order; within a block, trailing zero weights change nothing (a block shorter
  than :data:`MIN_KEYS` is padded with zeros: torch sums a tiny product in its
  own loop, not MKL's). How long a sum MKL takes in one pass depends on the
  CPU: on Intel's Xeon up to 256 keys (:data:`KEY_BLOCK`), on AMD's EPYC
  (Zen 4, the same MKL on its AVX-512 path) up to 192, past which a row's
  sum over 100 keys padded with zeros changes with the padding. The probe
  takes the first of :data:`KEY_BLOCKS` that holds, once for the process.

So a decode step, a decode round (rows padded to the longest), a prompt whole
or in chunks, and a history replayed give a token the same bits, as before,
only not the same bits as the per-call way: a process uses one way for all of
its forwards (the probe's verdict is per shape and holds for the process).
The keys and values a forward pads a row with must be finite (the stage pads
with zeros or a held slot): a masked key's weight is 0, and 0 x NaN is not.

bf16 attention (the bfloat16 format) takes the same products on its queries,
keys and values widened to fp32, the output rounded back once
(:func:`widened_attention`, where :func:`widens_bf16` holds): row-invariant as
fp32's, and within one bf16 rounding of fp32 attention, where torch's own bf16
kernel rounds inside and lands further off.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

KEY_BLOCKS = (256, 128, 64)  # keys per weights @ values product, tried in order by the probe
KEY_BLOCK = KEY_BLOCKS[0]  # the first: below MKL's own blocking of the sum on Intel's Xeon
MIN_KEYS = 16  # keys in every scores product and softmax row (fewer take other kernels)
QUERY_TILE = 64  # query positions per product: a tile computes keys up to its last query's
ROW_MINIMUMS = (2, 8)  # rows per product, at least: the probe takes the first that holds
WIDE_ROWS = ROW_MINIMUMS[-1]

_KEY_BLOCK: int | None = None  # the process's key block: the first probe that held fixed it


def key_block() -> int:
    """Keys per weights @ values product in this process: the block the first probe that
    held proved (:func:`gemm_is_exact`), :data:`KEY_BLOCK` before any probe held. One for
    the process, whatever the shape: the scripted steps (:mod:`hetmesh.partition.lean`)
    take it too."""
    return _KEY_BLOCK or KEY_BLOCK


# the disallowed keys (b, s, total); per query tile: the keys it needs, and the first key
# disallowed to any of its queries (``need`` where none is); the padding queries (b, s) or None
Bounds = tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor | None]
_LAST: tuple[object, int, Bounds] | None = None  # the last forward's bounds (one per layer)


def _bounds(rows: Sequence[Sequence[tuple[int, int] | None]], total: int) -> Bounds:
    """:data:`Bounds` from per-row, per-query key spans."""
    los = [[0 if span is None else span[0] for span in row] for row in rows]
    his = [[1 if span is None else span[1] for span in row] for row in rows]
    lo = torch.tensor(los)[:, :, None]
    hi = torch.tensor(his)[:, :, None]
    keys = torch.arange(total)
    masked = (keys < lo) | (keys >= hi)
    seq = len(his[0])
    needs = []
    for t0 in range(0, seq, QUERY_TILE):
        need = min(max(MIN_KEYS, *(max(h[t0 : t0 + QUERY_TILE]) for h in his)), total)
        # a causal tile's keys before its first query's own are everyone's: only the keys
        # from the shortest span's end on (or from 0 where a span starts later) are masked
        first = need
        for lo_row, hi_row in zip(los, his, strict=True):
            if max(lo_row[t0 : t0 + QUERY_TILE]) > 0:
                first = 0
                break
            first = min(first, *hi_row[t0 : t0 + QUERY_TILE])
        needs.append((need, first))
    padding = None
    if any(span is None for row in rows for span in row):
        padding = torch.tensor([[span is None for span in row] for row in rows])
    return masked, needs, padding


def _cached_bounds(
    spans: object, rows: Sequence[Sequence[tuple[int, int] | None]], total: int
) -> Bounds:
    global _LAST
    last = _LAST
    if last is not None and last[0] is spans and last[1] == total:
        return last[2]
    bounds = _bounds(rows, total)
    _LAST = (spans, total, bounds)
    return bounds


def gemm_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: Sequence[Sequence[tuple[int, int] | None]],
    scaling: float | None,
    spans: object = None,
    min_rows: int | None = None,
    key_block: int | None = None,
) -> torch.Tensor:
    """Attention of ``query (b, heads, s, d)`` over ``key``/``value (b, kv_heads, t, d)``,
    query ``i`` of row ``r`` seeing keys ``rows[r][i] = (lo, hi)`` (None: a padding query,
    output zeros); returns ``(b, s, heads, d)``. ``spans``: an object standing for ``rows``
    (the same object in each layer of a forward: its mask is built once). ``min_rows``:
    rows per product at least (zeros added; None: the probe's choice for the shape).
    ``key_block``: keys per weights @ values product (None: :func:`key_block`)."""
    batch, heads, seq, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if min_rows is None:
        min_rows = _VERDICTS.get((heads, kv_heads, dim)) or ROW_MINIMUMS[0]
    block = key_block or _KEY_BLOCK or KEY_BLOCK
    scale = dim**-0.5 if scaling is None else scaling
    if total < MIN_KEYS:  # zero keys, masked: every call has MIN_KEYS columns or more
        key = F.pad(key, (0, 0, 0, MIN_KEYS - total))
        value = F.pad(value, (0, 0, 0, MIN_KEYS - total))
        total = MIN_KEYS
    masked, needs, padding = (
        _cached_bounds(spans, rows, total) if spans is not None else _bounds(rows, total)
    )
    # (b * kv_heads, s, groups, d): a position's query heads, grouped by their key head
    q = query.reshape(batch, kv_heads, groups, seq, dim).transpose(2, 3)
    k = key.reshape(batch * kv_heads, total, dim)
    v = value.reshape(batch * kv_heads, total, dim)
    outs = []
    for tile, (need, first) in enumerate(needs):
        t0 = tile * QUERY_TILE
        t1 = min(seq, t0 + QUERY_TILE)
        n = t1 - t0
        qt = q[:, :, t0:t1].reshape(batch * kv_heads, n * groups, dim)
        short = min_rows - n * groups
        if short > 0:  # a lone row (or few) takes another kernel: zero rows beside it
            qt = F.pad(qt, (0, 0, 0, short))
        scores = torch.bmm(qt, k[:, :need].transpose(1, 2))
        if short > 0:
            scores = scores[:, : n * groups]
        scores = scores.view(batch, kv_heads, n, groups, need).mul_(scale)
        if first < need:  # only the keys some query of the tile must not see
            scores[..., first:need].masked_fill_(
                masked[:, None, t0:t1, None, first:need], float("-inf")
            )
        weights = torch.softmax(scores, dim=-1).view(batch * kv_heads, n * groups, need)
        if short > 0:
            weights = F.pad(weights, (0, 0, 0, short))
        out: torch.Tensor | None = None
        for k0 in range(0, need, block):
            k1 = min(need, k0 + block)
            w, vb = weights[:, :, k0:k1], v[:, k0:k1]
            if k1 - k0 < MIN_KEYS:  # a short sum takes torch's own loop: zeros to MKL's
                w = F.pad(w, (0, MIN_KEYS - (k1 - k0)))
                vb = F.pad(vb, (0, 0, 0, MIN_KEYS - (k1 - k0)))
            part = torch.bmm(w, vb)
            out = part if out is None else out.add_(part)
        assert out is not None  # need >= MIN_KEYS
        if short > 0:
            out = out[:, : n * groups]
        # (b, kv_heads, n, groups, d) -> (b, n, heads, d)
        outs.append(out.view(batch, kv_heads, n, groups, dim).permute(0, 2, 1, 3, 4))
    result = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    result = result.reshape(batch, seq, heads, dim)
    if padding is not None:
        result = result.masked_fill(padding[:, :, None, None], 0.0)
    return result


# per (heads, kv_heads, dim): the rows per product that the probe proved, 0: none
_VERDICTS: dict[tuple[int, int, int], int] = {}
_WIDENED: dict[tuple[int, int, int], bool] = {}  # per shape: bf16 widened to the products
_OFF = False  # within per_query_calls()


def gemm_is_exact(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether :func:`gemm_attention` gives fp32 queries of this shape their lone results
    on this machine (random queries: a 300-token prompt whole, in chunks, one position
    at a time, and rows of a padded round); probed once per shape, with the process's key
    block once one held (:func:`key_block`), else each of :data:`KEY_BLOCKS` until one
    holds (it becomes the process's). ``HETMESH_EXACT_GEMM=0`` (read at the first probe):
    never (one attention call per query, for comparisons)."""
    if _OFF:
        return False
    shape = (heads, kv_heads, dim)
    verdict = _VERDICTS.get(shape)
    if verdict is None:
        verdict = 0
        if os.environ.get("HETMESH_EXACT_GEMM", "1") != "0":
            verdict = _probe_blocks(heads, kv_heads, dim)
        _VERDICTS[shape] = verdict
    return verdict > 0


def _probe_blocks(heads: int, kv_heads: int, dim: int) -> int:
    """The rows per product the probe proves for the shape (0: none), with the process's
    key block, or the first of :data:`KEY_BLOCKS` that holds (then made the process's)."""
    global _KEY_BLOCK
    blocks = KEY_BLOCKS if _KEY_BLOCK is None else (_KEY_BLOCK,)
    with torch.no_grad():
        for block in blocks:
            proven = (
                m for m in ROW_MINIMUMS if _probe(heads, kv_heads, dim, min_rows=m, key_block=block)
            )
            rows = next(proven, 0)
            if rows:
                _KEY_BLOCK = block
                return rows
    return 0


def gemm_rows(heads: int, kv_heads: int, dim: int) -> int:
    """The rows per product :func:`gemm_attention` takes for this shape (the probe's
    choice), 0 where :func:`gemm_is_exact` is False (one attention call per query)."""
    if not gemm_is_exact(heads, kv_heads, dim):
        return 0
    return _VERDICTS[(heads, kv_heads, dim)]


def widens_bf16(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether bf16 queries of this shape take :func:`gemm_attention` widened to fp32
    (:func:`widened_attention`): the fp32 probe holds for the shape (:func:`gemm_is_exact`)
    and the widened products agree with torch's bf16 attention to its rounding (probed once
    per shape). ``HETMESH_EXACT_GEMM_BF16=0`` (read at the first probe; set it alike on
    every node and in the process compared with them): never (one bf16 attention call per
    query, the way before)."""
    if not gemm_is_exact(heads, kv_heads, dim):
        return False
    shape = (heads, kv_heads, dim)
    verdict = _WIDENED.get(shape)
    if verdict is None:
        verdict = False
        if os.environ.get("HETMESH_EXACT_GEMM_BF16", "1") != "0":
            with torch.no_grad():
                verdict = _probe_widened(heads, kv_heads, dim)
        _WIDENED[shape] = verdict
    return verdict


def widened_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: Sequence[Sequence[tuple[int, int] | None]],
    scaling: float | None,
    spans: object = None,
) -> torch.Tensor:
    """:func:`gemm_attention` of bf16 ``query``/``key``/``value`` widened to fp32 (exactly),
    the result rounded back to bf16: fp32's row-invariant products, so a bf16 query's bits
    do not depend on its batch, chunks or replay either (torch's bf16 attention on a CPU
    also computes in fp32 inside; it rounds its output once, as this does)."""
    out = gemm_attention(query.float(), key.float(), value.float(), rows, scaling, spans=spans)
    return out.to(query.dtype)


@contextmanager
def per_query_calls() -> Iterator[None]:
    """Within it, :func:`gemm_is_exact` is False: exact attention makes one call per query
    (``bench/exact_speed.py`` compares the two ways in one process)."""
    global _OFF
    _OFF = True
    try:
        yield
    finally:
        _OFF = False


def _causal(past: int, n: int) -> list[tuple[int, int]]:
    return [(0, p + 1) for p in range(past, past + n)]


def _probe(
    heads: int,
    kv_heads: int,
    dim: int,
    min_rows: int = 2,
    length: int = 300,
    key_block: int | None = None,
) -> bool:
    g = torch.Generator().manual_seed(44)
    q = torch.randn(1, heads, length, dim, generator=g)
    k = torch.randn(1, kv_heads, length, dim, generator=g)
    v = torch.randn(1, kv_heads, length, dim, generator=g)
    kw = {"min_rows": min_rows, "key_block": key_block}
    whole = gemm_attention(q, k, v, [_causal(0, length)], None, **kw)
    # the plain product's attention (not merely self-consistent)
    reference = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(heads // kv_heads, 1),
        v.repeat_interleave(heads // kv_heads, 1),
        is_causal=True,
    ).transpose(1, 2)
    if not torch.allclose(whole, reference, rtol=1e-4, atol=1e-5):
        return False
    # chunks, and lone decode steps at the edges of key blocks and query tiles
    cuts = [0, 1, 5, 17, 70, 199, 256, 257, 281, length]
    edges = (0, 2, 3, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129, 191, 192, 193, 198)
    steps = [(p, p + 1) for p in (*edges, 255, 257, 258, 259, 272)]
    for a, b in [*itertools.pairwise(cuts), *steps]:
        part = gemm_attention(
            q[:, :, a:b], k[:, :, :b], v[:, :, :b], [_causal(a, b - a)], None, **kw
        )
        if not torch.equal(part, whole[:, a:b]):
            return False
    # a padded round: rows of other lengths, padded with zeros and with a held key
    ends = [3, 64, 255, 258, length]
    rq = torch.cat([q[:, :, e - 1 : e] for e in ends])
    rk = torch.zeros(len(ends), kv_heads, length, dim)
    rv = torch.zeros(len(ends), kv_heads, length, dim)
    for row, e in enumerate(ends):
        rk[row, :, :e], rv[row, :, :e] = k[0, :, :e], v[0, :, :e]
        rk[row, :, e:], rv[row, :, e:] = k[0, :, :1], v[0, :, :1]
    rows = [[(0, e)] for e in ends]
    round_out = gemm_attention(rq, rk, rv, rows, None, **kw)
    return all(torch.equal(round_out[r, 0], whole[0, e - 1]) for r, e in enumerate(ends))


def _probe_widened(heads: int, kv_heads: int, dim: int, length: int = 300) -> bool:
    """bf16 through the widened products against torch's fp32 attention of the same
    (widened) values, to one bf16 rounding of the output (the products' invariance is
    fp32's, :func:`_probe`: widening is exact). torch's own bf16 kernel is further off
    (it rounds inside: up to ~2**-7 of the largest outputs, measured)."""
    g = torch.Generator().manual_seed(45)
    q = torch.randn(1, heads, length, dim, generator=g).bfloat16()
    k = torch.randn(1, kv_heads, length, dim, generator=g).bfloat16()
    v = torch.randn(1, kv_heads, length, dim, generator=g).bfloat16()
    whole = widened_attention(q, k, v, [_causal(0, length)], None)
    reference = F.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(heads // kv_heads, 1),
        v.float().repeat_interleave(heads // kv_heads, 1),
        is_causal=True,
    ).transpose(1, 2)
    # rounding to bf16 moves a value by up to 2**-8 of it (2**-7: the products' own
    # fp32 rounding beside it, near values whose bits are all 1s)
    return whole.dtype == torch.bfloat16 and torch.allclose(
        whole.float(), reference, rtol=2**-7, atol=1e-5
    )


__all__ = [
    "KEY_BLOCK",
    "KEY_BLOCKS",
    "MIN_KEYS",
    "QUERY_TILE",
    "ROW_MINIMUMS",
    "gemm_attention",
    "gemm_is_exact",
    "gemm_rows",
    "key_block",
    "per_query_calls",
    "widened_attention",
    "widens_bf16",
]
