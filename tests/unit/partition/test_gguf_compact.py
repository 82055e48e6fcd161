"""GGUF tensors of every supported type land in the compact folder without loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetmesh.errors import UnsupportedModel
from hetmesh.partition.checkpoint import CheckpointReader
from hetmesh.partition.gguf_compact import compact_tensors, write_safetensors

# GGUF name -> type; shapes (rows, 256) fit every block size (K-quants: 256)
CASES = {
    "blk.0.ffn_up.weight": "Q4_K",
    "blk.0.ffn_gate.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "F16",
    "blk.1.ffn_up.weight": "BF16",
    "blk.1.ffn_gate.weight": "Q4_1",
    "blk.1.ffn_down.weight": "F32",
}
ROWS, WIDTH = 4, 256


def _raw(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or values to write, the float values the file holds)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    values = (rng.standard_normal((ROWS, WIDTH)) * 0.1).astype(np.float32)
    if kind == "F32":
        return values, values
    if kind == "F16":
        return values.astype(np.float16), values.astype(np.float16).astype(np.float32)
    if kind in ("Q4_K", "Q6_K"):  # gguf-py cannot quantize these: random blocks, sane scales
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (ROWS, WIDTH // block_size * type_size), dtype=np.uint8)
        blocks = raw.reshape(ROWS, -1, type_size)
        scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        if kind == "Q4_K":  # d and dmin lead the block
            blocks[..., 0:2] = scale
            blocks[..., 2:4] = scale
        else:  # Q6_K's d ends the block
            blocks[..., -2:] = scale
        return raw, gguf.quants.dequantize(raw, qtype).reshape(ROWS, WIDTH)
    raw = gguf.quants.quantize(values, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(ROWS, WIDTH)


def _write(path: Path, cases: dict[str, str]) -> dict[str, np.ndarray]:
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    expected = {}
    for name, kind in cases.items():
        raw, values = _raw(kind, rng)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, raw)
        else:
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        expected[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_every_supported_type_reads_back_as_the_gguf_values(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "types.gguf"
    expected = _write(path, CASES)
    reader = gguf.GGUFReader(str(path))
    tensors = compact_tensors(
        reader, path, heads=1, kv_heads=1, permute_qk=False, progress=lambda f: None
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    write_safetensors(tensors, folder / "model.safetensors")
    kinds = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
    with CheckpointReader(folder) as checkpoint:
        for gguf_name, kind in CASES.items():
            part = gguf_name.split(".")[2]
            hf = {
                "ffn_up": "mlp.up_proj",
                "ffn_gate": "mlp.gate_proj",
                "ffn_down": "mlp.down_proj",
                "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj",
            }[part]
            name = f"model.layers.{gguf_name.split('.')[1]}.{hf}.weight"
            assert checkpoint.kind(name) == kinds.get(kind, "float"), kind
            got = checkpoint.tensor(name).numpy()
            want = expected[gguf_name]
            np.testing.assert_array_equal(got, want, err_msg=kind)
            if kind in ("Q4_0", "Q4_1", "Q4_K"):  # the 4-bit groups themselves are kept
                q, d, m = checkpoint.q4_blocks(name)
                rebuilt = q.float().reshape(ROWS, -1, 32) * d[..., None] + m[..., None]
                assert torch.equal(rebuilt.reshape(ROWS, WIDTH), torch.from_numpy(want))


def test_unsupported_type_is_one_line_naming_the_supported(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "iq.gguf"
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = np.zeros((ROWS, WIDTH // block_size * type_size), np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel) as info:
        compact_tensors(
            gguf.GGUFReader(str(path)),
            path,
            heads=1,
            kv_heads=1,
            permute_qk=False,
            progress=lambda f: None,
        )
    message = str(info.value)
    assert "\n" not in message
    assert "IQ2_XXS" in message
    for name in ("Q4_K", "Q6_K", "Q4_1", "Q8_0", "BF16"):
        assert name in message


def test_wide_matrices_stay_int8_within_the_budget_attn_v_and_the_ends_first() -> None:
    """Which Q6_K matrices an int4 stage keeps in int8 as the file grows relative to
    what the rest holds: none, then every ``attn_v``, then ``ffn_down`` of the first
    and last layers before the middle ones; never fewer as the budget grows."""
    from hetmesh.partition.gguf_compact import wide_in_int8

    def blocks(kind: str, rows: int, width: int) -> np.ndarray:
        per_row = width // 256 * {"q4_k": 144, "q6_k": 210}[kind]
        return np.zeros((rows, per_row), dtype=np.uint8)

    tensors = {"model.embed_tokens.weight.q4_k.blocks": blocks("q4_k", 512, 256)}
    for i in range(4):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.input_layernorm.weight"] = np.ones(256, dtype=np.float32)
        tensors[f"{layer}.mlp.up_proj.weight.q4_k.blocks"] = blocks("q4_k", 512, 256)
        tensors[f"{layer}.mlp.down_proj.weight.q6_k.blocks"] = blocks("q6_k", 256, 512)
        tensors[f"{layer}.self_attn.v_proj.weight.q6_k.blocks"] = blocks("q6_k", 64, 256)
    tensors["lm_head.weight.q6_k.blocks"] = blocks("q6_k", 512, 256)
    assert wide_in_int8(tensors, None) == {}
    seen: list[set[tuple[int, str]]] = []
    for file_bytes in range(100_000, 2_000_000, 2_000):
        kept = {
            (int(k), n) for k, names in wide_in_int8(tensors, file_bytes).items() for n in names
        }
        if not seen or kept != seen[-1]:
            assert not seen or kept > seen[-1]
            seen.append(kept)
    v = {(i, "self_attn.v_proj") for i in range(4)}
    down = {i: (i, "mlp.down_proj") for i in range(4)}
    assert seen[0] == set()
    assert seen[-1] == v | set(down.values())
    assert v in seen  # every attn_v before any ffn_down
    assert v | {down[0], down[3]} in seen  # the ends' before the middle's
