"""A model's cost per unit, computed from its config alone (no weights loaded).

Units are, in order: the token embedding, each decoder layer, and the final
norm + LM head. The planner and the stage loader agree on these indices: a
stage ``[start, end)`` holds exactly ``units[start:end]``.

Pure: takes a plain config mapping (``config.json`` or ``config.to_dict()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetmesh.errors import UnsupportedModel
from hetmesh.partition.formats import (
    WeightFormat,
    activation_dtype,
    stored_layout_bytes,
    unit_param_bytes,
)
from hetmesh.resources import ModelProfile, UnitProfile

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Qwen2's layout without q/k/v biases, with q/k RMS norms
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKEN_ID_BYTES = 8  # int64 token ids cross the first and last boundaries


def architecture_of(config: Mapping[str, Any]) -> str:
    """The supported architecture name of ``config``, or ``UnsupportedModel``."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    model_type = config.get("model_type")
    for arch, kind in SUPPORTED_ARCHITECTURES.items():
        if model_type == kind:
            return arch
    shown = ", ".join(archs) or str(model_type)
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    raise UnsupportedModel(f"unsupported architecture {shown}; supported: {supported}")


def _require_int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModel(f"model config lacks a positive integer {key!r}")
    return value


def model_profile(
    config: Mapping[str, Any],
    *,
    dtype: str | None = None,
    name: str = "",
    weights: WeightFormat | str | None = None,
) -> ModelProfile:
    """Units, parameter bytes, FLOPs, KV and boundary bytes for ``config``.

    ``weights`` is the format the units are held in (a :class:`WeightFormat`
    or its name); parameter bytes are those resident in that format, and the
    profile's ``dtype`` is the format's activation dtype (fp32 for int8 and
    int4, whose KV cache is fp16: see :mod:`hetmesh.partition.formats`).
    ``dtype`` is the older spelling for the float formats and is kept for
    callers not yet migrated; without either the model is profiled in float32.
    """
    if weights is not None and dtype is not None:
        raise ValueError("pass weights= or dtype=, not both")
    if weights is None:
        weights = dtype or "float32"
        if weights not in DTYPE_BYTES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    try:
        fmt = WeightFormat(weights)
    except ValueError:
        raise ValueError(f"unsupported weight format {weights!r}") from None
    dtype = activation_dtype(fmt)
    arch = architecture_of(config)
    kind = SUPPORTED_ARCHITECTURES[arch]
    hidden = _require_int(config, "hidden_size")
    inter = _require_int(config, "intermediate_size")
    layers = _require_int(config, "num_hidden_layers")
    heads = _require_int(config, "num_attention_heads")
    vocab = _require_int(config, "vocab_size")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    max_context = int(config.get("max_position_embeddings") or 2048)
    tied = bool(config.get("tie_word_embeddings", False))
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    width = DTYPE_BYTES[dtype]
    held = unit_param_bytes(config, fmt)
    table_held, layer_extra = stored_layout_bytes(config, fmt)  # K-quant files' layout

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn_weights = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if kind == "qwen2":
        attn_bias_params = q_out + 2 * kv_out  # q, k, v carry a bias; o does not
    elif attention_bias:
        attn_bias_params = q_out + 2 * kv_out + hidden
    else:
        attn_bias_params = 0
    mlp_weights = 3 * hidden * inter
    mlp_bias_params = (2 * inter + hidden) if mlp_bias else 0
    norms = 2 * hidden + (2 * head_dim if kind == "qwen3" else 0)  # Qwen3's q/k norms
    layer_params = attn_weights + attn_bias_params + mlp_weights + mlp_bias_params + norms
    layer_matmul_params = attn_weights + mlp_weights
    embed_params = vocab * hidden
    boundary = hidden * width

    units = [
        UnitProfile(
            kind="embed",
            index=0,
            param_count=embed_params,
            param_bytes=held.embed if table_held is None else table_held,
            flops_per_token=0.0,
            attention_flops_per_token_per_context=0.0,
            kv_bytes_per_token=0,
            input_bytes_per_token=TOKEN_ID_BYTES,
            output_bytes_per_token=boundary,
        )
    ]
    for i in range(layers):
        units.append(
            UnitProfile(
                kind="block",
                index=i + 1,
                param_count=layer_params,
                param_bytes=held.block + layer_extra.get(i, 0),
                flops_per_token=2.0 * layer_matmul_params,
                # q·k and attention·v, each 2 FLOPs per multiply-add, every head
                attention_flops_per_token_per_context=4.0 * heads * head_dim,
                kv_bytes_per_token=held.kv_bytes_per_token_per_layer,
                input_bytes_per_token=boundary,
                output_bytes_per_token=boundary,
            )
        )
    # The head holds the final norm and the LM head matrix; with tied embeddings
    # that matrix is the embedding's, which a stage holding the head must load.
    head_params = hidden + vocab * hidden
    units.append(
        UnitProfile(
            kind="head",
            index=layers + 1,
            param_count=head_params,
            param_bytes=held.head,
            flops_per_token=2.0 * vocab * hidden,
            attention_flops_per_token_per_context=0.0,
            kv_bytes_per_token=0,
            input_bytes_per_token=boundary,
            output_bytes_per_token=TOKEN_ID_BYTES,
        )
    )
    return ModelProfile(
        name=name or str(config.get("_name_or_path") or arch),
        architecture=arch,
        dtype=dtype,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=layers,
        max_context=max_context,
        tie_word_embeddings=tied,
        units=tuple(units),
    )


def llama_like_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    vocab_size: int,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
) -> dict[str, Any]:
    """A Llama config mapping, for planning against model shapes without files."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
    }


# Shapes of well-known Llama-family models, for benchmarks and `hetmesh plan`.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": llama_like_config(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama-7b": llama_like_config(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "llama-13b": llama_like_config(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
    ),
    "llama-70b": llama_like_config(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
}
