"""K-quant GGUF files for tests: a numpy quantiser that follows GGUF's block layouts.

The ``gguf`` package can dequantise Q4_K, Q5_K and Q6_K but not quantise them,
so tests write their own blocks here (a plain min/max quantiser, not
llama.cpp's search for the best scales: any valid blocks do) and check every
read against ``gguf.quants.dequantize``. :func:`write_model_gguf` writes a
tiny Hugging Face model as a GGUF file in a Q4_K_M-like mix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

SUPER = 256


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block -> GGUF's 12 bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _scaled_groups(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's scales: per 32 inputs ``w = d*sc*q - dmin*m`` with q in 0..levels."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0.0)  # the minimum stored is -low >= 0
    scale = (sub.max(axis=2) - low) / levels
    d = scale.max(axis=1) / 63.0
    dmin = (-low).max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d32, dmin32 = d16.astype(np.float32), dmin16.astype(np.float32)
    safe_d = np.where(d32 > 0, d32, 1.0)[:, None]
    safe_m = np.where(dmin32 > 0, dmin32, 1.0)[:, None]
    sc = np.clip(np.round(scale / safe_d), 0, 63)
    mn = np.clip(np.round(-low / safe_m), 0, 63)
    step = (d32[:, None] * sc)[..., None]
    q = np.round((sub + (dmin32[:, None] * mn)[..., None]) / np.where(step > 0, step, 1.0))
    return d16, dmin16, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def _nibble_chunks(q4: np.ndarray) -> np.ndarray:
    """Eight sub-blocks of 32 4-bit values -> 128 bytes (sub-block 2c low, 2c+1 high)."""
    pairs = q4.reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``(rows, k)`` float -> Q4_K bytes ``(rows, k / 256 * 144)``."""
    rows = x.shape[0]
    d, dmin, sc, mn, q = _scaled_groups(x.astype(np.float32), 15)
    blocks = np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), _nibble_chunks(q)], axis=1
    )
    return blocks.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """``(rows, k)`` float -> Q5_K bytes ``(rows, k / 256 * 176)``."""
    rows = x.shape[0]
    d, dmin, sc, mn, q = _scaled_groups(x.astype(np.float32), 31)
    high = (q >> 4) & 1  # (n, 8, 32): bit j of byte i is sub-block j's input i
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    blocks = np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), qh, _nibble_chunks(q & 15)],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``(rows, k)`` float -> Q6_K bytes ``(rows, k / 256 * 210)``."""
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    peak = np.abs(sub).max(axis=2)
    scale = peak / 31.5
    d16 = (scale.max(axis=1) / 127.0).astype(np.float16)
    d = d16.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1.0)[:, None]), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(sub / np.where(step > 0, step, 1.0)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 inputs
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    h4 = high.reshape(-1, 2, 4, 32)
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(
        -1, 64
    )
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d16)], axis=1)
    return blocks.reshape(rows, -1)


QUANTISERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def more_bits(layer: int, layers: int) -> bool:
    """Which layers a Q4_K_M file keeps attn_v and ffn_down at Q6_K in (llama.cpp's rule)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_type(gguf_name: str, layers: int) -> str:
    """The type a Q4_K_M file gives a 2-D tensor: Q6_K for the head and some attn_v /
    ffn_down, Q4_K for the rest."""
    if gguf_name == "output.weight":
        return "Q6_K"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        return "Q6_K" if more_bits(int(parts[1]), layers) else "Q4_K"
    return "Q4_K"


_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, index, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_HF_TO_GGUF[part]}.{kind}"


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face q/k rows -> llama.cpp's interleaved rotary order."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> tuple[list[str], list[str]]:
    """A GPT-2 style byte-level vocabulary (specials first) and its merges."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return [*specials, *symbols, "Ġt", "he", "Ġthe"], ["Ġ t", "h e", "Ġt he"]


def write_model_gguf(
    model: Any,
    path: Path,
    *,
    types: dict[str, str] | None = None,
    arch: str = "llama",
    rope_freqs: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Write ``model`` (a tiny HF Llama or Qwen3, vocabulary of :func:`byte_tokens`) as a
    GGUF file. ``types`` maps GGUF tensor names to K-quant types (others: F32; default:
    :func:`q4_k_m_type` for every 2-D tensor). Returns the HF state dict as the file
    holds it (``gguf``'s dequantisation of each tensor, back in HF row order)."""
    import gguf

    config = model.config
    tokens, merges = byte_tokens()
    if config.vocab_size != len(tokens):
        raise ValueError(f"the model's vocabulary must be {len(tokens)} tokens")
    layers = config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    held: dict[str, np.ndarray] = {}
    for hf, tensor in model.state_dict().items():
        if "rotary_emb" in hf or (hf == "lm_head.weight" and config.tie_word_embeddings):
            continue
        name = gguf_name(hf)
        values = tensor.detach().float().numpy()
        unpermute = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            n_head = heads if ".attn_q." in name else kv_heads
            values = _llama_permute(values, n_head)
            unpermute = n_head
        kind = None
        if values.ndim == 2:
            kind = (types or {}).get(name) if types is not None else q4_k_m_type(name, layers)
        if kind is None:
            writer.add_tensor(name, values)
            stored = values
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            raw = QUANTISERS[kind](values)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype).reshape(values.shape)
        if unpermute is not None:  # the permutation is its own kind of inverse: undo it
            rows = stored.shape[0]
            stored = (
                stored.reshape(unpermute, rows // unpermute // 2, 2, -1)
                .swapaxes(1, 2)
                .reshape(stored.shape)
            )
        held[hf] = np.ascontiguousarray(stored, dtype=np.float32)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
