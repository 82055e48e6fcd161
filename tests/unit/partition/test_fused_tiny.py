"""Fused q/k/v and gate/up products give bit-identical outputs (tiny models of each family)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hetmesh.partition.fused import (
    FUSE_ENV,
    ProjectionSlice,
    SharedProjection,
    fuse_layer,
    fusion_default,
)
from hetmesh.partition.stage import StageModule, load_stage
from tests.unit.partition.tiny_models import FAMILIES, VOCAB, save_tiny

FORMATS = ("float32", "bfloat16", "int8", "int4")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"fused-{request.param}")
    save_tiny(request.param, folder)
    return folder


def _slices(stage: StageModule) -> list[ProjectionSlice]:
    return [m for m in stage.modules() if isinstance(m, ProjectionSlice)]


def _run(stage: StageModule, prompts: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Prefill two sessions one by one, then decode both in batched forwards."""
    kvs = [stage.new_kv() for _ in prompts]
    outputs = [stage.forward(p, kv) for p, kv in zip(prompts, kvs, strict=True)]
    tokens = [int(out[-1].argmax()) for out in outputs]
    for _ in range(steps):
        batch = [(torch.tensor([t]), kv) for t, kv in zip(tokens, kvs, strict=True)]
        step = stage.forward_batch(batch)
        outputs.extend(step)
        tokens = [int(out[-1].argmax()) for out in step]
    return outputs


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_stage_outputs_bit_identical(tiny_dir: Path, fmt: str) -> None:
    separate = load_stage(tiny_dir, 0, 6, weights=fmt, fuse=False)
    fused = load_stage(tiny_dir, 0, 6, weights=fmt, fuse=True)
    assert not separate.fused
    assert not _slices(separate)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (19, 7)]
    expected = _run(separate, prompts, steps=12)
    got = _run(fused, prompts, steps=12)
    assert len(got) == len(expected) == 2 + 2 * 12
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert fused.param_count() == separate.param_count()
    # nothing cached between forwards: a later forward cannot see a stale product
    assert all(m._cached is None for m in fused._shared)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_fusion_replaces_all_five_projections(tiny_dir: Path, fmt: str) -> None:
    stage = load_stage(tiny_dir, 1, 3, weights=fmt, fuse=True)  # two decoder layers
    assert stage.fused
    assert len(stage._shared) == 2 * 2  # (q, k, v) and (gate, up) per layer
    assert len(_slices(stage)) == 2 * 5
    layer: Any = stage.layers[0]
    q, k, v = layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj
    assert (q.start, k.start, v.start) == (0, q.stop, k.stop)
    # the stacked matrix holds every row once: the resident bytes do not grow
    assert (
        stage.resident_bytes()
        == load_stage(tiny_dir, 1, 3, weights=fmt, fuse=False).resident_bytes()
    )


def test_int4_groups_with_partial_row_blocks_stay_separate(tiny_dir: Path) -> None:
    # the tiny models' k/v (32 rows) and gate/up (96 rows) are not whole 64-row
    # int4 blocks: stacking their padded blocks would interleave zero rows
    stage = load_stage(tiny_dir, 1, 2, weights="int4", fuse=True)
    assert not stage.fused
    assert not _slices(stage)


def test_fuse_layer_leaves_mixed_kinds_alone() -> None:
    attn = nn.Module()
    attn.q_proj = nn.Linear(8, 8, bias=False)
    attn.k_proj = nn.Linear(8, 4, bias=True)  # bias on one member only
    attn.v_proj = nn.Linear(8, 4, bias=False)
    mlp = nn.Module()
    mlp.gate_proj = nn.Linear(8, 16, bias=False)
    mlp.up_proj = nn.Linear(8, 16, bias=False)
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    x = torch.randn(3, 8)
    with torch.inference_mode():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        assert fuse_layer(layer) == 1
        assert isinstance(attn.q_proj, nn.Linear)  # untouched
        assert isinstance(mlp.gate_proj, ProjectionSlice)
        assert torch.equal(mlp.gate_proj(x), gate)
        assert torch.equal(mlp.up_proj(x), up)
        shared = mlp.fused_gate_up
        assert isinstance(shared, SharedProjection)
        assert shared._cached is not None
        first = shared._cached[1]
        mlp.up_proj(x)  # same input: the product is reused, not recomputed
        assert shared._cached[1] is first
        mlp.gate_proj(x.clone())  # a new input tensor: recomputed
        assert shared._cached[1] is not first


def test_fusion_switch_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    monkeypatch.delenv(FUSE_ENV, raising=False)
    assert not fusion_default()  # off unless asked for (docs/benchmarks.md)
    assert not load_stage(tiny_dir, 1, 2).fused
    monkeypatch.setenv(FUSE_ENV, "1")
    assert fusion_default()
    assert load_stage(tiny_dir, 1, 2).fused
    assert not load_stage(tiny_dir, 1, 2, fuse=False).fused  # the argument wins
