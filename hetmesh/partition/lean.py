"""A decoder layer's forward without the per-op overhead around its kernels (issue 47).

A decode token of the default model in int4 spends about a third of its time
between the quantised kernels (docs/journal/2026-12-05-kernels.md): module
calls and transformers' wrappers around each of a layer's ~13 modules, a bf16
cast of the same normed input before each of q, k and v (and of gate and up),
fresh tensors for every norm, rope and residual step. :func:`lean_layer`
computes a Llama decoder layer with the same arithmetic, op for op, and
without that overhead:

- each layer's tensors and constants are read once into a :class:`LeanLayer`
  (no module attribute look-ups per step);
- the int4 products are the kernel calls of
  :meth:`hetmesh.partition.quant.Int4Linear.forward`, their shared input cast
  to bf16 once per group (q/k/v, gate/up) instead of once per product, and
  their bf16 outputs left unwidened where the next op meets an fp32 operand
  (type promotion widens them exactly as ``.float()`` did; a CPU op widens a
  mixed operand into a temporary, so this saves nothing where two ops would
  each widen the same output: rope's q and k are widened once, explicitly); a group fused at
  load (:mod:`hetmesh.partition.fused`) is one kernel call whose columns its
  members take as views;
- norms, rope and residual adds are the same element-wise operations in the
  same order, in place where this forward owns the tensor (rope's
  ``rotate_half(x) * sin`` is ``cat(x2, x1) * cat(-sin1, sin2)``: a sign
  flip is exact);
- attention is the stage's own :func:`hetmesh.partition.attention.exact_attention`
  and the KV cache the stage's, called as transformers' layer calls them.

So every result is bit-identical to transformers' layer (tests compare the
stage's logits with and without it, prefill and decode, one row and rounds).

Why not ``torch.compile``: inductor's CPU code fused the same per-op work for
only 1.06x on this project's Xeon, cost 10-80 s of start-up per row count,
and summed the RMS norm in another order than ATen, which the int4 format's
bf16 casts turn into visible logit differences (up to 0.15; the prototype in
the journal of 2026-12-05). This keeps ATen's kernels and their bits.

For Llama, Mistral and Qwen2 layers (not Qwen3's, with their q/k norms) with
exact attention on a CPU, every weight format; other stages run transformers'
layer. ``HETMESH_LEAN_LAYERS=0`` turns it off (A/B runs).

One session's lone decode token through int4 layers takes :func:`lean_decode`
(fewer calls again: one attention call on a view of the session's KV run, no
(batch, seq) axes; ``HETMESH_LEAN_DECODE=0`` turns it off), and where every
layer is plain or fused int4 the stage runs them all as one TorchScript call
making the same ops (:mod:`hetmesh.partition.lean_script`).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetmesh.partition.attention import QuerySpans, exact_attention
from hetmesh.partition.exact_gemm import MIN_KEYS, gemm_rows, key_block
from hetmesh.partition.fused import ProjectionSlice
from hetmesh.partition.quant import INT4_GROUP, Int4Linear

LEAN_ENV = "HETMESH_LEAN_LAYERS"
DECODE_ENV = "HETMESH_LEAN_DECODE"
_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# the torch function, not torch.ops' packet: ~1 us less per call (210 calls a token)
_int4_mm = torch._weight_int4pack_mm_for_cpu


def lean_default() -> bool:
    """Whether stages use :func:`lean_layer` where they can (env switch, on unless ``0``)."""
    return os.environ.get(LEAN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def decode_default() -> bool:
    """Whether a lean stage takes :func:`lean_decode` for a lone decode token (env switch,
    on unless ``0``)."""
    return os.environ.get(DECODE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def supports(layer: nn.Module) -> bool:
    """Whether :func:`lean_layer` computes ``layer`` exactly as its own forward does."""
    if type(layer).__name__ not in _LAYER_CLASSES:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or hasattr(attn, "q_norm"):
        return False
    norms = (getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm"))
    if not all(hasattr(norm, "variance_epsilon") for norm in norms):
        return False
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(isinstance(getattr(attn, n, None), nn.Module) for n in names):
        return False
    if not all(isinstance(getattr(mlp, n, None), nn.Module) for n in _MLP_NAMES):
        return False
    return type(getattr(mlp, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")


def _norm(weight: torch.Tensor, eps: float, h: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """transformers' RMS norm, op for op: ``w * (h * rsqrt(mean(h^2) + eps))``; with
    ``bf16`` (an fp32 ``h`` on its way to int4 products) the last product is written as
    bf16, which rounds it as a ``.to(torch.bfloat16)`` of it would."""
    dtype = h.dtype
    h32 = h if dtype == torch.float32 else h.to(torch.float32)
    scale = h32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    out = h32 * scale
    if dtype != torch.float32:
        out = out.to(dtype)
    if weight.dtype != out.dtype:  # promotes: not in place
        return weight * out
    if bf16 and dtype == torch.float32:
        return torch.mul(out, weight, out=torch.empty_like(out, dtype=torch.bfloat16))
    return out.mul_(weight)


class _Products:
    """The products of projections that share an input (q/k/v, gate/up, or one alone)."""

    __slots__ = ("columns", "int4", "modules")

    def __init__(self, modules: tuple[nn.Module, ...]) -> None:
        self.modules = modules
        # (packed, scales and zeros, columns kept or None, bias) per int4 product on a CPU
        self.int4: tuple[tuple[Any, ...], ...] | None = None
        # a fused group (partition/fused.py) of int4: each member's columns of the one product
        self.columns: tuple[tuple[int, int], ...] | None = None
        shared = _shared_int4(modules)
        if shared is not None:
            self.modules = (shared,)
            self.columns = tuple(
                (m.start, m.stop) for m in modules if isinstance(m, ProjectionSlice)
            )
        if all(type(m) is Int4Linear for m in self.modules):
            layers = [m for m in self.modules if isinstance(m, Int4Linear)]
            if all(m.weight_packed.device.type == "cpu" for m in layers):
                self.int4 = tuple(
                    (
                        m.weight_packed,
                        m.scales_zeros,
                        m.out_features if m.padded_out != m.out_features else None,
                        m.bias,
                    )
                    for m in layers
                )
        if self.int4 is None:
            self.modules, self.columns = modules, None

    def rows(self, x: torch.Tensor, split: bool = True) -> list[torch.Tensor]:
        """Each int4 product of the rows ``x (m, k)`` (bf16 already), ``(m, n)`` each:
        :meth:`__call__`'s kernel calls without its reshapes (a decode step's one row).
        A fused group's one product, unsplit where ``split`` is False."""
        outs = []
        for packed, scales_zeros, keep, bias in self.int4 or ():
            out = _int4_mm(x, packed, INT4_GROUP, scales_zeros)
            if keep is not None:
                out = out[:, :keep]
            outs.append(out if bias is None else out.float() + bias)
        if self.columns is not None and split:
            return [outs[0][:, lo:hi] for lo, hi in self.columns]
        return outs

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each product of ``x (b, s, k)``; int4 ones from one bf16 cast of ``x``, and in
        the kernel's bf16 where they have no bias (see the module docstring)."""
        if self.int4 is None:
            return [m(x) for m in self.modules]
        batch, seq, k = x.shape
        rows = x.reshape(-1, k)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        outs = []
        for packed, scales_zeros, keep, bias in self.int4:
            out = _int4_mm(rows, packed, INT4_GROUP, scales_zeros)
            if keep is not None:
                out = out[:, :keep]
            if bias is not None:
                out = out.float() + bias
            outs.append(out.view(batch, seq, -1))
        if self.columns is not None:  # one fused product: its members' columns (views)
            return [outs[0][..., lo:hi] for lo, hi in self.columns]
        return outs


def _shared_int4(modules: tuple[nn.Module, ...]) -> Int4Linear | None:
    """The stacked int4 layer where ``modules`` are all the slices of one fused product,
    in order (partition/fused.py), else None."""
    if not all(isinstance(m, ProjectionSlice) for m in modules):
        return None
    slices = [m for m in modules if isinstance(m, ProjectionSlice)]
    shared = {id(m._shared[0]) for m in slices}
    linear = slices[0]._shared[0].linear
    if len(shared) != 1 or type(linear) is not Int4Linear:
        return None
    bounds = [(m.start, m.stop) for m in slices]
    if bounds[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(bounds)):
        return None
    if bounds[-1][1] != linear.out_features:
        return None
    return linear


class LeanLayer:
    """What :func:`lean_layer` reads of one decoder layer, read once."""

    __slots__ = (
        "attn",
        "dim",
        "index",
        "int4",
        "ln1",
        "ln2",
        "mlp_down",
        "mlp_in",
        "o",
        "qkv",
        "scaling",
    )

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn: nn.Module = attn
        self.dim: int = attn.head_dim
        self.index: int = attn.layer_idx
        self.scaling: float = attn.scaling
        self.ln1 = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.ln2 = (
            layer.post_attention_layernorm.weight,
            float(layer.post_attention_layernorm.variance_epsilon),
        )
        self.qkv = _Products((attn.q_proj, attn.k_proj, attn.v_proj))
        self.o = _Products((attn.o_proj,))
        self.mlp_in = _Products((mlp.gate_proj, mlp.up_proj))
        self.mlp_down = _Products((mlp.down_proj,))
        # every product an int4 kernel on a CPU: lean_decode can take the layer
        groups = (self.qkv, self.o, self.mlp_in, self.mlp_down)
        self.int4 = all(g.int4 is not None for g in groups)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x (b, s, heads, d)``, cos/sin ``(b, s, 1, d)``
    (``x`` may be the int4 kernel's bf16: the products with fp32 tables widen it exactly)."""
    swapped = torch.roll(x, x.shape[-1] // 2, -1)  # cat(x2, x1): one call, the same data
    return torch.mul(swapped, sin_signed).add_(x * cos)


def lean_layer(
    plan: LeanLayer,
    hidden: torch.Tensor,
    mask: QuerySpans | None,
    cache: Any,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
) -> torch.Tensor:
    """The forward of the layer ``plan`` was read from: ``hidden (b, s, h)``, the queries'
    key spans, the stage's batch cache, and rope's ``cos`` and signed ``sin``
    (:func:`rope_tables`) as ``(b, s, 1, d)``."""
    batch, seq = hidden.shape[:2]
    dim, dtype = plan.dim, hidden.dtype
    x = _norm(*plan.ln1, hidden, plan.qkv.int4 is not None)
    q, k, v = plan.qkv(x)
    # widened once here: rope's two products would each widen a bf16 operand again
    q = _rope(q.view(batch, seq, -1, dim).to(dtype), cos, sin_signed)
    k = _rope(k.view(batch, seq, -1, dim).to(dtype), cos, sin_signed)
    v = v.view(batch, seq, -1, dim).to(dtype)
    keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), plan.index)
    out, _ = exact_attention(plan.attn, q.transpose(1, 2), keys, values, mask, scaling=plan.scaling)
    (o,) = plan.o(out.reshape(batch, seq, -1))
    hidden = hidden + o
    x = _norm(*plan.ln2, hidden, plan.mlp_in.int4 is not None)
    gate, up = plan.mlp_in(x)
    act = F.silu(gate.to(dtype))
    if plan.mlp_down.int4 is not None and act.dtype == torch.float32:
        # the product rounded to bf16 as it is written, as the int4 product's cast would
        (down,) = plan.mlp_down(torch.mul(act, up, out=torch.empty_like(act, dtype=torch.bfloat16)))
    else:
        (down,) = plan.mlp_down(act.mul_(up))
    return hidden + down


def gemm_sizes(rows: int) -> list[int]:
    """:func:`gemm_step`'s ``sizes`` for ``rows`` rows per product; ``[]`` for ``rows`` 0
    (where the callers make one sdpa call instead). The key block is the process's
    (:func:`~hetmesh.partition.exact_gemm.key_block`), as exact_gemm's products take it."""
    return [rows, MIN_KEYS, key_block()] if rows > 0 else []


def weighted_values(
    weights: torch.Tensor, values: torch.Tensor, keys: int, min_keys: int, key_block: int
) -> torch.Tensor:
    """``weights (b, rows, >= keys) @ values (b, >= keys, dim)`` over the first ``keys``
    keys, summed in fixed blocks of ``key_block`` keys at absolute positions, a block of
    fewer than ``min_keys`` padded with zeros: exact_gemm's row-invariant order (shared
    by :func:`gemm_step` and the scripted steps, which TorchScript compiles it into)."""
    out = torch.empty(0)
    for k0 in range(0, keys, key_block):
        k1 = min(keys, k0 + key_block)
        w, vb = weights[:, :, k0:k1], values[:, k0:k1]
        if k1 - k0 < min_keys:
            w = F.pad(w, [0, min_keys - (k1 - k0)])
            vb = F.pad(vb, [0, 0, 0, min_keys - (k1 - k0)])
        part = torch.bmm(w, vb)
        out = part if k0 == 0 else out.add_(part)
    return out


def gemm_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lo: int,
    hi: int,
    scale: float,
    sizes: list[int],
) -> torch.Tensor:
    """exact_gemm.gemm_attention for one query position of one row seeing keys
    ``[lo, hi)``: the same ops on the same tensors, in the same order (its one query
    tile; its mask of that row built here). ``sizes``: its rows per product at least,
    MIN_KEYS and the key block (:func:`gemm_sizes`; TorchScript, which compiles this for
    :mod:`~hetmesh.partition.lean_script`, reads no module constants)."""
    min_rows, min_keys, key_block = sizes[0], sizes[1], sizes[2]
    batch, heads, seq, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if total < min_keys:
        key = F.pad(key, [0, 0, 0, min_keys - total])
        value = F.pad(value, [0, 0, 0, min_keys - total])
        total = min_keys
    need = min(max(min_keys, hi), total)
    q = query.reshape(batch, kv_heads, groups, seq, dim).transpose(2, 3)
    k = key.reshape(batch * kv_heads, total, dim)
    v = value.reshape(batch * kv_heads, total, dim)
    qt = q[:, :, 0:seq].reshape(batch * kv_heads, seq * groups, dim)
    short = min_rows - seq * groups
    if short > 0:
        qt = F.pad(qt, [0, 0, 0, short])
    scores = torch.bmm(qt, k[:, :need].transpose(1, 2))
    if short > 0:
        scores = scores[:, : seq * groups]
    scores = scores.view(batch, kv_heads, seq, groups, need).mul_(scale)
    if lo > 0 or hi < need:
        at = torch.arange(total)
        masked = (at < lo) | (at >= hi)
        scores.masked_fill_(masked[:need], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(batch * kv_heads, seq * groups, need)
    if short > 0:
        weights = F.pad(weights, [0, 0, 0, short])
    out = weighted_values(weights, v, need, min_keys, key_block)
    if short > 0:
        out = out[:, : seq * groups]
    out = out.view(batch, kv_heads, seq, groups, dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, seq, heads, dim)


def lean_decode(
    plan: LeanLayer,
    hidden: torch.Tensor,
    pool: tuple[torch.Tensor, torch.Tensor],
    slot: int,
    keys: tuple[int, int],
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """:func:`lean_layer` for one decode token of one session whose KV blocks form one
    run, every product int4 (``plan.int4``): the same ops on the same values, in fewer
    calls. ``hidden (1, h)`` float32; ``pool`` the layers' keys and values
    ``(layers, kv_heads, slots, d)``; the new token's KV goes to ``slot``, attention reads
    slots ``keys = [lo, hi)`` (the token's span, offset by the run's first slot);
    ``first``: the run's first slot (the session's position 0).

    What it drops: the (b, s) axes (views), :class:`_BatchCache`'s and
    :func:`exact_attention`'s per-row loops and slicing (one ``sdpa`` call on the same
    tensors), the value's widening before the cache's 16-bit write (bf16 -> fp16 through
    fp32 rounds once, as the direct cast does). Bit-identical: tests compare logits."""
    dim, dtype = plan.dim, hidden.dtype
    x = _norm(*plan.ln1, hidden, True)
    columns = plan.qkv.columns
    if columns is None:
        q, k, v = plan.qkv.rows(x)
        q = _rope(q.view(1, 1, -1, dim).to(dtype), cos, sin_signed)
        k = _rope(k.view(1, 1, -1, dim).to(dtype), cos, sin_signed)
    else:  # one product: q's and k's columns side by side, roped as one
        (qkv,) = plan.qkv.rows(x, split=False)
        (_, q_end), (_, k_end), (_, v_end) = columns
        qk = _rope(qkv[:, :k_end].view(1, 1, -1, dim).to(dtype), cos, sin_signed)
        q, k, v = qk[:, :, : q_end // dim], qk[:, :, q_end // dim :], qkv[:, k_end:v_end]
    all_keys, all_values = pool
    index, (lo, hi) = plan.index, keys
    all_keys[index, :, slot] = k.view(-1, dim)
    all_values[index, :, slot] = v.view(-1, dim)
    kv_heads = all_keys.shape[1]
    heads = q.numel() // dim
    rows = gemm_rows(heads, kv_heads, dim)
    if rows > 0:
        # exact attention's way for this shape (its products over the session's keys
        # from its first slot, summed in blocks at its absolute positions), as any other
        # row of this session computes it: a lone step's bits are a batched step's
        whole = all_keys[index : index + 1, :, first:hi].to(dtype)
        whole_values = all_values[index : index + 1, :, first:hi].to(dtype)
        query = q.view(1, 1, heads, dim).transpose(1, 2)
        sizes = gemm_sizes(rows)
        out = gemm_step(query, whole, whole_values, lo - first, hi - first, plan.scaling, sizes)
    else:
        held = all_keys[index : index + 1, :, lo:hi].to(dtype)
        held_values = all_values[index : index + 1, :, lo:hi].to(dtype)
        out = F.scaled_dot_product_attention(
            q.view(1, kv_heads, -1, dim), held, held_values, scale=plan.scaling
        )
    (o,) = plan.o.rows(out.reshape(1, -1).to(torch.bfloat16))
    hidden = hidden + o
    x = _norm(*plan.ln2, hidden, True)
    gate, up = plan.mlp_in.rows(x)
    act = F.silu(gate.to(dtype))
    (down,) = plan.mlp_down.rows(
        torch.mul(act, up, out=torch.empty_like(act, dtype=torch.bfloat16))
    )
    return hidden + down


def rope_tables(
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``(cos, sin)`` ``(b, s, d)`` -> ``(cos, signed sin)`` ``(b, s, 1, d)``:
    the sine's first half negated, so rope is ``cat(x2, x1) * sin + x * cos``."""
    cos, sin = position_embeddings
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[:, :, None], signed[:, :, None]


__all__ = [
    "DECODE_ENV",
    "LEAN_ENV",
    "LeanLayer",
    "decode_default",
    "gemm_sizes",
    "gemm_step",
    "lean_decode",
    "lean_default",
    "lean_layer",
    "rope_tables",
    "supports",
]
