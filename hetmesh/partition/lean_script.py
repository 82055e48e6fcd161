"""A lone decode token through a stage's int4 layers as one TorchScript function (issue 47).

:func:`hetmesh.partition.lean.lean_decode` cut a decode token's layer to about
fifty torch calls; what is left between its seven int4 kernels is the price of
each call from Python (argument parsing, reference counts, the interpreter),
paid ~1,500 times a token. :func:`decode_layers` makes the same calls, in the
same order on the same tensors, from TorchScript's interpreter: the whole
loop over the layers is one call from Python.

Exactness: the function runs with the graph executor's optimisations off
(``torch.jit.optimized_execution(False)``), so no pass fuses, reorders or
drops an op: each ATen op gets what it got from Python, and tests compare
the logits bit for bit with :func:`lean_decode` and transformers' layers.

Attention is exact attention's way for the stage's shape: where
:func:`~hetmesh.partition.exact_gemm.gemm_is_exact` holds (the default model on
the project's Xeon), :func:`~hetmesh.partition.lean.gemm_step` makes
``gemm_attention``'s products for the one query, op for op, over the session's
keys from its first slot (so a lone step's bits are a batched step's); else
one ``sdpa`` call, as the per-query way makes it. Where no key is masked and no query
row padded (no window before the session's first key; enough keys and query heads a
key head), :func:`_attend` makes gemm_step's products, softmax and key-block loop
without its views and masks.

Fewer ops than Python makes, the same bits: the norm's ``mean`` written as ATen makes it
(``sum`` then ``div_``), ``pow(2)`` as the product it is, the Python numbers (eps, the
attention scale, the width) as the float32 tensors ATen casts them to, made once;
rope's swap of halves by one ``flip`` (``roll`` is two ``narrow`` and a ``cat``).

For int4 layers of separate or fused products (:func:`script_plan`: no
biases, no padded products, fp32 norm weights): other stages keep
:func:`lean_decode`. ``HETMESH_LEAN_SCRIPT=0`` turns it off. The function is
compiled once per process, at the first decode step that takes it (well under
a second; nothing is cached on disk).
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.jit._fuser import optimized_execution

from hetmesh.partition.lean import LeanLayer, gemm_sizes, gemm_step, weighted_values
from hetmesh.partition.quant import INT4_GROUP

SCRIPT_ENV = "HETMESH_LEAN_SCRIPT"


def script_default() -> bool:
    """Whether a lean stage runs its decode steps' int4 layers scripted (env, on unless ``0``)."""
    return os.environ.get(SCRIPT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: int,
    end: int,
    scale: torch.Tensor,
    dim: int,
    sizes: list[int],
) -> torch.Tensor:
    """gemm_step's ops for one query of one row that sees every key from the session's
    first slot (no window before it), with at least ``sizes[1]`` keys and at least
    ``sizes[0]`` query heads a key head: its tile needs no row padding and its scores no
    mask, so only its products, softmax and key-block loop are left (the same ops on the
    same values; its reshapes of the one query tile are views of ``q`` here).
    ``keys``, ``values``: one layer's ``(kv_heads, slots, dim)`` of the pool."""
    k = keys.narrow(1, first, end - first).to(torch.float32)
    v = values.narrow(1, first, end - first).to(torch.float32)
    need, min_keys, key_block = end - first, sizes[1], sizes[2]
    scores = torch.bmm(q.view(k.shape[0], -1, dim), k.transpose(1, 2)).mul_(scale)
    weights = torch.softmax(scores, dim=-1)
    if need <= key_block:  # one block of keys, none padded: gemm_step's one product
        return torch.bmm(weights, v)
    return weighted_values(weights, v, need, min_keys, key_block)


def _layers(
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    offsets: list[int],
    columns: list[int],
    scalars: list[torch.Tensor],
    scaling: list[float],
    indices: list[int],
    starts: list[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: int,
    end: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    dim: int,
    group: int,
    first: int,
    gemm: list[int],
) -> torch.Tensor:
    """lean.lean_decode for each layer in turn (the same ops; see that function). Layer
    ``i``'s tensors start at ``weights[offsets[i]]``: norm, q, k, v, o, norm, gate, up,
    down (each product: packed, scales and zeros); or, fused (``columns[5 i]`` > 0), norm,
    qkv, o, norm, gate|up, down, with the ends of q, k, v, gate and up in ``columns``.
    ``scalars``: layer ``i``'s two norms' eps and its attention scale at ``3 i``, then the
    hidden width, as float32 tensors (what ATen makes of the Python numbers, made once)."""
    width = scalars[-1]
    half = dim // 2
    for i in range(len(indices)):
        b = offsets[i]
        index, q_end = indices[i], columns[5 * i]
        # the norm: mean is sum then div_ in ATen (the same bits, checked: tests)
        x32 = (
            hidden
            * torch.mul(hidden, hidden)
            .sum(-1, keepdim=True)
            .div_(width)
            .add_(scalars[3 * i])
            .rsqrt_()
        )
        x = torch.mul(x32, weights[b]).to(torch.bfloat16)
        if q_end > 0:  # one product: q's and k's columns side by side, roped as one
            k_end, v_end = columns[5 * i + 1], columns[5 * i + 2]
            qkv = torch._weight_int4pack_mm_for_cpu(x, weights[b + 1], group, weights[b + 2])
            qk = qkv[:, :k_end].view(1, 1, -1, dim).to(torch.float32)
            # rope's swap of halves (torch.roll's data, in one op)
            swapped = qk.view(1, 1, -1, 2, half).flip(3).view(qk.shape)
            qk = torch.mul(swapped, sin_signed).add_(qk * cos)
            q, k, v = qk[:, :, : q_end // dim], qk[:, :, q_end // dim :], qkv[:, k_end:v_end]
        else:
            q = torch._weight_int4pack_mm_for_cpu(x, weights[b + 1], group, weights[b + 2])
            k = torch._weight_int4pack_mm_for_cpu(x, weights[b + 3], group, weights[b + 4])
            v = torch._weight_int4pack_mm_for_cpu(x, weights[b + 5], group, weights[b + 6])
            q = q.view(1, 1, -1, dim).to(torch.float32)
            swapped = q.view(1, 1, -1, 2, half).flip(3).view(q.shape)
            q = torch.mul(swapped, sin_signed).add_(q * cos)
            k = k.view(1, 1, -1, dim).to(torch.float32)
            swapped = k.view(1, 1, -1, 2, half).flip(3).view(k.shape)
            k = torch.mul(swapped, sin_signed).add_(k * cos)
        layer_keys, layer_values = keys.select(0, index), values.select(0, index)
        layer_keys.select(1, slot).copy_(k.view(-1, dim))
        layer_values.select(1, slot).copy_(v.view(-1, dim))
        if (
            len(gemm) > 0
            and starts[i] == first
            and end - first >= gemm[1]
            and q.shape[2] // layer_keys.shape[0] >= gemm[0]
        ):  # exact_gemm's products without a mask or padded rows: gemm_step's ops, fewer views
            out = _attend(q, layer_keys, layer_values, first, end, scalars[3 * i + 2], dim, gemm)
        elif len(gemm) > 0:  # exact_gemm's products, as lean_decode calls them
            whole = keys[index : index + 1, :, first:end].to(torch.float32)
            whole_values = values[index : index + 1, :, first:end].to(torch.float32)
            query = q.reshape(1, 1, -1, dim).transpose(1, 2)
            out = gemm_step(
                query, whole, whole_values, starts[i] - first, end - first, scaling[i], gemm
            )
        else:
            held = keys[index : index + 1, :, starts[i] : end].to(torch.float32)
            held_values = values[index : index + 1, :, starts[i] : end].to(torch.float32)
            out = F.scaled_dot_product_attention(
                q.view(1, held.shape[1], -1, dim), held, held_values, scale=scaling[i]
            )
        at = 3 if q_end > 0 else 7  # o's tensors, then the second norm, gate (|up), ...
        o = torch._weight_int4pack_mm_for_cpu(
            out.reshape(1, -1).to(torch.bfloat16), weights[b + at], group, weights[b + at + 1]
        )
        hidden = hidden + o
        x32 = (
            hidden
            * torch.mul(hidden, hidden)
            .sum(-1, keepdim=True)
            .div_(width)
            .add_(scalars[3 * i + 1])
            .rsqrt_()
        )
        x = torch.mul(x32, weights[b + at + 2]).to(torch.bfloat16)
        if q_end > 0:
            gate_up = torch._weight_int4pack_mm_for_cpu(x, weights[b + 6], group, weights[b + 7])
            gate_end, up_end = columns[5 * i + 3], columns[5 * i + 4]
            gate, up = gate_up[:, :gate_end], gate_up[:, gate_end:up_end]
            at = 8
        else:
            gate = torch._weight_int4pack_mm_for_cpu(x, weights[b + 10], group, weights[b + 11])
            up = torch._weight_int4pack_mm_for_cpu(x, weights[b + 12], group, weights[b + 13])
            at = 14
        both = F.silu(gate.to(torch.float32)).mul_(up).to(torch.bfloat16)
        down = torch._weight_int4pack_mm_for_cpu(both, weights[b + at], group, weights[b + at + 1])
        hidden = hidden + down
    return hidden


class ScriptedOnce:
    """``function`` compiled by ``torch.jit.script`` at its first use, or None where this
    torch cannot script it (``torch.jit`` is deprecated: the stage keeps its eager way)."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self._compiled: Any = None  # False: tried and refused
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        with self._lock:
            if self._compiled is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    try:
                        self._compiled = torch.jit.script(self._function)
                    except (AttributeError, RuntimeError, TypeError):
                        self._compiled = False
            return self._compiled or None


_script = ScriptedOnce(_layers)  # the compiled _layers, at the first call


@dataclass(frozen=True)
class ScriptPlan:
    """What :func:`decode_layers` takes of a run of layers, read once (see :func:`_layers`)."""

    weights: list[torch.Tensor]
    offsets: list[int]
    columns: list[int]
    eps: list[float]  # each layer's two norms' (lean_round's step reads them)
    scalars: list[torch.Tensor]
    scaling: list[float]
    indices: list[int]
    dim: int


def _layer_tensors(plan: LeanLayer) -> tuple[list[torch.Tensor], list[int]] | None:
    """One layer's tensors and columns in :func:`_layers`' layout, or None."""
    groups = (plan.qkv, plan.o, plan.mlp_in, plan.mlp_down)
    if not plan.int4:
        return None
    products = [p for g in groups for p in g.int4 or ()]
    if any(keep is not None or bias is not None for *_, keep, bias in products):
        return None
    norms = (plan.ln1[0], plan.ln2[0])
    if any(n.dtype != torch.float32 for n in norms):
        return None
    flat = [t for packed, scales_zeros, _, _ in products for t in (packed, scales_zeros)]
    fused = (plan.qkv.columns, plan.mlp_in.columns)
    if len(products) == 7 and fused == (None, None):
        return [norms[0], *flat[:8], norms[1], *flat[8:]], [0] * 5
    if len(products) == 4 and None not in fused and plan.o.columns is plan.mlp_down.columns:
        qkv, gate_up = fused
        assert qkv is not None  # (checked: for mypy)
        assert gate_up is not None
        if len(qkv) == 3 and len(gate_up) == 2:
            ends = [qkv[0][1], qkv[1][1], qkv[2][1], gate_up[0][1], gate_up[1][1]]
            return [norms[0], *flat[:4], norms[1], *flat[4:]], ends
    return None


def script_plan(plans: list[LeanLayer]) -> ScriptPlan | None:
    """The layers' tensors for :func:`decode_layers`, or None where one is not an int4
    layer of plain or fused products (biased or padded products, norms not in fp32, a
    partly fused layer) or none given."""
    if not plans or torch._C._jit_can_fuse_on_cpu() or _script() is None:
        return None  # (a CPU fuser would not run unoptimised either: belt and braces)
    weights: list[torch.Tensor] = []
    offsets: list[int] = []
    columns: list[int] = []
    for plan in plans:
        layer = _layer_tensors(plan)
        if layer is None:
            return None
        offsets.append(len(weights))
        weights += layer[0]
        columns += layer[1]
    return ScriptPlan(
        weights=weights,
        offsets=offsets,
        columns=columns,
        eps=[e for plan in plans for e in (plan.ln1[1], plan.ln2[1])],
        scalars=[
            *(
                torch.tensor(number, dtype=torch.float32)
                for plan in plans
                for number in (plan.ln1[1], plan.ln2[1], plan.scaling)
            ),
            torch.tensor(float(plans[0].ln1[0].shape[-1]), dtype=torch.float32),
        ],
        scaling=[plan.scaling for plan in plans],
        indices=[plan.index for plan in plans],
        dim=plans[0].dim,
    )


def decode_layers(
    plan: ScriptPlan,
    hidden: torch.Tensor,
    pool: tuple[torch.Tensor, torch.Tensor],
    slot: int,
    starts: list[int],
    end: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    first: int = 0,
    gemm_rows: int = 0,
) -> torch.Tensor:
    """The layers of ``plan`` for one decode token ``hidden (1, h)`` float32: its KV goes to
    ``slot`` of ``pool``; layer ``i`` attends to slots ``[starts[i], end)``. ``gemm_rows``
    > 0: attention by exact_gemm's products (that many rows a product at least) over the
    session's keys from its first slot ``first``; 0: one sdpa call (the per-query way)."""
    function = _script()  # compiled: script_plan made the plan
    with optimized_execution(False):  # op for op: no fusion, no reordering
        out: torch.Tensor = function(
            hidden,
            plan.weights,
            plan.offsets,
            plan.columns,
            plan.scalars,
            plan.scaling,
            plan.indices,
            starts,
            pool[0],
            pool[1],
            slot,
            end,
            cos,
            sin_signed,
            plan.dim,
            INT4_GROUP,
            first,
            gemm_sizes(gemm_rows),
        )
    return out


__all__ = ["SCRIPT_ENV", "ScriptPlan", "decode_layers", "script_default", "script_plan"]
