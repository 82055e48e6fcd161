"""Seeded random tiny models of each supported family, saved as real HF folders.

Their text is gibberish; they prove equivalence and plumbing, never quality.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 96
EOS = 3

FAMILIES = ("llama-tied", "llama-untied", "qwen2", "mistral-window")


def tiny_config(family: str) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "eos_token_id": EOS,
        "bos_token_id": 1,
        "pad_token_id": 0,
    }
    if family == "llama-tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "llama-untied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "mistral-window":
        # a window shorter than the prefill: the stage's own mask must apply it
        return transformers.MistralConfig(**common, sliding_window=12, tie_word_embeddings=False)
    raise ValueError(family)


def save_tiny(family: str, folder: Path, *, seed: int = 0) -> Any:
    """Build the seeded model, save it to ``folder`` and return it (eval, fp32)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: sharper logits
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(str(folder))
    return model


def reference_logits(
    model: Any, prompt: torch.Tensor, steps: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The full model's prefill logits and each decode step's logits (with its cache)."""
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        cache = out.past_key_values
        prefill = out.logits[0]
        decoded = []
        for token in steps:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            decoded.append(out.logits[0, -1])
    return prefill, decoded


def greedy_reference(model: Any, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate``, without the end-of-sequence token."""
    with torch.no_grad():
        out = model.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
        )
    tokens = [int(t) for t in out[0, prompt.shape[0] :]]
    if tokens and tokens[-1] == model.config.eos_token_id:
        tokens.pop()
    return tokens
