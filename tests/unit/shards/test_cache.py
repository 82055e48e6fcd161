"""The partial folder: verified, atomic, resumable, read like any model folder."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from hetmesh.errors import CorruptModel, ModelError
from hetmesh.partition.checkpoint import CheckpointReader
from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import check_model_dir, weight_files
from hetmesh.shards import cache
from hetmesh.shards.fetch import Shards, wants_mesh_model
from hetmesh.shards.manifest import build_manifest, tensors_for_units
from tests.unit.partition.tiny_models import save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny("llama-tied", folder)
    return folder


def _partial(model: Path, root: Path) -> Path:
    manifest = build_manifest(model)
    folder = cache.open_folder(root, manifest, manifest.id)
    for f in manifest.files:
        data = (model / f.name).read_bytes()
        cache.put_file(folder, f.name, data, nbytes=f.nbytes, sha256=f.sha256)
    return folder


def _fill(model: Path, folder: Path, start: int, end: int) -> None:
    manifest = build_manifest(model)
    with CheckpointReader(model) as reader:
        for t in tensors_for_units(manifest, start, end):
            cache.put_tensor(folder, t, reader.stored_bytes(t.name))


def test_a_partial_folder_loads_the_stages_it_holds_exactly(model: Path, tmp_path: Path) -> None:
    folder = _partial(model, tmp_path)
    assert folder.name == model.name  # the same model key as the peers it came from
    check_model_dir(folder)  # no tensors yet, still a model folder
    assert weight_files(folder) == {}
    _fill(model, folder, 2, 4)
    assert {n.split(".")[2] for n in weight_files(folder)} == {"1", "2"}
    partial = load_stage(folder, 2, 4)
    whole = load_stage(model, 2, 4)
    for a, b in zip(partial.state_dict().items(), whole.state_dict().items(), strict=True):
        assert a[0] == b[0]
        assert torch.equal(a[1], b[1])
    with pytest.raises(CorruptModel):
        load_stage(folder, 0, 2)  # units it does not hold


def test_bad_bytes_are_never_written(model: Path, tmp_path: Path) -> None:
    folder = _partial(model, tmp_path)
    entry = build_manifest(model).tensors[0]
    with CheckpointReader(model) as reader:
        data = bytearray(reader.stored_bytes(entry.name))
    data[0] ^= 0xFF
    with pytest.raises(CorruptModel):
        cache.put_tensor(folder, entry, bytes(data))
    assert not cache.has_tensor(folder, entry)
    assert list((folder / "tensors").iterdir()) == []


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ModelError, match="No space left"):
        cache.write_atomically(tmp_path / "t", b"x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_resume_sees_what_is_already_verified(model: Path, tmp_path: Path) -> None:
    folder = _partial(model, tmp_path)
    _fill(model, folder, 1, 3)
    manifest = cache.read_folder_manifest(folder)
    shards = Shards(None, folder, manifest, partial=True)
    assert shards.units_held() == ((1, 3),)


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden"])
def test_unsafe_names_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(CorruptModel):
        cache.shard_folder(tmp_path, "ab" * 32, name)


def test_a_manifest_must_hash_to_the_id_asked_for(model: Path, tmp_path: Path) -> None:
    with pytest.raises(CorruptModel):
        cache.open_folder(tmp_path, build_manifest(model), "cd" * 32)


@pytest.mark.parametrize(
    ("spec", "wanted"),
    [("mesh", True), ("ab" * 32, True), (None, False), ("default", False), ("AB" * 32, False)],
)
def test_which_model_arguments_come_from_the_mesh(spec: str | None, wanted: bool) -> None:
    assert wants_mesh_model(spec) is wanted
