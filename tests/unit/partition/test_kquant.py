"""K-quant GGUF tensors (Q4_K, Q5_K, Q6_K) stay compact, and read back as ``gguf`` reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetmesh.partition import kquant
from hetmesh.partition.checkpoint import CheckpointReader, stored_matrix_kind
from hetmesh.partition.gguf_compact import compact_tensors, write_safetensors
from hetmesh.partition.quant import (
    Int4Linear,
    Int8Linear,
    fit_groups_int4,
    quantize_groups_int4,
    quantize_rows_int8,
)
from tests.unit.partition.kquant_files import QUANTISERS

ROWS, WIDTH = 64, 512
NAMES = {  # GGUF name -> (type, the folder's name)
    "blk.0.ffn_up.weight": ("Q4_K", "model.layers.0.mlp.up_proj.weight"),
    "blk.0.ffn_gate.weight": ("Q5_K", "model.layers.0.mlp.gate_proj.weight"),
    "blk.0.ffn_down.weight": ("Q6_K", "model.layers.0.mlp.down_proj.weight"),
}


def _values(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of different magnitudes and a few outliers, as real weights have
    scale = np.exp(rng.uniform(-4, -1, (ROWS, 1)))
    values = rng.standard_normal((ROWS, WIDTH)) * scale
    values[rng.integers(0, ROWS, 8), rng.integers(0, WIDTH, 8)] *= 6
    return values.astype(np.float32)


def _folder(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A compact folder of one tensor per K type; returns it and gguf's values for each."""
    import gguf

    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    reference = {}
    for seed, (name, (kind, hf)) in enumerate(NAMES.items()):
        qtype = gguf.GGMLQuantizationType[kind]
        raw = QUANTISERS[kind](_values(seed))
        writer.add_tensor(name, raw, raw_dtype=qtype)
        reference[hf] = gguf.quants.dequantize(raw, qtype).reshape(ROWS, WIDTH)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = compact_tensors(
        gguf.GGUFReader(str(path)),
        path,
        heads=1,
        kv_heads=1,
        permute_qk=False,
        progress=lambda f: None,
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    write_safetensors(tensors, folder / "model.safetensors")
    return folder, reference


def test_k_blocks_are_kept_and_read_back_bit_identical_to_gguf(tmp_path: Path) -> None:
    folder, reference = _folder(tmp_path)
    with CheckpointReader(folder) as reader:
        for kind, hf in NAMES.values():
            assert reader.kind(hf) == kind.lower()
            assert reader.shape(hf) == (ROWS, WIDTH)
            # stored as the file's blocks: 4.5, 5.5 and 6.5625 bits per weight
            stored = reader._slice(f"{hf}.{kind.lower()}.blocks").get_shape()
            assert stored == (ROWS, WIDTH // 256 * kquant.BLOCK_BYTES[kind.lower()])
            np.testing.assert_array_equal(reader.tensor(hf).numpy(), reference[hf])
            np.testing.assert_array_equal(reader.rows(hf, 5, 9).numpy(), reference[hf][5:9])
    assert stored_matrix_kind(folder) == "q4_k"  # a mix is named by its 4-bit part


def test_q4_k_is_4_bit_groups_of_32_exactly(tmp_path: Path) -> None:
    folder, reference = _folder(tmp_path)
    hf = NAMES["blk.0.ffn_up.weight"][1]
    with CheckpointReader(folder) as reader:
        q, d, m = reader.q4_blocks(hf)
    assert q.dtype == torch.uint8
    assert int(q.max()) <= 15
    assert d.shape == m.shape == (ROWS, WIDTH // 32)
    rebuilt = (q.float().reshape(ROWS, -1, 32) * d[..., None] + m[..., None]).reshape(ROWS, WIDTH)
    np.testing.assert_array_equal(rebuilt.numpy(), reference[hf])

    # the int4 kernel holds scale and zero point (m + 8 d) in bf16: each is within
    # half a bf16 unit (2**-8 relative: 8 significant bits), so each weight within that of its terms
    packed, scales_zeros = Int4Linear.pack(q, d, m)
    layer = Int4Linear(WIDTH, ROWS, bias=False, device="cpu")
    layer.weight_packed, layer.scales_zeros = packed, scales_zeros
    held = layer.dequantized()
    want = torch.from_numpy(reference[hf])
    zero = m + 8.0 * d
    bound = ((q.float() - 8).abs().reshape(ROWS, -1, 32) * d.abs()[..., None]) + zero.abs()[
        ..., None
    ]
    bound = bound.reshape(ROWS, WIDTH) * 2.0**-8
    assert torch.all((held - want).abs() <= bound * 1.0001)
    # and held the same 4-bit levels: the kernel's own layout unpacks to q
    from hetmesh.partition.quant import unpack_int4

    assert torch.equal(unpack_int4(packed)[:ROWS], q)


@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K"])
def test_wide_k_quants_as_int8_rows_stay_close(tmp_path: Path, kind: str) -> None:
    """The measured error of holding Q5_K / Q6_K as int8 per row (docs/weights.md), as
    folders converted before 2026-12-06 still hold them."""
    folder, reference = _folder(tmp_path)
    hf = next(h for k, h in NAMES.values() if k == kind)
    with CheckpointReader(folder) as reader:
        q8, scale = quantize_rows_int8(reader.tensor(hf))
    want = torch.from_numpy(reference[hf])
    held = q8.float() * scale[:, None]
    rel = float((held - want).norm() / want.norm())
    # int8 per row: half a step of each row's max / 127 at most
    assert torch.all((held - want).abs() <= scale[:, None] / 2 * 1.0001)
    assert rel < 0.01, rel

    layer = Int8Linear(WIDTH, ROWS, bias=False, device="cpu", bf16_activations=True)
    layer.weight_q, layer.weight_scale = q8, scale
    x = torch.randn(3, WIDTH)
    exact = x @ want.t()
    got = layer(x)
    assert float((got - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K"])
def test_wide_k_quants_refitted_to_int4_groups(tmp_path: Path, kind: str) -> None:
    """Q5_K / Q6_K in an int4 stage: 4-bit groups refitted to the file's values, closer
    to them than Q4_1's min-max rule, and the int4 kernel's product near the exact one."""
    folder, reference = _folder(tmp_path)
    hf = next(h for k, h in NAMES.values() if k == kind)
    with CheckpointReader(folder) as reader:
        values = reader.tensor(hf)
    want = torch.from_numpy(reference[hf])
    assert torch.equal(values, want)

    def error(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> float:
        held = q.float().reshape(ROWS, -1, 32) * d[..., None] + m[..., None]
        return float((held.reshape(ROWS, WIDTH) - want).norm() / want.norm())

    q, d, m = fit_groups_int4(values)
    assert q.dtype == torch.uint8
    assert int(q.max()) <= 15
    fitted, min_max = error(q, d, m), error(*quantize_groups_int4(values))
    # seeded Gaussian rows: 7.5 % (Q6_K) against min-max's 7.9 %; on real weights the
    # refit gains more (SmolLM2's down_proj in Q6_K: 1.9 % against 2.9 %, bench/kquant.py)
    assert fitted < min_max, (fitted, min_max)
    assert fitted < 0.08, fitted

    layer = Int4Linear(WIDTH, ROWS, bias=False, device="cpu")
    layer.weight_packed, layer.scales_zeros = Int4Linear.pack(q, d, m)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(7))
    held = (q.float().reshape(ROWS, -1, 32) * d[..., None] + m[..., None]).reshape(ROWS, WIDTH)
    # the kernel computes the held weights' product (to its bf16 activations) ...
    on_held = x @ held.t()
    assert float((layer(x) - on_held).norm() / on_held.norm()) < 0.01
    # ... which is as near the file's product as the held weights are to the file's
    exact = x @ want.t()
    assert float((layer(x) - exact).norm() / exact.norm()) < 1.5 * fitted


def test_refit_keeps_flat_groups_exact() -> None:
    """A group of zeros or of one value stays exactly itself."""
    values = torch.zeros(64, 64)
    values[1, 32:] = 0.25
    values[2] = torch.linspace(-1, 1, 64)
    q, d, m = fit_groups_int4(values)
    held = (q.float().reshape(64, 2, 32) * d[..., None] + m[..., None]).reshape(64, 64)
    assert torch.equal(held[:2], values[:2])
    assert torch.all(held[3:] == 0)
    assert float((held[2] - values[2]).abs().max()) <= float(d[2].max()) / 2 + 1e-6
