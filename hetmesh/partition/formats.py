"""Weight formats: how a stage holds its parameters, and what that costs in bytes.

Pure: no torch at import time (``check_supported`` imports it when called).

Committed API (the node, scheduler and CLI build on these)::

    class WeightFormat(StrEnum): FLOAT32, BFLOAT16, FLOAT16, INT8, INT4
    WEIGHT_CHOICES: tuple[str, ...]          # ("native", "auto", "float32", ..., "int4")
    parse_weights(text: str | None) -> WeightFormat | None      # None = auto
    is_native(text: str | None) -> bool                         # "native": the checkpoint's own
    activation_dtype(fmt: WeightFormat) -> str                  # "float32" | "bfloat16" | ...
    kv_dtype(fmt: WeightFormat) -> str                          # the KV cache: fp16 for int8, int4
    unit_param_bytes(config: Mapping[str, Any], fmt: WeightFormat) -> UnitBytes
    check_supported(fmt: WeightFormat, device: str) -> None
    auto_weights(device: str) -> WeightFormat                   # one process's "auto"
    SLOWER_THAN_FP32_ON_CPU: frozenset[WeightFormat]

and, elsewhere in :mod:`hetmesh.partition`::

    model_profile(config, *, dtype: str | None = None, name: str = "",
                  weights: WeightFormat | str | None = None) -> ModelProfile
    load_stage(model_dir, start, end, *, device="cpu",
               weights: WeightFormat | str = WeightFormat.FLOAT32,
               dtype: torch.dtype | None = None,        # deprecated alias of float formats
               attn_implementation="sdpa") -> StageModule
    LocalPipeline.load(model_dir, num_stages=1, *, device="cpu",
                       weights=WeightFormat.FLOAT32, dtype=None) -> LocalPipeline
    StageModule.weights: WeightFormat; StageModule.dtype: torch.dtype (activations/KV)
    StageModule.resident_bytes() -> int; LocalPipeline.resident_bytes() -> int

How each format holds a model (what ``unit_param_bytes`` counts):

- ``float32`` / ``bfloat16`` / ``float16``: every tensor in that dtype;
  activations and the KV cache in the same dtype.
- ``int8``: the decoder's seven linear weights as int8 with one fp32 scale
  per output row; the embedding (and the head's matrix) as int8 with one fp32
  scale per vocabulary row; norms and biases in fp32. Activations and the KV
  cache stay **fp32** (the int8 products rescale into fp32).
- ``int4``: the decoder's linear weights as 4-bit integers packed two per
  byte with a scale and a minimum per group of 32 inputs (GGUF's Q4_1
  layout, ``w = d * q + m``), in torch's CPU int4 packing (rows padded to
  a multiple of 64) with a bf16 scale and zero point per group; the embedding and head as
  in ``int8``; norms and biases fp32; activations and KV cache **fp32**.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hetmesh.errors import ComputeError, InvalidRequest


class WeightFormat(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"
    INT4 = "int4"


NATIVE = "native"  # the default everywhere: the format the checkpoint stores its matrices in
WEIGHT_CHOICES: tuple[str, ...] = (NATIVE, "auto", *(f.value for f in WeightFormat))
FLOAT_FORMATS = frozenset({WeightFormat.FLOAT32, WeightFormat.BFLOAT16, WeightFormat.FLOAT16})
QUANTIZED_FORMATS = frozenset({WeightFormat.INT8, WeightFormat.INT4})
# Measured on this project's CPU (docs/weights.md, bench/weights.py): int8
# decodes at ~0.95x fp32, float16 prefills ~4x slower (emulated fp16 matmuls);
# bf16 and int4 (torch's bf16 int4 kernel) are faster than fp32.
SLOWER_THAN_FP32_ON_CPU = frozenset({WeightFormat.INT8, WeightFormat.FLOAT16})

INT4_GROUP = 32  # inputs per (scale, minimum) pair, as in GGUF's Q4_0/Q4_1
_INT4_GROUP_META_BYTES = 4  # bf16 scale + bf16 zero point (what torch's int4 kernel reads)
_INT4_ROW_BLOCK = 64  # torch's CPU int4 packing pads the rows to a multiple of 64
_ROW_SCALE_BYTES = 4  # one fp32 scale per output row (int8)
_FLOAT_WIDTH = {WeightFormat.FLOAT32: 4, WeightFormat.BFLOAT16: 2, WeightFormat.FLOAT16: 2}


def parse_weights(text: str | None) -> WeightFormat | None:
    """The format named by ``text``; ``None`` for ``"auto"`` (or no text).

    Raises ``InvalidRequest`` naming the choices for anything else, ``"native"``
    included: it names no format until a model folder is read
    (:func:`hetmesh.partition.checkpoint.settle_weights`).
    """
    if text is None:
        return None
    name = text.strip().lower()
    if name == "auto":
        return None
    if name == NATIVE:
        raise InvalidRequest("weights 'native' depend on the model: settle them on its folder")
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    name = aliases.get(name, name)
    try:
        return WeightFormat(name)
    except ValueError:
        raise InvalidRequest(
            f"unknown weight format {text!r}; choose one of {', '.join(WEIGHT_CHOICES)}"
        ) from None


def is_native(text: str | None) -> bool:
    """Whether ``text`` asks for the checkpoint's own format (the default)."""
    return text is not None and text.strip().lower() == NATIVE


def activation_dtype(fmt: WeightFormat) -> str:
    """The dtype of hidden states on a stage holding ``fmt`` weights."""
    if fmt in _FLOAT_WIDTH:
        return fmt.value
    return "float32"


def kv_dtype(fmt: WeightFormat) -> str:
    """The dtype of the KV cache on a stage holding ``fmt`` weights.

    Compact weights (int8, int4) keep their keys and values in float16, as
    llama.cpp does by default: half of fp32's bytes per cached token, which is
    what bounds sessions × context on a small machine. Attention still runs in
    fp32 (the cached keys and values are widened as they are read; fp16
    attention on CPUs measured 10x slower than fp32). Float formats keep their
    own dtype, so ``float32`` stays exact end to end. ``HETMESH_KV16=0`` keeps
    compact formats' cache in fp32 too (for comparisons).
    """
    if fmt in QUANTIZED_FORMATS and os.environ.get("HETMESH_KV16", "1") != "0":
        return "float16"
    return activation_dtype(fmt)


def format_of_dtype(dtype: Any) -> WeightFormat:
    """The float format of a torch dtype or dtype name (the deprecated ``dtype=`` alias)."""
    name = str(dtype).removeprefix("torch.")
    try:
        fmt = WeightFormat(name)
    except ValueError:
        raise InvalidRequest(
            f"unsupported dtype {name!r}; use float32, bfloat16 or float16"
        ) from None
    if fmt not in FLOAT_FORMATS:
        raise InvalidRequest(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return fmt


def linear_weight_bytes(out_features: int, in_features: int, fmt: WeightFormat) -> int:
    """Resident bytes of one decoder linear weight ``(out, in)`` in ``fmt``."""
    n = out_features * in_features
    if fmt in _FLOAT_WIDTH:
        return n * _FLOAT_WIDTH[fmt]
    if fmt is WeightFormat.INT8:
        return n + out_features * _ROW_SCALE_BYTES
    rows = -(-out_features // _INT4_ROW_BLOCK) * _INT4_ROW_BLOCK
    groups = rows * -(-in_features // INT4_GROUP)
    return rows * -(-in_features // 2) + groups * _INT4_GROUP_META_BYTES


_LINEAR_SHAPES = {  # (out, in) of each decoder matrix, in config terms
    "self_attn.q_proj": ("q", "hidden"),
    "self_attn.k_proj": ("kv", "hidden"),
    "self_attn.v_proj": ("kv", "hidden"),
    "self_attn.o_proj": ("hidden", "q"),
    "mlp.gate_proj": ("inter", "hidden"),
    "mlp.up_proj": ("inter", "hidden"),
    "mlp.down_proj": ("hidden", "inter"),
}


def stored_layout_bytes(
    config: Mapping[str, Any], fmt: WeightFormat
) -> tuple[int | None, dict[int, int]]:
    """How a K-quant file's layout (recorded in its converted ``config.json``) changes
    what ``fmt`` holds: ``(embedding bytes or None, extra bytes per decoder layer)``.

    An int4 stage holds a Q5_K/Q6_K matrix in int8 (more bytes than int4); a compact
    stage keeps a K-quant token table in its blocks (fewer than int8). Float formats
    and folders without the record: ``(None, {})``.
    """
    if fmt not in QUANTIZED_FORMATS:
        return None, {}
    table = config.get("hetmesh_table_block_bytes")
    extra: dict[int, int] = {}
    wide = config.get("hetmesh_int8_linears") or {}
    if fmt is WeightFormat.INT4 and isinstance(wide, Mapping):
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        sizes = {
            "hidden": int(config["hidden_size"]),
            "inter": int(config["intermediate_size"]),
            "q": heads * head_dim,
            "kv": int(config.get("num_key_value_heads") or heads) * head_dim,
        }
        for layer, names in wide.items():
            for name in names:
                if name in _LINEAR_SHAPES:
                    out, inp = (sizes[s] for s in _LINEAR_SHAPES[name])
                    more = linear_weight_bytes(out, inp, WeightFormat.INT8)
                    more -= linear_weight_bytes(out, inp, WeightFormat.INT4)
                    extra[int(layer)] = extra.get(int(layer), 0) + more
    return (int(table) if isinstance(table, int) else None), extra


def table_bytes(rows: int, width: int, fmt: WeightFormat) -> int:
    """Resident bytes of the embedding (or head) matrix ``(rows, width)`` in ``fmt``."""
    if fmt in _FLOAT_WIDTH:
        return rows * width * _FLOAT_WIDTH[fmt]
    return rows * width + rows * _ROW_SCALE_BYTES  # int8 per row in both int formats


def small_bytes(count: int, fmt: WeightFormat) -> int:
    """Norm weights and biases: the float dtype, or fp32 under an int format."""
    return count * _FLOAT_WIDTH.get(fmt, 4)


@dataclass(frozen=True, slots=True)
class UnitBytes:
    """Resident parameter bytes per unit kind for one model in one format."""

    embed: int
    block: int
    head: int  # final norm + head matrix (the head's own copy even when tied)
    kv_bytes_per_token_per_layer: int


def unit_param_bytes(config: Mapping[str, Any], fmt: WeightFormat) -> UnitBytes:
    """Bytes of the embedding, one decoder layer and the head as held in ``fmt``.

    ``config`` is a plain config mapping already checked by
    :func:`hetmesh.partition.profile.model_profile` (positive sizes).
    """
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    vocab = int(config["vocab_size"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    linears = [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out)]
    linears += [(inter, hidden), (inter, hidden), (hidden, inter)]
    block = sum(linear_weight_bytes(n, k, fmt) for n, k in linears)
    small = 2 * hidden  # the two norms
    if config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (
        config.get("architectures") or []
    ):
        small += q_out + 2 * kv_out
    elif config.get("attention_bias"):
        small += q_out + 2 * kv_out + hidden
    if config.get("model_type") == "qwen3" or "Qwen3ForCausalLM" in (
        config.get("architectures") or []
    ):
        small += 2 * head_dim  # RMS norms of q and k (one head's width each)
    if config.get("mlp_bias"):
        small += 2 * inter + hidden
    block += small_bytes(small, fmt)
    embed = table_bytes(vocab, hidden, fmt)
    head = table_bytes(vocab, hidden, fmt) + small_bytes(hidden, fmt)
    cached = _FLOAT_WIDTH[WeightFormat(kv_dtype(fmt))]
    return UnitBytes(
        embed=embed, block=block, head=head, kv_bytes_per_token_per_layer=2 * kv_out * cached
    )


def check_supported(fmt: WeightFormat, device: str) -> None:
    """Raise ``InvalidRequest`` if ``device`` has no kernel for ``fmt``.

    Called at node start-up, so a node refuses a format it cannot run before
    it joins the mesh instead of failing at its first request.
    """
    import torch

    kind = str(device).split(":", 1)[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise InvalidRequest(f"unknown device {device!r}")
    if fmt is WeightFormat.BFLOAT16 and kind == "mps" and not _mps_bf16():
        raise InvalidRequest("bfloat16 needs macOS 14 or later on mps; use float16 or float32")
    if fmt in QUANTIZED_FORMATS:
        if kind == "mps":
            raise InvalidRequest(f"no {fmt} kernel on mps; use float16 or float32")
        if kind == "cpu" and not hasattr(torch, "_int_mm"):
            raise InvalidRequest(f"this torch build has no int8 matmul for {fmt} on cpu")
    if fmt is WeightFormat.INT4:
        from hetmesh.partition.quant import int4_layout_name

        try:
            int4_layout_name()
        except ComputeError as exc:
            raise InvalidRequest(str(exc)) from exc


def auto_weights(device: str) -> WeightFormat:
    """``auto`` for one process (``hetmesh generate``): bf16 where it has native kernels.

    bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX (measured equal or
    faster than fp32 there, QUANT.md), fp32 elsewhere. A node decides by
    calibration instead (:mod:`hetmesh.node.weights`).
    """
    kind = str(device).split(":", 1)[0]
    if kind == "cuda":
        return WeightFormat.BFLOAT16
    if kind == "cpu" and cpu_has_bf16():
        return WeightFormat.BFLOAT16
    return WeightFormat.FLOAT32


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), per /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


BF16_HEAD_ENV = "HETMESH_BF16_INT8_HEAD"  # "0"/"1" overrides the CPU's flags (A/B runs)


def bf16_int8_head() -> bool:
    """Whether an int4 stage's int8 LM head takes bf16 activations on this CPU
    (``hetmesh.partition.quant``): where it multiplies bf16 natively. Read off its
    flags, never timed, so every process on a machine computes the same logits."""
    forced = os.environ.get(BF16_HEAD_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    return cpu_has_bf16()


def _mps_bf16() -> bool:
    import torch

    try:
        torch.zeros(1, dtype=torch.bfloat16, device="mps")
    except (RuntimeError, TypeError):
        return False
    return True


__all__ = [
    "BF16_HEAD_ENV",
    "FLOAT_FORMATS",
    "INT4_GROUP",
    "NATIVE",
    "QUANTIZED_FORMATS",
    "SLOWER_THAN_FP32_ON_CPU",
    "WEIGHT_CHOICES",
    "UnitBytes",
    "WeightFormat",
    "activation_dtype",
    "auto_weights",
    "bf16_int8_head",
    "check_supported",
    "format_of_dtype",
    "is_native",
    "kv_dtype",
    "parse_weights",
    "unit_param_bytes",
]
