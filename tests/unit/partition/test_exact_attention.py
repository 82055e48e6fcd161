"""Exact attention: a query's output depends only on that query and the keys it may see.

Each case computes the same queries in two call shapes the stages really make
and asserts the outputs are bit-identical (``torch.equal``): a prompt whole
against in chunks (torch's own kernel differs there: the reproduction), a decode
row alone against in a padded round, tokens replayed against decoded one by one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetmesh.partition.attention import QuerySpans, exact_attention


def _inputs(total: int, seed: int = 0, heads: int = 9, kv_heads: int = 3, dim: int = 64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, total, dim, generator=g)
    k = torch.randn(1, kv_heads, total, dim, generator=g)
    v = torch.randn(1, kv_heads, total, dim, generator=g)
    return q, k, v


def _chunk_mask(past: int, n: int, total: int) -> torch.Tensor:
    keys = torch.arange(total)[None, :]
    queries = torch.arange(past, past + n)[:, None]
    return (keys <= queries)[None, None]


def _exact(q, k, v, spans=None) -> torch.Tensor:
    out, _ = exact_attention(None, q, k, v, spans)
    return out


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """The queries in chunks, each seeing the keys so far (a chunked prefill's calls)."""
    outs, past = [], 0
    for n in cuts:
        end = past + n
        spans = QuerySpans.of([past], [n], n, None)
        outs.append(_exact(q[:, :, past:end], k[:, :, :end], v[:, :, :end], spans))
        past = end
    return torch.cat(outs, dim=1)


def _even(total: int, pieces: int) -> list[int]:
    size, extra = divmod(total, pieces)
    return [size + (1 if i < extra else 0) for i in range(pieces)]


def test_torch_sdpa_differs_between_whole_and_chunks() -> None:
    """The reproduction: torch's kernel sums a chunk's softmax in another order."""
    q, k, v = _inputs(340)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    parts = []
    for past, n in ((0, 85), (85, 85), (170, 85), (255, 85)):
        end = past + n
        mask = _chunk_mask(past, n, end)
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, past:end], k[:, :, :end], v[:, :, :end], attn_mask=mask, enable_gqa=True
            )
        )
    chunked = torch.cat(parts, dim=2)
    assert not torch.equal(chunked, whole)
    assert torch.allclose(chunked, whole, atol=1e-5)  # equal to within rounding only


@pytest.mark.parametrize("total", [7, 130, 340])
def test_a_prompt_whole_equals_it_in_chunks(total: int) -> None:
    q, k, v = _inputs(total)
    whole = _exact(q, k, v)
    for cuts in ([1] * 5 + [total - 5], _even(total, 4)):
        assert torch.equal(_chunked(q, k, v, cuts), whole), cuts


def test_a_decode_row_alone_equals_it_in_a_padded_round() -> None:
    """A round pads each row's keys to the longest row; the padding is never read."""
    lengths = [40, 340, 7, 129]
    total = max(lengths)
    rows = [_inputs(n, seed=i) for i, n in enumerate(lengths)]
    alone = [_exact(q[:, :, -1:], k, v) for q, k, v in rows]
    q = torch.cat([q[:, :, -1:] for q, _, _ in rows])
    k = torch.cat([F.pad(k, (0, 0, 0, total - k.shape[2])) for _, k, _ in rows])
    v = torch.cat([F.pad(v, (0, 0, 0, total - v.shape[2])) for _, _, v in rows])
    spans = QuerySpans.of([n - 1 for n in lengths], [1] * 4, 1, None)
    batched = _exact(q, k, v, spans)
    for i, out in enumerate(alone):
        assert torch.equal(batched[i : i + 1], out), lengths[i]


def test_tokens_replayed_equal_those_decoded_one_by_one() -> None:
    """A replay prefills the generated tokens as one chunk; they were decoded singly."""
    q, k, v = _inputs(200, seed=3)
    prompt = 150
    decoded = [
        _exact(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1]) for p in range(prompt, 200)
    ]
    replayed = _exact(q[:, :, prompt:], k, v, QuerySpans.of([prompt], [50], 50, None))
    assert torch.equal(replayed, torch.cat(decoded, dim=1))


def test_padding_queries_are_skipped_and_windows_apply() -> None:
    spans = QuerySpans.of([3, 0], [2, 4], 4, window=2)
    assert spans.rows == (
        ((2, 4), (3, 5), None, None),
        ((0, 1), (0, 2), (1, 3), (2, 4)),
    )


def test_matches_torch_attention_to_rounding() -> None:
    q, k, v = _inputs(100, seed=5)
    ours = _exact(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(ours, theirs.transpose(1, 2), atol=2e-6, rtol=1e-5)
    keys, queries = torch.arange(100)[None, :], torch.arange(100)[:, None]
    allowed = (keys <= queries) & (queries - keys < 12)
    windowed = _exact(q, k, v, QuerySpans.of([0], [100], 100, window=12))
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert torch.allclose(windowed, theirs.transpose(1, 2), atol=2e-6, rtol=1e-5)


def test_a_mask_tensor_is_refused() -> None:
    q, k, v = _inputs(4)
    with pytest.raises(TypeError):
        exact_attention(None, q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))
