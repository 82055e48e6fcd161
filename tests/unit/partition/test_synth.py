"""Synth checkpoints' pure parts: names, shapes, seeded values, quantised pieces."""

from __future__ import annotations

import numpy as np
import pytest

from hetmesh.errors import ModelNotFound
from hetmesh.partition.profile import model_profile
from hetmesh.partition.synth import (
    SHAPES,
    SPECIAL_IDS,
    VOCAB_SIZE,
    SynthFormat,
    SynthSpec,
    compact_pieces,
    draw,
    gguf_blocks,
    parse_synth_name,
    row_chunks,
    stored_bytes,
    synth_config,
    tensor_plans,
)
from hetmesh.partition.synth_write import gguf_name


@pytest.mark.parametrize(
    ("name", "shape", "fmt", "seed"),
    [
        ("synth-llama-3.2-1b", "synth-llama-3.2-1b", "q4_1", 0),
        ("synth-llama-3.1-8b-bf16", "synth-llama-3.1-8b", "bf16", 0),
        ("synth-qwen2.5-7b-q8_0-seed7", "synth-qwen2.5-7b", "q8_0", 7),
        ("synth-llama-3.2-3b-seed12", "synth-llama-3.2-3b", "q4_1", 12),
        ("synth-tiny-qwen2", "synth-tiny-qwen2", "q4_1", 0),
        ("synth-tiny-qwen2-bf16", "synth-tiny-qwen2", "bf16", 0),
    ],
)
def test_a_name_spells_shape_format_and_seed(name: str, shape: str, fmt: str, seed: int) -> None:
    spec = parse_synth_name(name)
    assert (spec.shape.name, spec.fmt.value, spec.seed) == (shape, fmt, seed)
    assert spec.name == name  # and back: the folder's name is the model's name


@pytest.mark.parametrize(
    "name", ["synth-llama-70b", "synth-", "synth-tiny-q5_0", "synth-tiny-seed"]
)
def test_an_unknown_synth_name_lists_the_shapes(name: str) -> None:
    with pytest.raises(ModelNotFound, match=r"synth-llama-3\.1-8b"):
        parse_synth_name(name)


# (hidden, layers, heads, kv heads, head dim, MLP width, rope theta, tied): the real configs
REAL = {
    "synth-llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 500_000.0, True),
    "synth-llama-3.2-3b": (3072, 28, 24, 8, 128, 8192, 500_000.0, True),
    "synth-llama-3.1-8b": (4096, 32, 32, 8, 128, 14_336, 500_000.0, False),
    "synth-qwen2.5-7b": (3584, 28, 28, 4, 128, 18_944, 1_000_000.0, False),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_shapes_keep_the_real_dimensions_and_the_default_vocabulary(name: str) -> None:
    config = synth_config(SHAPES[name])
    got = tuple(
        config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "rope_theta",
            "tie_word_embeddings",
        )
    )
    assert got == REAL[name]
    assert config["vocab_size"] == VOCAB_SIZE == 49_152
    if "llama" in name:
        assert config["rope_scaling"]["rope_type"] == "llama3"
    # every tensor a model of that architecture has, and nothing else
    plans = tensor_plans(SynthSpec(SHAPES[name], SynthFormat.BF16))
    profile = model_profile(config, weights="bfloat16")
    assert sum(p.elements for p in plans) == sum(u.param_count for u in profile.units) - (
        VOCAB_SIZE * config["hidden_size"] if config["tie_word_embeddings"] else 0
    )


def test_sizes_are_those_of_the_real_models_less_their_vocabulary() -> None:
    gb = 1e9
    # Llama 3.1 8B: 8.03e9 parameters, 7.5e9 with a 49,152-word vocabulary
    assert 14.5 * gb < stored_bytes(parse_synth_name("synth-llama-3.1-8b-bf16")) < 15.5 * gb
    assert 4.5 * gb < stored_bytes(parse_synth_name("synth-llama-3.1-8b")) < 5.0 * gb
    assert 7.5 * gb < stored_bytes(parse_synth_name("synth-llama-3.1-8b-q8_0")) < 8.5 * gb
    # Llama 3.2 1B: 1.24e9 parameters, 1.07e9 here (tied)
    assert 0.65 * gb < stored_bytes(parse_synth_name("synth-llama-3.2-1b")) < 0.8 * gb


def test_values_are_a_function_of_seed_name_and_rows_only() -> None:
    spec = parse_synth_name("synth-tiny")
    plans = {p.name: p for p in tensor_plans(spec)}
    q = plans["model.layers.1.self_attn.q_proj.weight"]
    k = plans["model.layers.1.self_attn.k_proj.weight"]
    first = draw(0, q, 0, q.shape[0])
    draw(0, k, 0, k.shape[0])  # drawing another tensor between changes nothing
    assert np.array_equal(first, draw(0, q, 0, q.shape[0]))
    assert not np.array_equal(first, draw(1, q, 0, q.shape[0]))
    assert not np.array_equal(first[: k.shape[0]], draw(0, k, 0, k.shape[0]))
    assert abs(float(first.std()) - q.std) < 0.1 * q.std
    assert np.all(draw(0, plans["model.norm.weight"], 0, 64) == 1.0)


def test_large_tables_are_drawn_in_chunks_and_the_heads_special_rows_are_zero() -> None:
    spec = parse_synth_name("synth-llama-3.1-8b")
    plans = {p.name: p for p in tensor_plans(spec)}
    head = plans["lm_head.weight"]
    chunks = list(row_chunks(head))
    assert len(chunks) > 1
    assert chunks[0][0] == 0
    assert chunks[-1][1] == VOCAB_SIZE
    assert max((b - a) * head.shape[1] for a, b in chunks) <= 1 << 22
    rows = draw(0, head, *chunks[0])
    assert np.all(rows[:SPECIAL_IDS] == 0)
    assert np.all(rows[SPECIAL_IDS:].any(axis=1))
    assert plans["model.embed_tokens.weight"].zero_rows == 0  # untied: the input rows stay


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16", "f32"])
def test_compact_pieces_dequantise_to_the_drawn_values(kind: str) -> None:
    rng = np.random.default_rng(0)
    values = rng.uniform(-0.1, 0.1, size=(8, 64)).astype(np.float32)
    pieces = compact_pieces(kind, gguf_blocks(kind, values))  # type: ignore[arg-type]
    if kind == "q4_1":
        qs = pieces[".q4_1.qs"].reshape(8, 2, 16)  # a block's inputs 0..15 low, 16..31 high
        q = np.concatenate([qs & 0xF, qs >> 4], axis=2)
        d = pieces[".q4_1.d"].astype(np.float32)[..., None]
        m = pieces[".q4_1.m"].astype(np.float32)[..., None]
        back = (q * d + m).reshape(8, 64)
        tolerance = 0.2 / 15
    elif kind == "q8_0":
        d = pieces[".q8_0.d"].astype(np.float32)
        back = (pieces[".q8_0.qs"].reshape(8, 2, 32) * d[..., None]).reshape(8, 64)
        tolerance = 0.1 / 127
    elif kind == "bf16":
        back = (pieces[""].astype(np.uint32) << 16).view(np.float32)
        tolerance = 0.1 / 128
    else:
        back, tolerance = pieces[""], 0.0
    assert np.abs(back - values).max() <= tolerance


def test_gguf_names_are_llama_cpp_s() -> None:
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    assert gguf_name("model.layers.12.mlp.down_proj.weight") == "blk.12.ffn_down.weight"
    assert gguf_name("model.layers.0.self_attn.k_proj.bias") == "blk.0.attn_k.bias"
