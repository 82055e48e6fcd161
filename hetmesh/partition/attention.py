"""Attention whose result for a query depends only on that query and the keys it sees.

torch's CPU ``scaled_dot_product_attention`` cuts its work into blocks whose
sizes follow the call's shapes: how many queries it has (a whole prompt, a
chunk of one, one decode token), how many keys (a decode round pads every row
to its longest, masking the padding), whether a mask was given. Each cut sums a
query's softmax in another order, so the same token's hidden state differs in
its last bits between a prompt prefilled whole and in chunks, a session
decoding alone and beside others, a history replayed after a preemption and
the same tokens decoded one by one. In float32 that is ~1e-6; the int4 format
rounds its activations to bf16 before every product, which turns a last-bit
difference into 0.4 % of a value now and then, and a near-tie between two
tokens flips (issue 44: the logits of one 340-token prompt up to 0.39 apart,
whole against four chunks; a decode step 0.23 apart alone and in a round).

:func:`exact_attention` makes every query the same call, whatever else the
forward holds: one ``scaled_dot_product_attention`` per query position, with
exactly the keys that query sees (no mask, no padding) and the query heads
that share a key head as its rows, which is the call a lone decode step has
always made. So a decode step costs what it did, a decode round costs one such
call per row instead of one padded call (about the same), and a prefill costs
one call per token instead of one per prompt: the price of exactness, paid in
the time to the first token (docs/weights.md, "Exactness"). Where its probe
allows, fp32 queries take :mod:`hetmesh.partition.exact_gemm` instead: the same
invariance in a few matrix products per forward, about torch's time; bf16
queries take the same products widened to fp32 (``HETMESH_EXACT_GEMM_BF16=0``:
the per-query calls, as before).

The stage (:mod:`hetmesh.partition.stage`) passes the key range of every query
as a :class:`QuerySpans` where transformers' layers pass a mask; the layers
hand it to the attention function untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetmesh.partition.exact_gemm import (
    gemm_attention,
    gemm_is_exact,
    widened_attention,
    widens_bf16,
)

EXACT_ATTENTION = "hetmesh_exact"


@dataclass(frozen=True, slots=True)
class QuerySpans:
    """Per row of a forward, per query: the keys ``[lo, hi)`` it attends to, or None for
    a padding query (its output is zeros and never read)."""

    rows: tuple[tuple[tuple[int, int] | None, ...], ...]

    @classmethod
    def of(
        cls, pasts: Sequence[int], lengths: Sequence[int], width: int, window: int | None
    ) -> QuerySpans:
        """Rows of ``lengths`` new tokens after ``pasts`` held ones, padded to ``width``
        queries; causal, within ``window`` keys when one is given."""
        rows = []
        for past, n in zip(pasts, lengths, strict=True):
            spans: list[tuple[int, int] | None] = []
            for position in range(past, past + n):
                lo = 0 if window is None else max(0, position - window + 1)
                spans.append((lo, position + 1))
            spans.extend([None] * (width - n))
            rows.append(tuple(spans))
        return cls(tuple(rows))


def exact_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: QuerySpans | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query (b, heads, s, d)``, ``key``/``value``
    ``(b, kv_heads, t, d)`` and the queries' :class:`QuerySpans` (None: one causal row,
    the queries being the last ``s`` positions). Returns ``(b, s, heads, d)``."""
    batch, heads, seq, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if attention_mask is None:
        spans = QuerySpans.of([total - seq], [seq], seq, None)
    elif isinstance(attention_mask, QuerySpans):
        spans = attention_mask
    else:
        raise TypeError("exact attention takes the queries' key spans, not a mask")
    if query.dtype == torch.float32 and gemm_is_exact(heads, kv_heads, dim):
        # the same invariance in a few products per forward (hetmesh.partition.exact_gemm)
        return gemm_attention(query, key, value, spans.rows, scaling, spans=spans), None
    if query.dtype == torch.bfloat16 and widens_bf16(heads, kv_heads, dim):
        # bf16 widened to fp32 for those products, the output rounded back
        return widened_attention(query, key, value, spans.rows, scaling, spans=spans), None
    # (b, s, kv_heads, groups, d): one position's query heads, grouped by their key head
    q = query.transpose(1, 2).reshape(batch, seq, kv_heads, groups, dim)
    attend = F.scaled_dot_product_attention
    outs = []
    for row, row_spans in enumerate(spans.rows):
        for i, span in enumerate(row_spans):
            if span is None:
                outs.append(q.new_zeros((1, kv_heads, groups, dim)))
                continue
            lo, hi = span
            # the groups of one key head are the call's query rows: no copied keys
            outs.append(
                attend(
                    q[row, i][None],
                    key[row : row + 1, :, lo:hi],
                    value[row : row + 1, :, lo:hi],
                    scale=scaling,
                )
            )
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.view(batch, seq, heads, dim), None


def register() -> str:
    """Make :func:`exact_attention` known to transformers; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    return EXACT_ATTENTION


__all__ = ["EXACT_ATTENTION", "QuerySpans", "exact_attention", "register"]
