"""The default weight format, ``native``: the checkpoint's own, read off its headers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hetmesh.errors import InvalidRequest
from hetmesh.node.weights import check_weights
from hetmesh.partition.checkpoint import native_weights, settle_weights, stored_matrix_kind
from hetmesh.partition.formats import (
    NATIVE,
    WEIGHT_CHOICES,
    WeightFormat,
    cpu_has_bf16,
    parse_weights,
)
from hetmesh.partition.store import SHARDS_MARKER


def _folder(tmp_path: Path, name: str, dtype: torch.dtype) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    tensors = {
        "model.embed_tokens.weight": torch.zeros(8, 64, dtype=torch.float32),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.float32),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128, dtype=dtype),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_the_default_model_is_served_as_it_ships(default_model_dir: Path) -> None:
    # its GGUF is Q4_1: int4 keeps those levels, and no fp32 copy is ever made
    assert stored_matrix_kind(default_model_dir) == "q4_1"
    assert native_weights(default_model_dir, "cpu") is WeightFormat.INT4
    # the integer kernels are the CPU's path; a GPU gets its native float
    assert native_weights(default_model_dir, "cuda") is WeightFormat.BFLOAT16
    assert native_weights(default_model_dir, "mps") is WeightFormat.FLOAT32


def test_a_float_folder_keeps_its_dtype_where_the_device_multiplies_it(tmp_path: Path) -> None:
    fp32 = _folder(tmp_path, "a", torch.float32)
    assert stored_matrix_kind(fp32) == "float32"
    assert native_weights(fp32, "cpu") is WeightFormat.FLOAT32
    bf16 = _folder(tmp_path, "b", torch.bfloat16)
    assert stored_matrix_kind(bf16) == "bfloat16"
    expected = WeightFormat.BFLOAT16 if cpu_has_bf16() else WeightFormat.FLOAT32
    assert native_weights(bf16, "cpu") is expected
    fp16 = _folder(tmp_path, "c", torch.float16)
    assert native_weights(fp16, "cpu") is WeightFormat.FLOAT32  # emulated there
    assert native_weights(fp16, "cuda") is WeightFormat.FLOAT16


def test_a_partial_folder_is_read_off_its_manifest(tmp_path: Path) -> None:
    # a node fetching its shards from peers knows the format before any tensor arrives
    tensors = [
        ["model.embed_tokens.weight.q8_0.qs", 0, "I8", [8, 64], 512, "0" * 64],
        ["model.layers.0.mlp.up_proj.weight.q8_0.qs", 1, "I8", [128, 64], 8192, "0" * 64],
    ]
    (tmp_path / SHARDS_MARKER).write_text(json.dumps({"manifest": {"tensors": tensors}}))
    assert stored_matrix_kind(tmp_path) == "q8_0"
    assert native_weights(tmp_path, "cpu") is WeightFormat.INT8


def test_native_is_a_setting_not_a_format(default_model_dir: Path) -> None:
    assert WEIGHT_CHOICES[0] == NATIVE
    assert check_weights(" Native ", "cpu") == NATIVE  # settled once the node has its model
    assert settle_weights("native", default_model_dir, "cpu") is WeightFormat.INT4
    assert settle_weights("auto", default_model_dir, "cpu") is None
    assert settle_weights("bf16", default_model_dir, "cpu") is WeightFormat.BFLOAT16
    with pytest.raises(InvalidRequest, match="native"):
        parse_weights("native")


def test_loading_with_no_format_named_serves_the_native_one(
    default_model_dir: Path, tiny_model_dir: Path
) -> None:
    from hetmesh.partition.stage import load_stage

    assert load_stage(default_model_dir, 31, 32).weights is WeightFormat.INT4
    assert load_stage(tiny_model_dir, 0, 1).weights is WeightFormat.FLOAT32
    # the older dtype= spelling still names a float format on its own
    assert load_stage(default_model_dir, 31, 32, dtype=torch.float32).weights is (
        WeightFormat.FLOAT32
    )
