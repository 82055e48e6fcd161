"""ModelProfile from a config alone, against hand computations and real models."""

from __future__ import annotations

from typing import Any

import pytest

from hetmesh.errors import UnsupportedModel
from hetmesh.partition.profile import KNOWN_SHAPES, model_profile

# hidden 8, intermediate 12, 2 layers, 2 heads of 4 dims, 1 KV head, vocab 10
BASE: dict[str, Any] = {
    "hidden_size": 8,
    "intermediate_size": 12,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 10,
    "max_position_embeddings": 64,
}
# by hand: embed 10*8 = 80; layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, mlp 3*8*12 = 288,
# two norms 16 -> 496 (Qwen2 adds q/k/v biases 8 + 4 + 4 -> 512); head: norm 8 + 10*8 = 88.
TABLE = [
    # (architecture, model_type, tied, layer params, total params)
    ("LlamaForCausalLM", "llama", False, 496, 80 + 2 * 496 + 88),
    ("LlamaForCausalLM", "llama", True, 496, 2 * 496 + 88),
    ("MistralForCausalLM", "mistral", False, 496, 80 + 2 * 496 + 88),
    ("Qwen2ForCausalLM", "qwen2", False, 512, 80 + 2 * 512 + 88),
    ("Qwen2ForCausalLM", "qwen2", True, 512, 2 * 512 + 88),
]


def _config(arch: str, model_type: str, tied: bool) -> dict[str, Any]:
    return {**BASE, "architectures": [arch], "model_type": model_type, "tie_word_embeddings": tied}


@pytest.mark.parametrize(("arch", "model_type", "tied", "layer", "total"), TABLE)
def test_profile_matches_hand_computation(
    arch: str, model_type: str, tied: bool, layer: int, total: int
) -> None:
    profile = model_profile(_config(arch, model_type, tied))
    assert [u.kind for u in profile.units] == ["embed", "block", "block", "head"]
    assert [u.param_count for u in profile.units] == [80, layer, layer, 88]
    assert profile.total_param_count == total
    assert profile.range_param_count(0, 1) == 80
    assert profile.range_param_count(3, 4) == 88  # a head stage loads the (tied) matrix
    assert profile.range_param_count(1, 3) == 2 * layer
    block = profile.units[1]
    assert block.flops_per_token == 2 * (192 + 288)
    assert block.attention_flops_per_token_per_context == 4 * 2 * 4
    assert block.kv_bytes_per_token == 2 * 4 * 4  # K and V, one head of 4 fp32
    assert block.decode_flops(10) == 960 + 10 * 32
    assert profile.units[0].output_bytes_per_token == 8 * 4
    assert profile.range_kv_bytes_per_token(0, 4) == 2 * 32


def test_profile_dtype_changes_bytes_not_counts() -> None:
    fp32 = model_profile(_config("LlamaForCausalLM", "llama", False))
    bf16 = model_profile(_config("LlamaForCausalLM", "llama", False), dtype="bfloat16")
    assert bf16.total_param_count == fp32.total_param_count
    assert bf16.total_param_bytes * 2 == fp32.total_param_bytes
    assert bf16.units[1].kv_bytes_per_token * 2 == fp32.units[1].kv_bytes_per_token


@pytest.mark.parametrize(("arch", "model_type", "tied", "layer", "total"), TABLE)
def test_profile_total_matches_real_transformers_model(
    arch: str, model_type: str, tied: bool, layer: int, total: int
) -> None:
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **BASE, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    assert real == total


def test_smollm2_total_parameters() -> None:
    assert model_profile(KNOWN_SHAPES["smollm2-135m"]).total_param_count == 134_515_008


def test_profile_rejects_unsupported_and_incomplete_configs() -> None:
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        model_profile({**BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(UnsupportedModel, match="hidden_size"):
        model_profile({**_config("LlamaForCausalLM", "llama", False), "hidden_size": 0})
    with pytest.raises(ValueError, match="dtype"):
        model_profile(_config("LlamaForCausalLM", "llama", False), dtype="int3")
    profile = model_profile(_config("LlamaForCausalLM", "llama", False))
    with pytest.raises(ValueError, match="outside"):
        profile.range_param_count(2, 2)
