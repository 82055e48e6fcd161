"""The default model in int4, int8, bfloat16 and float32: a row's logits do not depend on
its batch, its chunks or a replay (issue 44). The first tests are the reproductions: with
torch's own attention kernel (``attn_implementation="sdpa"``, the stages' kernel before)
they did, and in the float formats with torch's own linear layers too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition import attention
from hetmesh.partition.exact_gemm import widens_bf16
from hetmesh.partition.formats import WeightFormat
from hetmesh.partition.prefill import prefill_schedule
from hetmesh.partition.stage import load_stage
from tests.unit.partition.invariance import (
    alone_and_in_a_round,
    decoded_and_replayed,
    whole_and_chunked,
)
from tests.unit.partition.tiny_models import count_calls

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return next((set(x.split(":", 1)[1].split()) for x in info if x.startswith("flags")), set())


# issue 44's prompts that flipped were 323-354 tokens, cut into chunks by the mesh
PROMPT_TOKENS, CUTS = 340, [85, 85, 85, 85]


def test_torch_attention_differs_with_chunks_and_batches(default_model_dir: Path) -> None:
    stage = load_stage(default_model_dir, 0, 32, weights="int4", attn_implementation="sdpa")
    whole, chunked = whole_and_chunked(stage, PROMPT_TOKENS, CUTS)
    assert (whole - chunked).abs().max() > 0.01  # measured 0.39
    alone, rounded, _, _ = alone_and_in_a_round(stage, [PROMPT_TOKENS, 336, 50])
    assert (alone - rounded).abs().max() > 0.01  # measured 0.23


def test_torch_bf16_attention_differs_with_chunks(default_model_dir: Path) -> None:
    """bf16's reproduction for the attention alone: torch's kernel beside the exact
    linear layers; the widened products (below) hold."""
    stage = load_stage(
        default_model_dir, 0, 32, weights="bfloat16", attn_implementation="sdpa", exact_linears=True
    )
    whole, chunked = whole_and_chunked(stage, PROMPT_TOKENS, CUTS)
    assert not torch.equal(whole, chunked)


@pytest.mark.parametrize("fmt", [WeightFormat.FLOAT32, WeightFormat.BFLOAT16], ids=str)
def test_torch_linear_layers_differ_with_chunks_and_batches(
    default_model_dir: Path, fmt: WeightFormat
) -> None:
    if fmt is WeightFormat.BFLOAT16 and "amx_bf16" not in _cpu_flags():
        # measured on AMD's EPYC (AVX-512 BF16, no AMX): torch's bf16 products gave each
        # row the same bits whole, chunked and in a round (docs/journal/2026-12-10-exact-9.md)
        pytest.skip("torch's bf16 linear layers are row-dependent on AMX (Xeon) only")
    stage = load_stage(default_model_dir, 0, 32, weights=fmt, exact_linears=False)
    whole, chunked = whole_and_chunked(stage, PROMPT_TOKENS, CUTS)
    alone, rounded, _, _ = alone_and_in_a_round(stage, [PROMPT_TOKENS, 336, 50])
    assert not (torch.equal(whole, chunked) and torch.equal(alone, rounded))


@pytest.mark.parametrize(
    "fmt",
    [WeightFormat.INT4, WeightFormat.INT8, WeightFormat.FLOAT32, WeightFormat.BFLOAT16],
    ids=str,
)
def test_exact_stages_are_bit_identical(
    default_model_dir: Path, fmt: WeightFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    widened = count_calls(monkeypatch, attention, "widened_attention")
    stage = load_stage(default_model_dir, 0, 32, weights=fmt)
    whole, chunked = whole_and_chunked(stage, PROMPT_TOKENS, CUTS)
    assert torch.equal(whole, chunked)
    alone, rounded, beside, _ = alone_and_in_a_round(stage, [PROMPT_TOKENS, 336, 50])
    assert torch.equal(alone, rounded)
    assert torch.equal(alone, beside)
    decoded, replayed, chunked = decoded_and_replayed(stage, 120, 8)
    assert torch.equal(decoded, replayed)
    assert torch.equal(decoded, chunked)
    # bf16 attends by fp32's products widened (where this machine's probe holds)
    expect = fmt is WeightFormat.BFLOAT16 and widens_bf16(9, 3, 64)
    assert (len(widened) > 0) == expect


@pytest.mark.parametrize("fmt", [WeightFormat.INT4, WeightFormat.FLOAT32], ids=str)
def test_tapered_chunks_are_bit_identical(default_model_dir: Path, fmt: WeightFormat) -> None:
    """A cut's gateway tapers its chunks (hetmesh.partition.prefill.prefill_schedule):
    the first and the last half the others; a prompt's logits stay those whole."""
    cuts = prefill_schedule(PROMPT_TOKENS, 80, 4, stages=3, taper=True)
    assert cuts == [57, 113, 113, 57]
    stage = load_stage(default_model_dir, 0, 32, weights=fmt)
    whole, chunked = whole_and_chunked(stage, PROMPT_TOKENS, cuts)
    assert torch.equal(whole, chunked)
