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


def write_tiny_gguf(path: Path, *, seed: int = 0, qtype: str = "F32") -> None:
    """A random 2-layer Llama GGUF with a small byte-level BPE tokenizer.

    ``qtype`` (a GGUF type the ``gguf`` package can quantize to, e.g. Q4_1 or
    Q8_0) is applied to the layers' matrices; norms and the tables stay F32.
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv_heads, head_dim = 64, 96, 2, 4, 2, 16
    # GPT-2 style byte symbols: printable bytes stand for themselves, others shift past 255
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *symbols, "Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def tensor(name: str, *shape: int) -> None:
        values = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if qtype == "F32" or len(shape) == 1 or not name.startswith("blk."):
            writer.add_tensor(name, values)
            return
        kind = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def count_calls(monkeypatch: Any, module: Any, name: str) -> list[int]:
    """Wrap ``module.name`` (for the test's duration) so that the returned list grows by
    one at each call: which path a stage took."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def tensor_bytes(stage: Any) -> int:
    """A stage's ``resident_bytes()`` less its rotary tables and its int head's packed
    copy: the bytes its profile charges (``range_param_bytes``); the pack is charged
    apart (``WeightBytes.head_pack_bytes``)."""
    from hetmesh.partition.quant import Int8Linear

    rotary = sum(b.nbytes for b in stage.rotary_emb.buffers()) if stage.rotary_emb else 0
    head = stage.lm_head
    pack = head.packed_bytes() if isinstance(head, Int8Linear) else 0
    return int(stage.resident_bytes()) - rotary - pack
