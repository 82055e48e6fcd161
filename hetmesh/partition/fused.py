"""Fused projections: one matrix product where a decoder layer makes several of the same input.

A decoder layer multiplies its normed input by three matrices for attention
(q, k, v) and by two for the MLP (gate, up). For one decode token each is a
matrix-vector product, and on a CPU a small one (576 x 192 for SmolLM2's k
and v) pays a fixed cost per call well above its bytes. Stacking the rows of
the matrices that share an input makes one larger product per group: 7
products per layer become 4 (SmolLM2-135M: 211 per token become 121).

It happens at load time, after :mod:`hetmesh.partition.materialise` has
filled the stage, so the checkpoint on disk is unchanged. The layer keeps
transformers' own attention and MLP code: each original projection is
replaced by a :class:`ProjectionSlice` that asks the group's
:class:`SharedProjection` for the product of its input and returns its own
columns. The shared product is computed once per input tensor (the first
slice to see a new input computes it, the others reuse it).

Exactness: each output element is still one row of the weight times the
input, and the CPU kernels reduce a row independently of how many rows the
matrix has, so fused outputs are bit-identical to the separate products for
fp32, bf16 and int8 (integer accumulation); tests pin this on the real model.

Off by default: on the project's shared 2-core machine, decoding the default
model in lockstep with and without it (``bench/decode.py``), fused stages ran
at 0.94-1.0x the separate products in fp32, bf16 and int4 (the step is bound
by the weights' bytes there, which fusion does not change), though the
matrix products alone took less time. ``HETMESH_FUSED_PROJECTIONS=1`` (or
``load_stage(..., fuse=True)``) turns it on, for every stage a process loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from hetmesh.partition.quant import Int4Linear, Int8Linear

FUSE_ENV = "HETMESH_FUSED_PROJECTIONS"
_INT4_ROWS = 64  # an int4 matrix's packing works on blocks of 64 rows
# (parent module, projections that share an input), in the order the layer calls them
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("mlp", ("gate_proj", "up_proj")),
)


def fusion_default() -> bool:
    """Whether stages fuse their projections when the caller does not say (env switch)."""
    return os.environ.get(FUSE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


class SharedProjection(nn.Module):
    """One stacked linear layer whose product several :class:`ProjectionSlice` share."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        # The last input and its product, as one tuple: read and replaced whole, so
        # a forward in another thread can only cause a recomputation, never a wrong
        # product. Holding the input keeps its identity unique while cached.
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cached = self._cached
        if cached is not None and cached[0] is x:
            return cached[1]
        product: torch.Tensor = self.linear(x)
        self._cached = (x, product)
        return product

    def release(self) -> None:
        """Drop the cached input and product (after a forward: no tensors held between steps)."""
        self._cached = None


class ProjectionSlice(nn.Module):
    """Stands in for one projection: columns ``[start, stop)`` of a shared product."""

    def __init__(self, shared: SharedProjection, start: int, stop: int) -> None:
        super().__init__()
        # not a registered child: the shared layer belongs to the parent module once
        self._shared = (shared,)
        self.start, self.stop = start, stop
        self.in_features = _in_features(shared.linear)
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product: torch.Tensor = self._shared[0](x)
        return product[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"columns [{self.start}, {self.stop}) of a fused product"


def fuse_layer(layer: nn.Module) -> int:
    """Fuse each projection group of one decoder layer in place; returns groups fused.

    A group is left as it is when its layers differ in kind or bias, or an
    int4 member's rows are not a multiple of the packing block.
    """
    fused = 0
    for parent_name, names in GROUPS:
        parent = getattr(layer, parent_name, None)
        if parent is None:
            continue
        members = [getattr(parent, name, None) for name in names]
        stacked = _stack(members)
        if stacked is None:
            continue
        shared = SharedProjection(stacked)
        parent.add_module("fused_" + "_".join(n.removesuffix("_proj") for n in names), shared)
        start = 0
        for name, member in zip(names, members, strict=True):
            width = _out_features(member)
            setattr(parent, name, ProjectionSlice(shared, start, start + width))
            start += width
        fused += 1
    return fused


def release_cached(layers: Sequence[nn.Module]) -> None:
    """Drop every shared product's cached tensors in ``layers``."""
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, SharedProjection):
                module.release()


def _in_features(module: nn.Module) -> int:
    return int(module.in_features)  # type: ignore[arg-type]


def _out_features(module: nn.Module | None) -> int:
    return int(module.out_features)  # type: ignore[union-attr, arg-type]


def _stack(members: list[nn.Module | None]) -> nn.Module | None:
    """One module whose rows are the members' rows in order, or None where it cannot be."""
    weights = [m for m in members if m is not None]
    if len(weights) != len(members) or any(type(m) is not type(weights[0]) for m in weights):
        return None
    first = weights[0]
    if len({_in_features(m) for m in weights}) != 1:
        return None
    biases = [getattr(m, "bias", None) for m in weights]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    bias = torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None
    total = sum(_out_features(m) for m in weights)
    k = _in_features(first)
    out: nn.Module
    if type(first) is nn.Linear:
        w = torch.cat([m.weight for m in weights if isinstance(m, nn.Linear)])
        out = nn.Linear(k, total, bias=bias is not None, device="meta")
        out.weight = nn.Parameter(w, requires_grad=False)
    elif isinstance(first, Int8Linear):
        int8 = [m for m in weights if isinstance(m, Int8Linear)]
        if len({m.bf16_activations for m in int8}) != 1:
            return None  # products of different kernels (K-quant files mix them)
        out = Int8Linear(
            k, total, bias=bias is not None, device="meta", bf16_activations=first.bf16_activations
        )
        out.weight_q = torch.cat([m.weight_q for m in int8])
        out.weight_scale = torch.cat([m.weight_scale for m in int8])
    elif isinstance(first, Int4Linear):
        int4 = [m for m in weights if isinstance(m, Int4Linear)]
        if any(m.out_features % _INT4_ROWS for m in int4):
            return None  # padded blocks would interleave zero rows
        out = Int4Linear(k, total, bias=bias is not None, device="meta")
        out.weight_packed = torch.cat([m.weight_packed for m in int4])
        out.scales_zeros = torch.cat([m.scales_zeros for m in int4], dim=1)
    else:
        return None
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


__all__ = [
    "FUSE_ENV",
    "GROUPS",
    "ProjectionSlice",
    "SharedProjection",
    "fuse_layer",
    "fusion_default",
    "release_cached",
]
