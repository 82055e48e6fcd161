"""Stages in every weight format: K stages equal one stage, bytes match the profile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.formats import WeightFormat
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.quant import Int8Linear, packed_head_bytes, packed_int8_exact
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from tests.unit.partition.tiny_models import save_tiny, tensor_bytes

PROMPT = [5, 17, 42, 8, 61, 23, 9, 30, 77, 12]
STEPS = 12
FORMATS = list(WeightFormat)


@pytest.fixture(scope="module", params=["llama-tied", "qwen2"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder)
    return folder


def _greedy(pipeline: LocalPipeline) -> list[int]:
    params = SamplingParams(max_new_tokens=STEPS)
    return list(pipeline.generate_ids(PROMPT, params, eos_ids=set()))


def _prefill_logits(pipeline: LocalPipeline) -> torch.Tensor:
    x: Any = torch.tensor(PROMPT)
    for stage in pipeline.stages:
        x = stage.forward(x, stage.new_kv())
    return x.float()


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_stages_in_every_format_match_one_stage(tiny_dir: Path, fmt: WeightFormat) -> None:
    one = LocalPipeline.load(tiny_dir, 1, weights=fmt)
    reference = _greedy(one)
    assert len(reference) == STEPS
    for k in (2, 6):  # 6: every unit its own stage
        assert _greedy(LocalPipeline.load(tiny_dir, k, weights=fmt)) == reference, k


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_resident_bytes_match_the_profile(tiny_dir: Path, fmt: WeightFormat) -> None:
    for start, end in [(0, 6), (0, 2), (2, 6)]:
        stage = load_stage(tiny_dir, start, end, weights=fmt)
        assert stage.weights is fmt
        head = stage.lm_head
        # an int head's packed copy, beside its rows, where this CPU's oneDNN sums exactly
        pack = head.packed_bytes() if isinstance(head, Int8Linear) else 0
        assert pack == (
            packed_head_bytes(head.out_features, head.in_features)
            if isinstance(head, Int8Linear) and packed_int8_exact()
            else 0
        )
        assert tensor_bytes(stage) == stage.profile.range_param_bytes(start, end)
        assert stage.param_count() == stage.profile.range_param_count(start, end)


def test_compact_formats_stay_close_to_fp32(tiny_dir: Path) -> None:
    fp32 = _prefill_logits(LocalPipeline.load(tiny_dir, 1))
    scale = fp32.abs().max()
    errors = {
        fmt: float(
            (_prefill_logits(LocalPipeline.load(tiny_dir, 1, weights=fmt)) - fp32).abs().max()
            / scale
        )
        for fmt in (WeightFormat.BFLOAT16, WeightFormat.INT8, WeightFormat.INT4)
    }
    # random tiny weights amplify rounding; the real model's figures are in bench/weights.py
    assert errors[WeightFormat.BFLOAT16] < 0.05, errors
    assert errors[WeightFormat.INT8] < 0.15, errors
    assert errors[WeightFormat.INT4] < 0.8, errors
    assert 0 < errors[WeightFormat.BFLOAT16] < errors[WeightFormat.INT8], errors
    assert errors[WeightFormat.INT8] < errors[WeightFormat.INT4], errors


def test_dtype_alias_and_bad_formats(tiny_dir: Path) -> None:
    stage = load_stage(tiny_dir, 0, 6, dtype=torch.bfloat16)
    assert stage.weights is WeightFormat.BFLOAT16
    assert stage.dtype == torch.bfloat16
    with pytest.raises(InvalidRequest, match="int3"):
        load_stage(tiny_dir, 0, 6, weights="int3")
    with pytest.raises(InvalidRequest, match="not both"):
        load_stage(tiny_dir, 0, 6, weights="int8", dtype=torch.float16)
