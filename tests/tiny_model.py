"""A tiny Llama with the default model's architecture and tokenizer, for mechanism tests.

Most multi-process tests exercise a mechanism — failover, admission, joins, the
secured CLI, the dashboard — not the default model's weights; running the real
135M model in fp32 in every node made them most of the suite's CPU time. This
model is a real ``LlamaForCausalLM`` (random, seeded weights) saved as
safetensors beside a copy of the default model's tokenizer files, so every
prompt, chat template and token id works as with the real model, and node
processes take it as ``--model PATH``. Compare what a mesh serving it returns
with its own single-process reference (``reference_ids(tiny_model_dir, ...)``).

- Same shape as SmolLM2 where the code cares (30 blocks: units 0..31, GQA,
  tied embeddings, its 49,152-word vocabulary), but 64 wide: a token costs
  microseconds of arithmetic, and weights load in a blink.
- Greedy output never ends early: the embedding rows of the tokenizer's special
  words (ids 0..16, end-of-sequence among them) are zero, so with tied
  embeddings their logits are 0 while the largest other logit is well above 0.
  A generation runs its full ``max_new_tokens``.
- Its output is not degenerate: linear weights at twice the usual scale make
  every block matter, so greedy text wanders through the vocabulary (120
  tokens, 120 different ids) rather than repeating one word, and a skipped or
  replayed-twice token shows. Its logits are wide (tens) with the two largest
  apart by far more than float32 rounding (a 30-step float64 check agreed), so
  a different split never flips a greedy choice.
- Memory: the KV is as wide as the real model's (4 KV heads of 64), so the
  blocks' share of memory is similar (the head's logits, a row of 49,152 words
  per session sampled at once, are small whatever the width):
  :data:`TINY_NODE_MEMORY` per node (with ``--max-sessions 4``) makes the
  planner split it in three as ``NODE_MEMORY`` (500 MiB) does the real model,
  two nodes being too few. ``running_mesh(..., model=tiny_model_dir)`` in
  tests/integration/node/mesh_nodes.py passes both.

Use the session fixture ``tiny_model_dir`` (tests/conftest.py); it is built once
into the hetmesh cache (``$HETMESH_HOME``) and reused by later runs and workers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

# bump when the recipe below changes: the cache holds one folder per version
VERSION = 3
NAME = f"tiny-llama-v{VERSION}"
HIDDEN = 64
TINY_NODE_MEMORY = "300MiB"
LAYERS = 30
LINEAR_SCALE = 2.0  # std x sqrt(fan_in) of every block's linear weights
SPECIAL_IDS = range(17)  # SmolLM2's special words: <|endoftext|>, <|im_start|>, <|im_end|>, ...
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_model_path(cache_dir: Path) -> Path:
    return cache_dir / "test-models" / NAME


def build_tiny_model(default_model_dir: Path, cache_dir: Path) -> Path:
    """The tiny model's folder under ``cache_dir``, made on first use (seeded: every
    builder writes the same bytes; a concurrent builder's finished folder is kept)."""
    target = tiny_model_path(cache_dir)
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = json.loads((default_model_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=int(source["vocab_size"]),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,  # KV as wide as the real model's (see the memory note above)
        max_position_embeddings=int(source["max_position_embeddings"]),
        rms_norm_eps=float(source["rms_norm_eps"]),
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        pad_token_id=source.get("pad_token_id"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.normal_(0.0, 1.0)
        embed[list(SPECIAL_IDS)] = 0.0
        for layer in model.model.layers:
            for linear in layer.modules():
                if isinstance(linear, torch.nn.Linear):
                    linear.weight.normal_(0.0, LINEAR_SCALE / math.sqrt(linear.in_features))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (default_model_dir / name).is_file():
                shutil.copyfile(default_model_dir / name, staging / name)
        with contextlib.suppress(OSError):  # another worker got there first: keep its copy
            os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
