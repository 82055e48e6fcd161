"""Native int4 checkpoints written in the packed runtime layout (``hetmesh model synth``):
an int4 stage on this CPU reads the nibbles as they are; every other reader (float
stages, another CPU's layout, Q4_1's own order) gets the same weights as from a folder
in Q4_1's byte order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetmesh.partition import int4_direct
from hetmesh.partition.checkpoint import CheckpointReader, stored_matrix_kind
from hetmesh.partition.stage import load_stage
from hetmesh.partition.synth import parse_synth_name
from hetmesh.partition.synth_write import write_folder

pytestmark = [pytest.mark.model]

OTHER = {"halves of 64": "pairs in 32"}  # a layout this CPU does not pack in


def _layers(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["num_hidden_layers"])


def _int4_tensors(folder: Path) -> dict[str, torch.Tensor]:
    stage = load_stage(folder, 0, _layers(folder) + 2, weights="int4", fuse=False)
    return {k: v.clone() for k, v in stage.state_dict().items()}


def test_packed_and_plain_folders_hold_the_same_weights(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_synth_name("synth-tiny")
    plain, packed, foreign = tmp_path / "plain", tmp_path / "packed", tmp_path / "foreign"
    write_folder(spec, plain, default_model_dir, packed=False)
    write_folder(spec, packed, default_model_dir)
    here = int4_direct.int4_layout_name()
    other = OTHER.get(here, "halves of 64")
    with monkeypatch.context() as patched:  # as a CPU packing another way writes it
        patched.setattr(int4_direct, "int4_layout_name", lambda: other)
        write_folder(spec, foreign, default_model_dir)
    assert stored_matrix_kind(packed) == stored_matrix_kind(plain) == "q4_1"

    with (
        CheckpointReader(plain) as a,
        CheckpointReader(packed) as b,
        CheckpointReader(foreign) as c,
    ):
        matrices = [n for n in a.names() if ".layers." in n and a.kind(n) == "q4_1"]
        assert matrices
        assert a.names() == b.names() == c.names()
        suffix = int4_direct.packed_suffix()
        assert all(f"{n}{suffix}" in b.files for n in matrices)
        for name in matrices:
            rows = a.shape(name)[0]
            assert b.shape(name) == c.shape(name) == a.shape(name)
            for start, stop in ((0, rows), (3, min(rows, 70))):
                want = a.q4_1_bytes(name, start, stop)
                for reader in (b, c):
                    got = reader.q4_1_bytes(name, start, stop)
                    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
                    assert torch.equal(reader.rows(name, start, stop), a.rows(name, start, stop))
            assert a.q4_1_packed(name) is None
            assert c.q4_1_packed(name) is None  # another CPU's layout: unpacked, repacked
            stored = b.q4_1_packed(name)
            assert stored is not None
            want_packed = torch.empty_like(stored[0])
            int4_direct.pack_q4_1_into(a.q4_1_bytes(name, 0, rows)[0], want_packed)
            assert torch.equal(stored[0], want_packed)

    # the stages all three load are the same, bit for bit, in int4 and float32
    reference = _int4_tensors(plain)
    for folder in (packed, foreign):
        held = _int4_tensors(folder)
        assert held.keys() == reference.keys()
        assert all(torch.equal(held[k], reference[k]) for k in reference)
    floats = load_stage(plain, 0, _layers(plain) + 2, weights="float32").state_dict()
    for key, value in (
        load_stage(packed, 0, _layers(packed) + 2, weights="float32").state_dict().items()
    ):
        assert torch.equal(value, floats[key]), key
