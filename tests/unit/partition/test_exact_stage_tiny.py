"""A row's logits do not depend on its batch, its chunks or a replay (issue 44), on a
tiny model in every format a node serves by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition import attention, exact_gemm
from hetmesh.partition.exact_linear import ExactLinear
from hetmesh.partition.formats import WeightFormat
from hetmesh.partition.stage import EXACT_LINEARS_ENV, load_stage
from tests.unit.partition.invariance import (
    alone_and_in_a_round,
    decoded_and_replayed,
    whole_and_chunked,
)
from tests.unit.partition.tiny_models import count_calls, save_tiny

# int4/int8: row-invariant kernels (integer sums, torch's int4 kernel); float32/bfloat16:
# linear layers in row tiles (hetmesh.partition.exact_linear; docs/weights.md, "Exactness")
EXACT_FORMATS = [WeightFormat.INT4, WeightFormat.INT8, WeightFormat.FLOAT32, WeightFormat.BFLOAT16]


@pytest.fixture(scope="module", params=["llama-tied", "mistral-window"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder)
    return folder


@pytest.mark.parametrize("fmt", EXACT_FORMATS, ids=str)
def test_whole_chunked_batched_and_replayed_rows_are_bit_identical(
    tiny_dir: Path, fmt: WeightFormat
) -> None:
    stage = load_stage(tiny_dir, 0, 6, weights=fmt)
    whole, chunked = whole_and_chunked(stage, 40, [13, 13, 14])
    assert torch.equal(whole, chunked)
    whole, chunked = whole_and_chunked(stage, 40, [1, 1, 1, 37])
    assert torch.equal(whole, chunked)
    alone, rounded, beside, again = alone_and_in_a_round(stage, [30, 47, 3, 16])
    assert torch.equal(alone, rounded)
    assert torch.equal(alone, beside)
    decoded, replayed, chunked = decoded_and_replayed(stage, 20, 10)
    assert torch.equal(decoded, replayed)
    assert torch.equal(decoded, chunked)
    assert not torch.equal(alone, again)  # the checks can fail: a later step differs


@pytest.mark.parametrize("way", ["products", "calls"])
def test_bf16_attention_takes_the_widened_products_or_one_call_per_query(
    tiny_dir: Path, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 attention by fp32's products (widened), or with ``HETMESH_EXACT_GEMM_BF16=0``
    one call per query: each way bit-identical, and the two ways differ (by rounding)."""
    monkeypatch.setattr(exact_gemm, "_WIDENED", {})
    monkeypatch.delenv("HETMESH_EXACT_GEMM", raising=False)
    monkeypatch.delenv("HETMESH_EXACT_GEMM_BF16", raising=False)
    if not exact_gemm.widens_bf16(4, 2, 16):
        pytest.skip("this machine's products are not row-invariant (the probe refused)")
    products = load_stage(tiny_dir, 0, 6, weights=WeightFormat.BFLOAT16)
    reference, _ = whole_and_chunked(products, 40, [40])
    if way == "calls":
        monkeypatch.setattr(exact_gemm, "_WIDENED", {})
        monkeypatch.setenv("HETMESH_EXACT_GEMM_BF16", "0")
    widened = count_calls(monkeypatch, attention, "widened_attention")
    stage = load_stage(tiny_dir, 0, 6, weights=WeightFormat.BFLOAT16)
    whole, chunked = whole_and_chunked(stage, 40, [1, 1, 1, 37])
    assert torch.equal(whole, chunked)
    alone, rounded, beside, _ = alone_and_in_a_round(stage, [30, 47, 3, 16])
    assert torch.equal(alone, rounded)
    assert torch.equal(alone, beside)
    decoded, replayed, chunked = decoded_and_replayed(stage, 20, 10)
    assert torch.equal(decoded, replayed)
    assert torch.equal(decoded, chunked)
    assert (len(widened) > 0) == (way == "products")
    assert torch.equal(whole, reference) == (way == "products")


@pytest.mark.parametrize("fmt", [WeightFormat.FLOAT32, WeightFormat.BFLOAT16], ids=str)
def test_float_formats_with_torchs_linear_layers_agree_only_to_rounding(
    tiny_dir: Path, fmt: WeightFormat
) -> None:
    """The reproduction: torch's float linear layers (the stages' before) are not
    row-invariant, so the checks above fail without the row tiles."""
    stage = load_stage(tiny_dir, 0, 6, weights=fmt, exact_linears=False)
    tolerance = 1e-4 if fmt is WeightFormat.FLOAT32 else 0.1
    whole, chunked = whole_and_chunked(stage, 40, [1, 1, 1, 37])
    assert torch.allclose(whole.float(), chunked.float(), atol=tolerance)
    alone, rounded, beside, _ = alone_and_in_a_round(stage, [30, 47, 3, 16])
    assert torch.allclose(alone.float(), rounded.float(), atol=tolerance)
    assert torch.allclose(alone.float(), beside.float(), atol=tolerance)
    if fmt is WeightFormat.FLOAT32:  # MKL: 1 row, 2-15 rows and 16+ rows sum apart
        assert not torch.equal(whole, chunked)


def test_float_stages_tile_their_linear_layers_unless_switched_off(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tiled(**kw: object) -> int:
        stage = load_stage(tiny_dir, 0, 6, weights=WeightFormat.FLOAT32, **kw)  # type: ignore[arg-type]
        return sum(isinstance(m, ExactLinear) for m in stage.modules())

    assert tiled() > 0
    assert tiled(attn_implementation="sdpa") == 0
    monkeypatch.setenv(EXACT_LINEARS_ENV, "0")
    assert tiled() == 0
    assert tiled(exact_linears=True) > 0
