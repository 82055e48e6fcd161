"""The model store refuses bad models with the right one-line error, leaving no debris."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetmesh.errors import CorruptModel, ModelNotFound, UnsupportedModel
from hetmesh.partition.store import default_cache_dir, resolve_model


def _write_gguf(path: Path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((32, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_nonexistent_path_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="not found"):
        resolve_model(tmp_path / "nope", cache_dir=tmp_path)
    with pytest.raises(ModelNotFound, match="empty"):
        resolve_model("  ", cache_dir=tmp_path)


def test_folder_without_config_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"config\.json"):
        resolve_model(tmp_path, cache_dir=tmp_path / "cache")


def test_unsupported_architecture_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        resolve_model(tmp_path, cache_dir=tmp_path / "cache")


def test_folder_with_only_pytorch_bin_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UnsupportedModel, match="safetensors"):
        resolve_model(tmp_path, cache_dir=tmp_path / "cache")


def test_other_file_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "weights.onnx"
    path.write_bytes(b"x")
    with pytest.raises(UnsupportedModel):
        resolve_model(path, cache_dir=tmp_path / "cache")


def test_truncated_gguf_is_corrupt_and_leaves_no_model(tmp_path: Path) -> None:
    whole = tmp_path / "whole.gguf"
    _write_gguf(whole, "llama")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size - 500])
    cache = tmp_path / "cache"
    with pytest.raises(CorruptModel, match="truncated") as info:
        resolve_model(truncated, cache_dir=cache)
    assert "\n" not in str(info.value)
    assert not [p for p in (cache / "models").iterdir() if not p.name.startswith(".")]
    assert not list((cache / "tmp").iterdir())


def test_gguf_of_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2")
    with pytest.raises(UnsupportedModel, match="gpt2"):
        resolve_model(path, cache_dir=tmp_path / "cache")


def test_incomplete_gguf_fails_conversion_without_debris(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    _write_gguf(path, "llama")  # readable, but no tokenizer nor most tensors
    cache = tmp_path / "cache"
    with pytest.raises(CorruptModel) as info:
        resolve_model(path, cache_dir=cache)
    assert "\n" not in str(info.value)
    assert not [p for p in (cache / "models").iterdir() if not p.name.startswith(".")]
    assert not list((cache / "tmp").iterdir())


def test_cache_dir_follows_hetmesh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMESH_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("HETMESH_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hetmesh"


def test_leftovers_of_a_killed_pull_are_cleared(tmp_path: Path) -> None:
    import os

    cache = tmp_path / "cache"
    old = cache / "tmp" / "tmp-killed"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"half")
    os.utime(old, (0, 0))
    fresh = cache / "tmp" / "tmp-running"
    fresh.mkdir()
    with pytest.raises(ModelNotFound):
        resolve_model(tmp_path / "missing.gguf", cache_dir=cache)
    path = tmp_path / "bare.gguf"
    _write_gguf(path, "llama")
    with pytest.raises(CorruptModel):
        resolve_model(path, cache_dir=cache)
    assert not old.exists()
    assert fresh.exists()  # a pull still in progress elsewhere is left alone
