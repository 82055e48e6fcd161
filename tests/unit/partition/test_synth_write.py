"""Synth checkpoints on disk: the same bytes for a seed, resolved by name, GGUF alike."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.errors import ModelError, ModelNotFound
from hetmesh.partition.checkpoint import CheckpointReader, stored_matrix_kind
from hetmesh.partition.store import convert_local_gguf, resolve_model
from hetmesh.partition.synth import SHAPES, parse_synth_name
from hetmesh.partition.synth_write import write_folder, write_gguf
from tests.unit.partition.synth_cache import synth_cache

pytestmark = [pytest.mark.model, pytest.mark.slow]


def digests(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.iterdir())
        if f.is_file()
    }


@pytest.mark.parametrize("name", ["synth-tiny", "synth-tiny-qwen2-bf16"])
def test_the_same_seed_writes_the_same_bytes(
    name: str, tmp_path: Path, default_model_dir: Path
) -> None:
    spec = parse_synth_name(name)
    write_folder(spec, tmp_path / "a", default_model_dir)
    write_folder(spec, tmp_path / "b", default_model_dir)
    first = digests(tmp_path / "a")
    assert "model.safetensors" in first
    assert "tokenizer.json" in first
    assert first == digests(tmp_path / "b")
    other = parse_synth_name(f"{name}-seed1")
    write_folder(other, tmp_path / "c", default_model_dir)
    assert digests(tmp_path / "c")["model.safetensors"] != first["model.safetensors"]


def test_a_synth_name_resolves_to_its_folder_written_once(
    tmp_path: Path, default_model_dir: Path
) -> None:
    cache = synth_cache(tmp_path, default_model_dir)
    folder = resolve_model("synth-tiny", cache_dir=cache)
    assert folder.name == "synth-tiny"
    assert folder.parent.parent == cache / "models"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"]["rope_type"] == "llama3"  # Llama 3's rope scaling
    assert (folder / "chat_template.jinja").read_text() == (
        default_model_dir / "chat_template.jinja"
    ).read_text()
    marker = json.loads((folder / "hetmesh-model.json").read_text())
    assert marker["synth"]["shape"] == "synth-tiny"
    assert "noise" in marker["synth"]["note"]
    assert stored_matrix_kind(folder) == "q4_1"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("synth-tiny", cache_dir=cache) == folder  # not written again
    assert (folder / "model.safetensors").stat().st_mtime_ns == written
    assert stored_matrix_kind(resolve_model("synth-tiny-q8_0", cache_dir=cache)) == "q8_0"
    assert stored_matrix_kind(resolve_model("synth-tiny-bf16", cache_dir=cache)) == "bfloat16"
    with pytest.raises(ModelNotFound, match="unknown synth model 'synth-llama-9b'"):
        resolve_model("synth-llama-9b", cache_dir=cache)


def test_a_damaged_synth_folder_is_written_again(tmp_path: Path, default_model_dir: Path) -> None:
    cache = synth_cache(tmp_path, default_model_dir)
    folder = resolve_model("synth-tiny", cache_dir=cache)
    whole = digests(folder)["model.safetensors"]
    with open(folder / "model.safetensors", "r+b") as handle:
        handle.truncate(1000)
    assert digests(resolve_model("synth-tiny", cache_dir=cache))["model.safetensors"] == whole


def test_too_little_disk_is_refused_before_writing(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = synth_cache(tmp_path, default_model_dir)
    real = shutil.disk_usage

    def small(path: Any) -> Any:
        return real(path)._replace(free=10 * 2**20)

    monkeypatch.setattr("hetmesh.partition.synth_write.shutil.disk_usage", small)
    with pytest.raises(ModelError, match=r"not enough disk .* needs 4\.\d\d GB"):
        resolve_model("synth-llama-3.1-8b", cache_dir=cache)
    with pytest.raises(ModelError, match="not enough disk"):
        write_gguf(parse_synth_name("synth-tiny"), tmp_path / "t.gguf", default_model_dir)
    assert not (cache / "models" / "compact2" / "synth-llama-3.1-8b").exists()
    assert not list((cache / "tmp").iterdir())


@pytest.mark.parametrize("name", ["synth-tiny", "synth-tiny-qwen2-q8_0"])
def test_a_synth_gguf_converts_to_the_same_tensors_and_tokenizer(
    name: str, tmp_path: Path, default_model_dir: Path
) -> None:
    import transformers

    spec = parse_synth_name(name)
    cache = synth_cache(tmp_path, default_model_dir)
    folder = resolve_model(name, cache_dir=cache)
    write_gguf(spec, tmp_path / "m.gguf", default_model_dir)
    converted = convert_local_gguf(tmp_path / "m.gguf", cache)
    with CheckpointReader(folder) as want, CheckpointReader(converted) as got:
        assert got.names() == want.names()
        for name in want.names():  # the folder's decoder nibbles are packed (synth_write)
            assert got.kind(name) == want.kind(name), name
            if want.kind(name) == "q4_1":  # Q4_1's bytes, whichever order they are stored in
                rows = want.shape(name)[0]
                mine, theirs = want.q4_1_bytes(name, 0, rows), got.q4_1_bytes(name, 0, rows)
                pairs = zip(theirs, mine, strict=True)
                assert all(torch.equal(a, b) for a, b in pairs), name
        for stored in set(want.files) & set(got.files):  # blocks byte for byte
            assert got.stored_bytes(stored) == want.stored_bytes(stored), stored
    config = json.loads((converted / "config.json").read_text())
    shape = SHAPES[spec.shape.name]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (
        shape.num_hidden_layers,
        shape.num_key_value_heads,
    )
    text = "<|im_start|>user\nThe lighthouse keeper's café, 12345 émigrés!<|im_end|>"
    ours = transformers.AutoTokenizer.from_pretrained(str(folder))
    theirs = transformers.AutoTokenizer.from_pretrained(str(converted))
    assert theirs.encode(text) == ours.encode(text)


def test_an_existing_folder_named_like_a_synth_model_is_used_in_place(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_folder(parse_synth_name("synth-tiny"), tmp_path / "synth-mine", default_model_dir)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("synth-mine", cache_dir=tmp_path / "cache") == tmp_path / "synth-mine"
    assert not (tmp_path / "cache" / "models").exists()
