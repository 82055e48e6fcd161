"""The model manifest: content-addressed, unit-aware, announced in a bounded field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hetmesh.errors import CorruptModel
from hetmesh.partition.store import weight_files
from hetmesh.scheduler.announcement import (
    MAX_HELD_RANGES,
    ServingAnnouncement,
    read_serving,
    serving_extra,
)
from hetmesh.shards.manifest import (
    Manifest,
    build_manifest,
    load_or_build,
    local_holding,
    tensors_for_units,
    unit_of,
    unit_ranges,
    units_present,
)
from tests.unit.partition.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tied")
    save_tiny("llama-tied", folder)
    return folder


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("untied")
    save_tiny("llama-untied", folder)
    return folder


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        ("model.embed_tokens.weight", 0),
        ("model.embed_tokens.weight.q8_0.qs", 0),
        ("model.layers.0.mlp.up_proj.weight.q4_1.d", 1),
        ("model.layers.3.input_layernorm.weight", 4),
        ("model.norm.weight", 5),
        ("lm_head.weight", 5),
    ],
)
def test_unit_of_follows_the_profile_units(name: str, unit: int) -> None:
    assert unit_of(name, 4) == unit


@pytest.mark.parametrize("name", ["model.layers.4.mlp.up_proj.weight", "rotary.inv_freq"])
def test_unit_of_refuses_a_tensor_outside_the_model(name: str) -> None:
    with pytest.raises(CorruptModel):
        unit_of(name, 4)


def test_manifest_lists_every_tensor_with_its_hash(tied: Path) -> None:
    manifest = build_manifest(tied)
    stored = weight_files(tied)
    assert sorted(t.name for t in manifest.tensors) == sorted(stored)
    assert manifest.num_units == 6
    assert manifest.tied_embeddings
    assert {f.name for f in manifest.files} >= {"config.json"}
    embed = manifest.tensor("model.embed_tokens.weight")
    assert (embed.unit, embed.dtype, embed.shape, embed.nbytes) == (0, "F32", (96, 64), 96 * 64 * 4)


def test_manifest_id_is_stable_and_changes_with_any_byte(tied: Path, tmp_path: Path) -> None:
    first = build_manifest(tied)
    assert build_manifest(tied).id == first.id
    assert Manifest.from_json(json.loads(json.dumps(first.to_json()))) == first
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tied.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert build_manifest(copy, model=tied.name).id == first.id
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor's data
    weights.write_bytes(bytes(data))
    assert build_manifest(copy, model=tied.name).id != first.id


def test_tied_head_needs_the_embedding_untied_does_not(tied: Path, untied: Path) -> None:
    head_tied = {t.name for t in tensors_for_units(build_manifest(tied), 5, 6)}
    assert head_tied == {"model.norm.weight", "model.embed_tokens.weight"}
    head_untied = {t.name for t in tensors_for_units(build_manifest(untied), 5, 6)}
    assert head_untied == {"model.norm.weight", "lm_head.weight"}
    middle = tensors_for_units(build_manifest(tied), 2, 3)
    assert middle
    assert all(t.name.startswith("model.layers.1.") for t in middle)


def test_units_present_and_runs(tied: Path) -> None:
    manifest = build_manifest(tied)
    names = [t.name for t in tensors_for_units(manifest, 1, 3)]
    assert units_present(manifest, names) == [1, 2]
    without_one = [n for n in names if n != "model.layers.0.input_layernorm.weight"]
    assert units_present(manifest, without_one) == [2]
    assert unit_ranges([5, 0, 1, 2, 4]) == [(0, 3), (4, 6)]
    assert unit_ranges([]) == []


def test_load_or_build_keeps_it_and_notices_a_changed_file(tied: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    for f in tied.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    first = load_or_build(folder)
    assert (folder / "hetmesh-manifest.json").is_file()
    assert load_or_build(folder) == first
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (folder / "model.safetensors").write_bytes(bytes(data))
    os.utime(folder / "model.safetensors", ns=(1, 1))  # a different stamp
    assert load_or_build(folder).id != first.id
    manifest_id, held = local_holding(folder)
    assert len(manifest_id) == 64
    assert held == [(0, 6)]


def test_local_holding_of_a_broken_folder_is_empty(tmp_path: Path) -> None:
    assert local_holding(tmp_path) == ("", [])


@pytest.mark.parametrize(
    "raw",
    [
        None,
        {"manifest_version": 2},
        {
            "manifest_version": 1,
            "model": "m",
            "num_units": 2,
            "tied_embeddings": False,
            "files": [["../../etc/passwd", 1, "0" * 64]],
            "tensors": [],
        },
        {
            "manifest_version": 1,
            "model": "m",
            "num_units": 2,
            "tied_embeddings": False,
            "files": [],
            "tensors": [["t", 2, "F32", [1], 4, "0" * 64]],
        },
        {
            "manifest_version": 1,
            "model": "m",
            "num_units": 2,
            "tied_embeddings": False,
            "files": [],
            "tensors": [["t", 0, "F32", [1], -4, "0" * 64]],
        },
        {
            "manifest_version": 1,
            "model": "m",
            "num_units": 2,
            "tied_embeddings": False,
            "files": [],
            "tensors": [["t", 0, "F32", [1], 4, "xyz"]],
        },
    ],
)
def test_malformed_manifest_is_corrupt_model(raw: object) -> None:
    with pytest.raises(CorruptModel):
        Manifest.from_json(raw)


def test_announcement_carries_manifest_and_units_held() -> None:
    state = ServingAnnouncement(model="m", manifest="ab" * 32, units_held=((0, 3), (7, 9)))
    extra = serving_extra(state)
    back = read_serving(extra)
    assert (back.manifest, back.units_held) == ("ab" * 32, ((0, 3), (7, 9)))


@pytest.mark.parametrize(
    ("manifest", "held", "want_manifest", "want_held"),
    [
        ("AB" * 32, [[0, 1]], "", ((0, 1),)),
        ("ab" * 31, [[0, 1]], "", ((0, 1),)),
        ("ab" * 32, [[2, 1], [0, 1], [True, 3], "x", [1, 2, 3]], "ab" * 32, ((0, 1),)),
        ("ab" * 32, [[0, 1]] * (MAX_HELD_RANGES + 1), "ab" * 32, ()),
        (7, {"0": 1}, "", ()),
    ],
)
def test_announcement_reader_drops_bad_manifest_fields(
    manifest: object, held: object, want_manifest: str, want_held: tuple[tuple[int, int], ...]
) -> None:
    back = read_serving({"model": "m", "manifest": manifest, "units_held": held})
    assert back.model == "m"
    assert (back.manifest, back.units_held) == (want_manifest, want_held)
