"""Exact attention by products (hetmesh.partition.exact_gemm): a query's output is the
one it gets alone, across the key blocks and query tiles the products are cut into,
and the per-call way it replaces still holds where the probe refuses the products.
fp32 and bf16 (widened to fp32 for the products) alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetmesh.partition import exact_gemm
from hetmesh.partition.attention import QuerySpans, exact_attention
from hetmesh.partition.exact_gemm import (
    KEY_BLOCK,
    KEY_BLOCKS,
    MIN_KEYS,
    QUERY_TILE,
    ROW_MINIMUMS,
    gemm_is_exact,
    widened_attention,
    widens_bf16,
)

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(
    total: int,
    seed: int,
    heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    dtype: torch.dtype = torch.float32,
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, total, dim, generator=g)
    k = torch.randn(1, kv_heads, total, dim, generator=g)
    v = torch.randn(1, kv_heads, total, dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _exact(q, k, v, spans=None) -> torch.Tensor:
    out, _ = exact_attention(None, q, k, v, spans)
    return out


@pytest.fixture(params=["products", "calls"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each case both ways: the products (where this machine's probe allows them) and
    one call per query (``HETMESH_EXACT_GEMM=0``)."""
    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.setattr(exact_gemm, "_WIDENED", {})
    monkeypatch.delenv("HETMESH_EXACT_GEMM_BF16", raising=False)
    if request.param == "calls":
        monkeypatch.setenv("HETMESH_EXACT_GEMM", "0")
    else:
        monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
        if not widens_bf16(9, 3, 64):
            pytest.skip("this machine's products are not row-invariant (the probe refused)")
    return str(request.param)


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """fp32 (the int4, int8 and float32 formats' attention) and bf16 (bfloat16's)."""
    return request.param  # type: ignore[no-any-return]


def _chunked(q, k, v, cuts: list[int], window: int | None = None) -> torch.Tensor:
    outs, past = [], 0
    for n in cuts:
        end = past + n
        spans = QuerySpans.of([past], [n], n, window)
        outs.append(_exact(q[:, :, past:end], k[:, :, :end], v[:, :, :end], spans))
        past = end
    return torch.cat(outs, dim=1)


def test_the_constants_cover_the_cases_below() -> None:
    assert MIN_KEYS < QUERY_TILE < KEY_BLOCK < 600 - KEY_BLOCK
    assert KEY_BLOCKS[0] == KEY_BLOCK
    assert all(QUERY_TILE <= block <= KEY_BLOCK for block in KEY_BLOCKS)


@pytest.mark.parametrize("window", [None, 100])
def test_a_long_prompt_whole_in_chunks_and_decoded_is_bit_identical(
    way: str, dtype: torch.dtype, window: int | None
) -> None:
    """600 tokens: three to ten key blocks, ten query tiles; chunks cut across both."""
    total = 600
    q, k, v = _inputs(total, seed=1, dtype=dtype)
    whole = _exact(q, k, v, QuerySpans.of([0], [total], total, window))
    for cuts in ([1, 1, 1, 597], [255, 2, 343], [63, 65, 128, 256, 88], [5] * 120):
        assert torch.equal(_chunked(q, k, v, cuts, window), whole), cuts[:4]
    edges = (127, 128, 129, 191, 192, 193, 383, 384, 385)  # the smaller key blocks'
    for p in (0, 1, 14, 15, 16, 63, 64, 255, 256, 257, 511, 512, 513, 599, *edges):
        spans = QuerySpans.of([p], [1], 1, window)
        step = _exact(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], spans)
        assert torch.equal(step, whole[:, p : p + 1]), p


def test_a_row_in_a_padded_round_equals_it_alone(way: str, dtype: torch.dtype) -> None:
    """Rows padded with zeros and with a held key (the stage does both): a masked key
    weighs exactly nothing."""
    lengths = [3, 17, 256, 257, 600, 40]
    total = max(lengths)
    rows = [_inputs(n, seed=10 + i, dtype=dtype) for i, n in enumerate(lengths)]
    alone = [_exact(q[:, :, -1:], k, v) for q, k, v in rows]
    keys, values = [], []
    for i, (_, k, v) in enumerate(rows):
        pad = total - k.shape[2]
        if i % 2:
            keys.append(F.pad(k, (0, 0, 0, pad)))
            values.append(F.pad(v, (0, 0, 0, pad)))
        else:  # the row's first key again, as a decode round's gather pads
            keys.append(torch.cat([k, k[:, :, :1].expand(-1, -1, pad, -1)], dim=2))
            values.append(torch.cat([v, v[:, :, :1].expand(-1, -1, pad, -1)], dim=2))
    q = torch.cat([q[:, :, -1:] for q, _, _ in rows])
    spans = QuerySpans.of([n - 1 for n in lengths], [1] * len(lengths), 1, None)
    batched = _exact(q, torch.cat(keys), torch.cat(values), spans)
    for i, out in enumerate(alone):
        assert torch.equal(batched[i : i + 1], out), lengths[i]


def test_rows_of_a_mixed_forward_equal_them_alone_and_padding_queries_are_zero(
    way: str, dtype: torch.dtype
) -> None:
    """A chunk beside a decode row (the stage pads the short row's queries)."""
    q1, k1, v1 = _inputs(300, seed=20, dtype=dtype)
    q2, k2, v2 = _inputs(90, seed=21, dtype=dtype)
    # row 0: positions 200..299 (a chunk); row 1: position 89 (a decode step) + 99 padding
    spans = QuerySpans.of([200, 89], [100, 1], 100, None)
    q = torch.cat([q1[:, :, 200:], F.pad(q2[:, :, 89:], (0, 0, 0, 99))])
    k = torch.cat([k1, F.pad(k2, (0, 0, 0, 210))])
    v = torch.cat([v1, F.pad(v2, (0, 0, 0, 210))])
    out = _exact(q, k, v, spans)
    assert torch.equal(out[:1], _chunked(q1, k1, v1, [200, 100])[:, 200:])
    assert torch.equal(out[1:, :1], _exact(q2[:, :, 89:], k2, v2))
    assert not out[1:, 1:].any()


def test_without_grouped_queries_a_lone_row_equals_it_in_a_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One query head per key head: a decode step is one row (padded to two inside)."""
    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
    if not gemm_is_exact(4, 4, 32):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    q, k, v = _inputs(80, seed=30, heads=4, kv_heads=4, dim=32)
    whole = _exact(q, k, v)
    for p in (0, 9, 79):
        step = _exact(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1])
        assert torch.equal(step, whole[:, p : p + 1]), p


def test_the_products_match_torchs_attention_to_rounding(way: str, dtype: torch.dtype) -> None:
    q, k, v = _inputs(600, seed=5, dtype=dtype)
    ours = _exact(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert ours.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(ours, theirs.transpose(1, 2), atol=2e-6, rtol=1e-5)
    else:  # the products round fp32's result once; torch's bf16 kernel rounds inside
        if way == "products":
            fp32 = _exact(q.float(), k.float(), v.float())
            assert torch.allclose(ours.float(), fp32, atol=1e-5, rtol=2**-7)
        assert torch.allclose(ours.float(), theirs.transpose(1, 2).float(), atol=2**-5)


def test_torchs_bf16_attention_differs_whole_and_chunked() -> None:
    """The reproduction for bf16: torch's kernel, given a prompt whole and in chunks (with
    the mask a chunk needs), sums a query's softmax in other blocks, so the two differ."""
    q, k, v = _inputs(300, seed=6, dtype=torch.bfloat16)

    def attend(a: int, b: int) -> torch.Tensor:
        mask = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]
        return F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, :b], v[:, :, :b], attn_mask=mask, enable_gqa=True
        )

    whole = attend(0, 300)
    chunked = torch.cat([attend(0, 85), attend(85, 170), attend(170, 255), attend(255, 300)], 2)
    assert torch.allclose(whole.float(), chunked.float(), atol=2**-6, rtol=2**-6)
    assert not torch.equal(whole, chunked)
    # the widened products give every cut the same bits (and torch's values to rounding),
    # in the rows per product and key block this machine's probe proves
    if not widens_bf16(9, 3, 64):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    products = [
        widened_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], exact_gemm_causal(a, b), None)
        for a, b in ((0, 85), (85, 170), (170, 255), (255, 300))
    ]
    whole_products = widened_attention(q, k, v, exact_gemm_causal(0, 300), None)
    assert torch.equal(torch.cat(products, 1), whole_products)


def exact_gemm_causal(a: int, b: int) -> list[list[tuple[int, int]]]:
    """One row whose queries are positions ``[a, b)``, each seeing the keys up to itself."""
    return [[(0, p + 1) for p in range(a, b)]]


def test_bf16_takes_the_widened_products_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``HETMESH_EXACT_GEMM_BF16=0``: bf16 makes one call per query again (the way before;
    agreeing with the products to rounding, not bit for bit), fp32 keeps the products."""
    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.setattr(exact_gemm, "_WIDENED", {})
    monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
    monkeypatch.delenv("HETMESH_EXACT_GEMM_BF16", raising=False)
    if not widens_bf16(9, 3, 64):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    q, k, v = _inputs(300, seed=7, dtype=torch.bfloat16)
    products = _exact(q, k, v)
    assert torch.equal(products, widened_attention(q, k, v, exact_gemm_causal(0, 300), None))
    monkeypatch.setattr(exact_gemm, "_WIDENED", {})
    monkeypatch.setenv("HETMESH_EXACT_GEMM_BF16", "0")
    assert not widens_bf16(9, 3, 64)
    assert gemm_is_exact(9, 3, 64)
    calls = _exact(q, k, v)
    assert not torch.equal(calls, products)
    assert torch.allclose(calls.float(), products.float(), atol=2**-8, rtol=2**-7)


def test_the_bf16_probe_refuses_products_that_are_not_torchs_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe can fail: products that are row-invariant but scaled wrongly."""
    real = exact_gemm.gemm_attention

    def unscaled(*args: object, **kwargs: object) -> torch.Tensor:
        q, k, v, rows, _ = args
        return real(q, k, v, rows, 1.0, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exact_gemm, "gemm_attention", unscaled)
    assert not exact_gemm._probe_widened(9, 3, 64)
    monkeypatch.setattr(exact_gemm, "gemm_attention", real)
    assert exact_gemm._probe_widened(9, 3, 64)


def test_the_switch_turns_the_products_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.setenv("HETMESH_EXACT_GEMM", "0")
    assert not gemm_is_exact(9, 3, 64)


def test_per_query_calls_turn_the_products_off_within_only() -> None:
    before = gemm_is_exact(9, 3, 64), widens_bf16(9, 3, 64)
    with exact_gemm.per_query_calls():
        assert not gemm_is_exact(9, 3, 64)
        assert not widens_bf16(9, 3, 64)
    assert (gemm_is_exact(9, 3, 64), widens_bf16(9, 3, 64)) == before


def test_the_thread_count_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node decodes int4 at 1 or 2 threads, whichever measures faster (threads.py).
    The products only (the per-query calls are one torch kernel each, pinned by
    test_threads.py's stages; at 2 threads on a busy machine they crawl)."""
    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
    if not gemm_is_exact(9, 3, 64):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    q, k, v = _inputs(300, seed=40)
    threads = torch.get_num_threads()
    outs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            step = _exact(q[:, :, 257:258], k[:, :, :258], v[:, :, :258])
            outs.append((_exact(q, k, v), step))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][1], outs[0][0][:, 257:258])


@pytest.mark.parametrize("shape", [(32, 8, 128), (16, 16, 64)], ids=str)
def test_wide_heads_and_ungrouped_queries_pad_their_products_to_more_rows(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama 3.x 8B's 128-wide heads, and one query head per key head: a decode step's
    product of 2 to 4 rows takes another kernel than a prompt's here, so the probe
    takes a larger row minimum (or refuses: then one call per query)."""
    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
    heads, kv_heads, dim = shape
    if not gemm_is_exact(*shape):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    assert exact_gemm._VERDICTS[shape] in ROW_MINIMUMS
    q, k, v = _inputs(300, seed=50, heads=heads, kv_heads=kv_heads, dim=dim)
    whole = _exact(q, k, v)
    for cuts in ([1, 1, 1, 297], [100, 157, 43]):
        assert torch.equal(_chunked(q, k, v, cuts), whole), cuts
    for p in (0, 3, 16, 64, 255, 257, 299):
        step = _exact(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1])
        assert torch.equal(step, whole[:, p : p + 1]), p


def test_a_key_block_the_probe_refuses_gives_way_to_the_next_for_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where 256 keys are one sum too many (AMD's EPYC), the probe takes the next of
    KEY_BLOCKS; the process keeps that block for every shape and the scripted steps."""
    from hetmesh.partition.lean import gemm_sizes

    monkeypatch.setattr(exact_gemm, "_VERDICTS", {})
    monkeypatch.setattr(exact_gemm, "_KEY_BLOCK", None)
    monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
    real = exact_gemm._probe
    tried: list[tuple[tuple[int, int, int], int | None]] = []

    def no_256(heads: int, kv_heads: int, dim: int, **kw: int | None) -> bool:
        tried.append(((heads, kv_heads, dim), kw.get("key_block")))
        return kw.get("key_block") != KEY_BLOCKS[0] and real(heads, kv_heads, dim, **kw)

    monkeypatch.setattr(exact_gemm, "_probe", no_256)
    assert exact_gemm.key_block() == KEY_BLOCK  # before any probe held
    if not gemm_is_exact(9, 3, 64):
        pytest.skip("this machine's products are not row-invariant at any key block")
    block = exact_gemm.key_block()
    assert block in KEY_BLOCKS[1:]
    assert {b for _, b in tried} >= {KEY_BLOCKS[0], block}
    assert gemm_sizes(exact_gemm.gemm_rows(9, 3, 64))[2] == block
    tried.clear()
    gemm_is_exact(4, 4, 32)  # another shape: probed with the process's block only
    assert {b for _, b in tried} == {block}
    # the products cut at that block: a prompt whole = chunked = decoded
    q, k, v = _inputs(300, seed=60)
    whole = _exact(q, k, v)
    assert torch.equal(_chunked(q, k, v, [block - 1, 2, 300 - block - 1]), whole)
    for p in (block - 1, block, block + 1):
        step = _exact(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1])
        assert torch.equal(step, whole[:, p : p + 1]), p


def test_the_key_block_sums_a_row_as_its_keys_alone() -> None:
    """What the key blocks rest on, for the block this process's probe took: a row's
    weights @ values over its keys, zero weights after them up to the block's end (a
    masked key), give its sum over its keys alone. Where the probe took a smaller
    block than the first, the first does not hold here (the reason it was refused)."""
    if not gemm_is_exact(9, 3, 64):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    block = exact_gemm.key_block()
    rows = exact_gemm.gemm_rows(9, 3, 64)
    g = torch.Generator().manual_seed(61)
    values = torch.randn(3, KEY_BLOCK, 64, generator=g)
    weights = torch.rand(3, max(rows, 8), KEY_BLOCK, generator=g)

    def padding_changes(keys: int, width: int) -> bool:
        w = torch.zeros(3, weights.shape[1], width)
        w[:, :, :keys] = weights[:, :, :keys]
        alone = torch.bmm(w[:, :, :keys], values[:, :keys])
        return not torch.equal(torch.bmm(w, values[:, :width]), alone)

    lengths = (MIN_KEYS, 33, 64, 100, 127, 135, 191, 198, 255)
    assert not any(
        padding_changes(n, width) for n in lengths if n <= block for width in range(n, block + 1)
    )
    if block < KEY_BLOCK:
        assert any(padding_changes(n, w) for n in lengths for w in range(n, KEY_BLOCK + 1))


def test_a_tile_masks_only_from_the_first_key_one_of_its_queries_may_not_see(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A causal tile's keys before its shortest span's end are every query's: masking
    starts there (the whole tile from 0 where a window starts a span later, padding too),
    and the result is the one masking every key gives."""
    rows = QuerySpans.of([100], [70], 80, None).rows  # 70 queries after 100, 10 padding
    _, needs, padding = exact_gemm._bounds(rows, 170)
    assert needs == [(164, 101), (170, 1)]  # the second tile holds padding (span end 1)
    assert padding is not None
    assert int(padding.sum()) == 10
    windowed = QuerySpans.of([100], [70], 70, 50).rows
    assert [first for _, first in exact_gemm._bounds(windowed, 170)[1]] == [0, 0]
    unmasked = QuerySpans.of([0], [1], 1, None).rows  # one query seeing all its keys
    assert exact_gemm._bounds(unmasked, 16)[1] == [(16, 1)]  # padded to MIN_KEYS: masked
    if not gemm_is_exact(9, 3, 64):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    q, k, v = _inputs(170, seed=5, dtype=torch.float32)
    spans = QuerySpans.of([100], [70], 70, None)
    out = exact_gemm.gemm_attention(q[:, :, 100:], k, v, spans.rows, None)
    for i in (0, 1, 63, 64, 69):  # each query alone: the keys of its own span only
        p = 100 + i
        one = QuerySpans.of([p], [1], 1, None)
        alone = exact_gemm.gemm_attention(
            q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], one.rows, None
        )
        assert torch.equal(out[:, i : i + 1], alone), i
    # and the bits of masking every key of a tile that masks any, as before
    bounds = exact_gemm._bounds

    def from_zero(rows, total):
        masked, needs, padding = bounds(rows, total)
        return masked, [(need, 0 if first < need else need) for need, first in needs], padding

    monkeypatch.setattr(exact_gemm, "_bounds", from_zero)
    assert torch.equal(exact_gemm.gemm_attention(q[:, :, 100:], k, v, spans.rows, None), out)
