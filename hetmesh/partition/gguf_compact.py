"""A GGUF file rewritten as a compact safetensors folder (no float inflation).

Quantized blocks are copied as they are (see :mod:`hetmesh.partition.checkpoint`
for the tensor names): Q4_1 and Q4_0 as Q4_1 blocks (Q4_0's ``w = d (q - 8)``
is Q4_1 with ``m = -8 d``, exactly), Q8_0 as Q8_0 blocks, Q4_K, Q5_K and Q6_K
as their own super-blocks (:mod:`hetmesh.partition.kquant`); F32, F16 and BF16
tensors keep their dtype. Other supported block types (Q2_K, Q3_K, Q5_0,
Q5_1) are dequantised one tensor at a time with the ``gguf`` package's own
numpy routines and stored as fp16 (more mantissa than bf16; fp32 for a
tensor whose values do not fit fp16).

Every tensor's type is checked before anything is written: an unsupported
type is one ``UnsupportedModel`` line naming it and the supported ones.

Llama GGUF files hold q and k projections with their rows permuted for
llama.cpp's rotary layout; the rows are put back in Hugging Face order (a row
permutation, applied to the blocks and their scales alike).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hetmesh.errors import CorruptModel, UnsupportedModel
from hetmesh.partition.kquant import BLOCK_BYTES, GGUF_NAMES, logical_width

# GGUF types kept as blocks, kept as floats, and dequantised per tensor
_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_K_TYPES = tuple(GGUF_NAMES)  # kept as their GGUF super-blocks
_FLOAT_TYPES = ("F32", "F16", "BF16")
_DEQUANT_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K")
SUPPORTED_TYPES = (*_FLOAT_TYPES, *_BLOCK_TYPES, *_K_TYPES, *_DEQUANT_TYPES)
_FP16_MAX = 65504.0

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SKIPPED = {"rope_freqs.weight"}  # recomputed by the rotary module
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face tensor name of a GGUF tensor (None for tensors we skip)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    found = _LAYER.match(gguf_name)
    if found and found.group(2) in _LAYER_NAMES:
        index, part, kind = found.groups()
        return f"model.layers.{index}.{_LAYER_NAMES[part]}.{kind}"
    return None


def check_tensor_types(reader: Any, path: Path) -> None:
    """Raise ``UnsupportedModel`` (one line) if any tensor has a type we cannot load."""
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES and tensor.name not in _SKIPPED:
            raise UnsupportedModel(
                f"{path}: tensor {tensor.name} has GGUF type {kind}; supported: "
                f"{', '.join(SUPPORTED_TYPES)}"
            )


def compact_tensors(
    reader: Any,
    path: Path,
    *,
    heads: int,
    kv_heads: int,
    permute_qk: bool,
    progress: Callable[[float], None],
) -> dict[str, np.ndarray]:
    """The folder's tensors (name -> numpy array) for every mapped GGUF tensor."""
    check_tensor_types(reader, path)
    out: dict[str, np.ndarray] = {}
    tensors = list(reader.tensors)
    for done, tensor in enumerate(tensors):
        progress(done / max(len(tensors), 1))
        name = hf_name(tensor.name)
        if name is None:
            continue
        rows_perm: Callable[[np.ndarray], np.ndarray] = _identity
        if permute_qk and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
            n_head = heads if ".attn_q." in tensor.name else kv_heads
            rows_perm = _row_unpermuter(n_head)
        try:
            out.update(_convert(tensor, name, rows_perm))
        except (ValueError, TypeError, IndexError) as exc:
            raise CorruptModel(f"{path}: tensor {tensor.name} is malformed ({exc})") from exc
    return out


def _identity(array: np.ndarray) -> np.ndarray:
    return array


def _row_unpermuter(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    """Undo llama.cpp's q/k row interleaving on any per-row array ``(n, ...)``."""

    def unpermute(array: np.ndarray) -> np.ndarray:
        rows = array.shape[0]
        half = rows // n_head // 2
        grouped = array.reshape(n_head, half, 2, *array.shape[1:])
        return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(array.shape))

    return unpermute


def _logical_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest axis first


def _convert(
    tensor: Any, name: str, rows_perm: Callable[[np.ndarray], np.ndarray]
) -> dict[str, np.ndarray]:
    import gguf

    kind = tensor.tensor_type.name
    shape = _logical_shape(tensor)
    data = np.asarray(tensor.data)
    if kind in _BLOCK_TYPES:
        rows, width = shape
        groups = width // 32
        block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        blocks = data.reshape(rows, groups, block_bytes)
        d = blocks[..., 0:2].copy().view(np.float16).reshape(rows, groups)
        if kind == "Q8_0":
            qs = blocks[..., 2:34].copy().view(np.int8).reshape(rows, width)
            return {f"{name}.q8_0.qs": rows_perm(qs), f"{name}.q8_0.d": rows_perm(d)}
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16).reshape(rows, groups)
            nibbles = blocks[..., 4:20].reshape(rows, width // 2)
        else:
            m = (d.astype(np.float32) * -8.0).astype(np.float16)  # exact: a power of two
            nibbles = blocks[..., 2:18].reshape(rows, width // 2)
        return {
            f"{name}.q4_1.qs": rows_perm(np.ascontiguousarray(nibbles)),
            f"{name}.q4_1.d": rows_perm(d),
            f"{name}.q4_1.m": rows_perm(m),
        }
    if kind in _K_TYPES:
        stored = GGUF_NAMES[kind]
        row_bytes = shape[1] // 256 * BLOCK_BYTES[stored]
        return {f"{name}.{stored}.blocks": rows_perm(data.reshape(shape[0], row_bytes))}
    if kind == "F32":
        return {name: rows_perm(data.astype(np.float32, copy=False).reshape(shape))}
    if kind == "F16":
        return {name: rows_perm(data.astype(np.float16, copy=False).reshape(shape))}
    if kind == "BF16":
        # numpy has no bfloat16: keep the raw bits, marked for the writer
        bits = data.view(np.uint16).reshape(shape)
        return {f"{name}{BF16_SUFFIX}": rows_perm(bits)}
    values = gguf.quants.dequantize(data, tensor.tensor_type).reshape(shape)
    if np.abs(values).max(initial=0.0) < _FP16_MAX:
        return {name: rows_perm(values.astype(np.float16))}
    return {name: rows_perm(values.astype(np.float32))}


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The ``rope_parameters`` (type ``llama3``) that a GGUF's ``rope_freqs`` tensor encodes.

    llama.cpp's converter writes Llama 3.x's rope scaling as one divisor per
    rotary frequency (``rope_freqs.weight``), not as metadata, and transformers'
    GGUF loader ignores that tensor: served without it, every position past the
    first would rotate wrongly. The divisors are ``1`` for high frequencies,
    ``factor`` for low ones and ``1 / ((1 - s) / factor + s)`` between, with
    ``s`` linear in ``1 / wavelength``; fitting that line gives the parameters
    (``low_freq_factor`` taken as 1, as every Llama 3.x has: the divisors fix
    only the line, not how it was written). The parameters are checked by
    recomputing every divisor; ``None`` if they are all 1, ``UnsupportedModel``
    if no llama3 scaling reproduces them.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    dims = np.arange(0, head_dim, 2, dtype=np.float64)
    if f.shape[0] != dims.shape[0]:
        raise UnsupportedModel(f"rope_freqs has {f.shape[0]} values for head_dim {head_dim}")
    if np.all(np.abs(f - 1.0) < 1e-6):
        return None
    factor = float(np.float32(f.max()))
    wavelen = 2 * np.pi * theta ** (dims / head_dim)
    between = (f > 1.0 + 1e-6) & (f < factor * (1 - 1e-6))
    if int(between.sum()) >= 2:
        smooth = (1.0 / f[between] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelen[between], smooth, 1)
        high = float(np.round(1.0 - 1.0 / intercept, 4))
        original = round(float(slope * (high - 1.0)))
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(theta),
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        if np.allclose(_llama3_divisors(rope, wavelen), f, rtol=1e-5, atol=0):
            return rope
    raise UnsupportedModel(
        "rope_freqs holds rope factors that no llama3 rope scaling reproduces "
        "(fewer than two frequencies between the scaled and unscaled ones)"
    )


def _llama3_divisors(rope: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter stores for ``rope``: one divisor per frequency."""
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))
    return np.asarray(out, dtype=np.float64)


TABLE_BLOCKS_KEY = "hetmesh_table_block_bytes"  # config.json: a K-quant token table's bytes
INT8_LINEARS_KEY = "hetmesh_int8_linears"  # config.json: layer -> matrices held in int8
# an int4 stage of a K-quant file may hold this much of the file's size: wide (Q5_K,
# Q6_K) matrices stay int8 while the whole stays under it (the 1.1, less a
# margin for what the estimate leaves out: rotary tables, padding)
WIDE_BUDGET_OVER_FILE = 1.09
_LAYER_MATRIX = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight$")
_STORED = re.compile(r"(.+\.weight)\.(q4_1|q8_0|q4_k|q5_k|q6_k)\.(\w+)$")
_WIDE_ORDER = ("self_attn.v_proj", "mlp.down_proj")  # kept wide first (llama.cpp's choice)


def _split_name(name: str) -> tuple[str, str, str]:
    """A folder tensor's name -> (the weight's name, its stored kind or "", the part)."""
    name = name.removesuffix(BF16_SUFFIX)
    found = _STORED.match(name)
    return (found.group(1), found.group(2), found.group(3)) if found else (name, "", "")


def _logical_shape_of(kind: str, array: np.ndarray) -> tuple[int, int]:
    rows, width = int(array.shape[0]), int(array.shape[1])
    if kind in BLOCK_BYTES:
        return rows, logical_width(kind, width)
    return rows, width * 2 if kind == "q4_1" else width


def stored_layout(tensors: dict[str, np.ndarray], file_bytes: int | None = None) -> dict[str, Any]:
    """What the planner must know of how a compact folder stores a K-quant file, for its
    ``config.json``: the bytes of a token table a compact stage keeps in its K-quant
    blocks, and which Q5_K/Q6_K decoder matrices an int4 stage holds in int8
    (:func:`wide_in_int8`; the others are refitted to int4 groups)."""
    out: dict[str, Any] = {}
    for name, array in tensors.items():
        if name.startswith("model.embed_tokens.weight.q") and name.endswith(".blocks"):
            out[TABLE_BLOCKS_KEY] = int(array.nbytes)
    wide = wide_in_int8(tensors, file_bytes)
    if wide:
        out[INT8_LINEARS_KEY] = wide
    return out


def wide_in_int8(tensors: dict[str, np.ndarray], file_bytes: int | None) -> dict[str, list[str]]:
    """Which Q5_K/Q6_K decoder matrices an int4 stage keeps in int8 (layer -> names).

    int8 per row keeps a wide matrix within ~1 % of the file's values; int4 groups,
    refitted, hold it at 4 bits (docs/weights.md). int8 costs 8 bits a weight against
    int4's 5, so as many stay int8 as keep the whole model's int4 stage within
    :data:`WIDE_BUDGET_OVER_FILE` of the file: ``attn_v`` first, then ``ffn_down``,
    the layers nearest either end first. Without ``file_bytes``: none.
    """
    from hetmesh.partition.formats import WeightFormat, linear_weight_bytes

    if not file_bytes:
        return {}
    held = 0  # an int4 stage of the whole model, every wide matrix in int4
    wide: list[tuple[int, str, int]] = []  # (layer, name, extra bytes in int8)
    layers = 0
    for name, array in tensors.items():
        base, kind, part = _split_name(name)
        if part not in ("", "qs", "blocks"):
            continue  # a Q4_1 / Q8_0 matrix's scales: counted with its values
        found = _LAYER_MATRIX.match(base)
        if array.ndim == 1:
            held += 4 * int(array.shape[0])  # norms, fp32
        elif found:
            rows, width = _logical_shape_of(kind, array)
            int4 = linear_weight_bytes(rows, width, WeightFormat.INT4)
            held += int4
            layer = int(found.group(1))
            layers = max(layers, layer + 1)
            if kind in ("q5_k", "q6_k"):
                int8 = linear_weight_bytes(rows, width, WeightFormat.INT8)
                wide.append((layer, found.group(2), int8 - int4))
        elif base == "model.embed_tokens.weight" and part == "blocks":
            held += int(array.nbytes)  # the table kept in its blocks
        elif base in ("model.embed_tokens.weight", "lm_head.weight"):
            rows, width = _logical_shape_of(kind, array)
            held += rows * (width + 4)  # int8 per row, an fp32 scale each
    budget = WIDE_BUDGET_OVER_FILE * file_bytes - held

    def order(item: tuple[int, str, int]) -> tuple[int, int, int]:
        layer, name, _ = item
        rank = _WIDE_ORDER.index(name) if name in _WIDE_ORDER else len(_WIDE_ORDER)
        return rank, min(layer, layers - 1 - layer), layer

    kept: dict[int, list[str]] = {}
    for layer, name, extra in sorted(wide, key=order):
        if extra <= budget:
            budget -= extra
            kept.setdefault(layer, []).append(name)
    return {str(k): sorted(v) for k, v in sorted(kept.items())}


def gguf_field(reader: Any, key: str) -> Any:
    """A scalar metadata value of a GGUF file (None if absent)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return field.parts[field.data[0]][0]


BF16_SUFFIX = "\x00bf16"  # an internal marker, never written as a name


def write_safetensors(tensors: dict[str, np.ndarray], file: Path) -> None:
    """Write the arrays (bf16 bit patterns restored to bfloat16) as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    for name, array in tensors.items():
        if name.endswith(BF16_SUFFIX):
            bits = torch.from_numpy(np.array(array, dtype=np.uint16).view(np.int16))
            state[name.removesuffix(BF16_SUFFIX)] = bits.view(torch.bfloat16)
        else:
            array = np.ascontiguousarray(array)
            if not array.flags.writeable:  # a view of the memory-mapped GGUF
                array = array.copy()
            state[name] = torch.from_numpy(array)
    save_file(state, str(file), metadata={"format": "pt", "hetmesh_layout": "compact"})


def write_config(config: dict[str, Any], folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = [
    "SUPPORTED_TYPES",
    "check_tensor_types",
    "compact_tensors",
    "gguf_field",
    "hf_name",
    "llama3_rope",
    "stored_layout",
    "wide_in_int8",
    "write_safetensors",
]
