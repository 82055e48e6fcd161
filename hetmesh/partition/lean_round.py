"""A decode round of several sessions through int4 layers as one TorchScript call (issue 42).

A stage's round of N sessions' decode tokens (one row each) ran eagerly:
:func:`~hetmesh.partition.lean.lean_layer` per layer, the round's batch cache
scattering and gathering each layer's keys, and exact attention's products,
each op a call from Python. At 8 sessions on one stage of the default model
about 45 % of the round was outside the int4 kernels
(docs/journal/2026-12-09-fast-cut-5.md).
:func:`round_layers` makes the same kind of ops, for every layer of the run,
from TorchScript's interpreter, with the graph executor's optimisations off
(nothing fused, reordered or dropped), as :mod:`~hetmesh.partition.lean_script`
does for a lone session.

Per layer: the norms, int4 products, rope and residual adds take all N rows at
once (row by row the same arithmetic: every op is row-wise, and the int4
kernel and the norm's mean give a row the same bits among any rows); each
row's new key and value go to its session's slot; attention is
:func:`~hetmesh.partition.exact_gemm.gemm_attention`'s one query tile over the
rows' keys from each session's first slot, padded to the longest row with the
row's own first slot (finite, masked): exact_gemm's products give a row the
same bits alone or padded in a round (its probe proves it at first use), and
:func:`~hetmesh.partition.lean.gemm_step` is that tile for one row. So a row's
bits are the ones the single-session step and the eager round give it; tests
compare them bit for bit.

Where it applies: a decode round (every row one token) of two or more
sessions of one KV pool, or of one session whose KV blocks do not form one run
(lean_script's step reads a run; a stage server's sessions interleave their
blocks as they grow, and such a lone step ran eagerly), every layer plain or
fused int4 with fp32 norms (:func:`~hetmesh.partition.lean_script.script_plan`),
exact attention by exact_gemm's products (``gemm_rows`` > 0). Elsewhere the
stage keeps the eager round. ``HETMESH_LEAN_ROUND=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.jit._fuser import optimized_execution

from hetmesh.partition.exact_gemm import MIN_KEYS
from hetmesh.partition.kv import SessionKV
from hetmesh.partition.lean import gemm_sizes, weighted_values
from hetmesh.partition.lean_script import ScriptedOnce, ScriptPlan
from hetmesh.partition.quant import INT4_GROUP

ROUND_ENV = "HETMESH_LEAN_ROUND"


def round_default() -> bool:
    """Whether a lean stage runs a decode round of several sessions scripted (env, on
    unless ``0``)."""
    return os.environ.get(ROUND_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    masked: torch.Tensor,
    some_masked: bool,
    scale: float,
    sizes: list[int],
) -> torch.Tensor:
    """exact_gemm.gemm_attention's one query tile for one query per row: ``q (n, heads,
    dim)`` fp32, ``keys``/``values`` ``(kv_heads * n, total, dim)`` fp32 (key head major:
    the pool's layout, no transpose; ``total`` >= MIN_KEYS), ``masked (n, total)`` the
    keys a row does not see; returns ``(n, heads * dim)``. ``sizes``:
    :func:`~hetmesh.partition.lean.gemm_sizes` (TorchScript reads no module constants).
    Each product of the batch is one row's key head, as gemm_attention makes it: the
    order of the batch changes no product's bits."""
    min_rows, min_keys, key_block = sizes[0], sizes[1], sizes[2]
    n, heads, dim = q.shape
    total = keys.shape[1]
    kv_heads = keys.shape[0] // n
    groups = heads // kv_heads
    qt = q.view(n, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads * n, groups, dim)
    short = min_rows - groups
    if short > 0:
        qt = F.pad(qt, [0, 0, 0, short])
    scores = torch.bmm(qt, keys.transpose(1, 2))
    if short > 0:
        scores = scores[:, :groups]
    scores = scores.view(kv_heads, n, 1, groups, total).mul_(scale)
    if some_masked:
        scores.masked_fill_(masked[None, :, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(kv_heads * n, groups, total)
    if short > 0:
        weights = F.pad(weights, [0, 0, 0, short])
    out = weighted_values(weights, values, total, min_keys, key_block)
    if short > 0:
        out = out[:, :groups]
    # (kv_heads * n, groups, dim) -> (n, heads * dim): a row's heads in order
    return out.reshape(kv_heads, n, groups * dim).transpose(0, 1).reshape(n, heads * dim)


def _round(
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    offsets: list[int],
    columns: list[int],
    eps: list[float],
    scaling: list[float],
    indices: list[int],
    windows: list[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    writes: torch.Tensor,
    reads: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    dim: int,
    group: int,
    sizes: list[int],
) -> torch.Tensor:
    """lean_script._layers for ``n`` rows ``hidden (n, h)``, one session each: row ``r``'s
    new key and value go to slot ``writes[r]``, its keys are ``reads`` ``(n * total)``
    (its session's slots of positions ``[0, total)``, padded with its first), it sits at
    ``positions[r]``; layer ``i`` sees the last ``windows[i]`` keys (0: all)."""
    n = hidden.shape[0]
    total = reads.shape[0] // n
    at = torch.arange(total)
    beyond = at[None, :] > positions[:, None]  # padding keys, and none before MIN_KEYS
    some_beyond = bool(beyond.any())
    for i in range(len(indices)):
        b = offsets[i]
        index, q_end = indices[i], columns[5 * i]
        x32 = hidden * hidden.pow(2).mean(-1, keepdim=True).add_(eps[2 * i]).rsqrt_()
        x = torch.mul(x32, weights[b], out=torch.empty_like(x32, dtype=torch.bfloat16))
        if q_end > 0:
            k_end, v_end = columns[5 * i + 1], columns[5 * i + 2]
            qkv = torch._weight_int4pack_mm_for_cpu(x, weights[b + 1], group, weights[b + 2])
            qk = qkv[:, :k_end].view(n, 1, -1, dim).to(torch.float32)
            qk = torch.mul(torch.roll(qk, dim // 2, -1), sin_signed).add_(qk * cos)
            q, k, v = qk[:, :, : q_end // dim], qk[:, :, q_end // dim :], qkv[:, k_end:v_end]
        else:
            q = torch._weight_int4pack_mm_for_cpu(x, weights[b + 1], group, weights[b + 2])
            k = torch._weight_int4pack_mm_for_cpu(x, weights[b + 3], group, weights[b + 4])
            v = torch._weight_int4pack_mm_for_cpu(x, weights[b + 5], group, weights[b + 6])
            q = q.view(n, 1, -1, dim).to(torch.float32)
            q = torch.mul(torch.roll(q, dim // 2, -1), sin_signed).add_(q * cos)
            k = k.view(n, 1, -1, dim).to(torch.float32)
            k = torch.mul(torch.roll(k, dim // 2, -1), sin_signed).add_(k * cos)
        held_keys, held_values = keys[index], values[index]  # (kv_heads, slots, dim)
        kv_heads = held_keys.shape[0]
        new_keys = k.reshape(n, kv_heads, dim).transpose(0, 1).to(held_keys.dtype)
        new_values = v.reshape(n, kv_heads, dim).transpose(0, 1).to(held_values.dtype)
        held_keys.index_copy_(1, writes, new_keys)
        held_values.index_copy_(1, writes, new_values)
        # (kv_heads, n * total, dim) -> (kv_heads * n, total, dim): a view
        whole = held_keys.index_select(1, reads).to(torch.float32).view(-1, total, dim)
        whole_values = held_values.index_select(1, reads).to(torch.float32).view(-1, total, dim)
        window = windows[i]
        masked, some_masked = beyond, some_beyond
        if window > 0:
            early = at[None, :] <= positions[:, None] - window
            if bool(early.any()):
                masked, some_masked = beyond | early, True
        out = _attend(
            q.reshape(n, -1, dim), whole, whole_values, masked, some_masked, scaling[i], sizes
        )
        at_o = 3 if q_end > 0 else 7
        o = torch._weight_int4pack_mm_for_cpu(
            out.to(torch.bfloat16), weights[b + at_o], group, weights[b + at_o + 1]
        )
        hidden = hidden + o
        x32 = hidden * hidden.pow(2).mean(-1, keepdim=True).add_(eps[2 * i + 1]).rsqrt_()
        x = torch.mul(x32, weights[b + at_o + 2], out=torch.empty_like(x32, dtype=torch.bfloat16))
        if q_end > 0:
            gate_up = torch._weight_int4pack_mm_for_cpu(x, weights[b + 6], group, weights[b + 7])
            gate_end, up_end = columns[5 * i + 3], columns[5 * i + 4]
            gate, up = gate_up[:, :gate_end], gate_up[:, gate_end:up_end]
            at_d = 8
        else:
            gate = torch._weight_int4pack_mm_for_cpu(x, weights[b + 10], group, weights[b + 11])
            up = torch._weight_int4pack_mm_for_cpu(x, weights[b + 12], group, weights[b + 13])
            at_d = 14
        act = F.silu(gate.to(torch.float32))
        both = torch.mul(act, up, out=torch.empty_like(act, dtype=torch.bfloat16))
        down = torch._weight_int4pack_mm_for_cpu(
            both, weights[b + at_d], group, weights[b + at_d + 1]
        )
        hidden = hidden + down
    return hidden


_script = ScriptedOnce(_round)  # the compiled _round, at the first call (None: eager)


def available() -> bool:
    """Whether :func:`round_layers` can run here (compiles it at the first call)."""
    return _script() is not None


def round_indices(
    sessions: Sequence[SessionKV],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's new slot ``(n,)``, the rows' key slots ``(n * total,)`` padded with each
    row's first, each row's position ``(n,)``) for one decode token per session; ``total``
    is the longest row's keys, at least MIN_KEYS (exact_gemm's narrowest product)."""
    ends = [kv.length + 1 for kv in sessions]
    total = max(MIN_KEYS, *ends)
    writes, reads = [], []
    for kv, end in zip(sessions, ends, strict=True):
        slots = kv._slot_index(end)
        writes.append(slots[-1:])
        pad = total - end
        reads.append(torch.cat([slots, slots[:1].expand(pad)]) if pad else slots)
    positions = torch.tensor([end - 1 for end in ends])
    return torch.cat(writes), torch.cat(reads), positions


def round_layers(
    plan: ScriptPlan,
    hidden: torch.Tensor,
    sessions: Sequence[SessionKV],
    windows: Sequence[int | None],
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    gemm_rows: int,
) -> torch.Tensor:
    """The layers of ``plan`` (windows one per layer, None: all keys) for one decode token
    per session, ``hidden (n, h)`` float32, rope's tables ``(n, 1, 1, d)``; the sessions
    share one pool and have room for the token (``_reserve``d); returns ``(n, h)``.
    ``gemm_rows``: exact_gemm's rows per product here (> 0)."""
    function = _script()
    assert function is not None  # the caller checked available()
    writes, reads, positions = round_indices(sessions)
    pool = sessions[0].pool
    with optimized_execution(False):  # op for op: no fusion, no reordering
        out: torch.Tensor = function(
            hidden,
            plan.weights,
            plan.offsets,
            plan.columns,
            plan.eps,
            plan.scaling,
            plan.indices,
            [0 if w is None else w for w in windows],
            pool.keys,
            pool.values,
            writes,
            reads,
            positions,
            cos,
            sin_signed,
            plan.dim,
            INT4_GROUP,
            gemm_sizes(gemm_rows),
        )
    return out


__all__ = ["ROUND_ENV", "available", "round_default", "round_indices", "round_layers"]
