"""Deterministic reproductions of issue 44: one row's logits, computed in the call
shapes a stage really makes, must be bit-identical. Shared by the tiny-model tests
and the default model's (tests/integration/partition/test_exact_model.py)."""

from __future__ import annotations

import torch

from hetmesh.partition.stage import StageModule


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g)


def whole_and_chunked(stage: StageModule, n: int, cuts: list[int]) -> tuple[torch.Tensor, ...]:
    """A prompt's logits prefilled whole, and prefilled in chunks of ``cuts``."""
    prompt = _ids(n, 1, stage.vocab_size)
    whole = stage.forward(prompt, stage.new_kv())
    kv = stage.new_kv()
    chunked = torch.cat([stage.forward(c, kv) for c in torch.split(prompt, cuts)])
    return whole, chunked


def alone_and_in_a_round(stage: StageModule, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """The first session's decode step alone, and in one round with sessions of
    ``lengths[1:]`` tokens (one pool, padded to the longest), and beside another
    session's prefill chunk (two padding groups)."""
    prompts = [_ids(n, 10 + i, stage.vocab_size) for i, n in enumerate(lengths)]
    token = torch.tensor([7])
    kv = stage.new_kv()
    stage.forward(prompts[0], kv)
    alone = stage.forward(token, kv)
    pool = stage.new_pool(2 * sum(n // 16 + 2 for n in lengths) + 8)
    kvs = [stage.new_kv(pool) for _ in prompts]
    for prompt, session in zip(prompts, kvs, strict=True):
        stage.forward(prompt, session)
    rounded = stage.forward_batch([(token, session) for session in kvs])[0]
    fresh, other = stage.new_kv(pool), stage.new_kv(pool)
    stage.forward(prompts[0], fresh)
    beside = stage.forward_batch([(token, fresh), (prompts[1][:5], other)])[0]
    kv2 = stage.new_kv()
    stage.forward(prompts[0], kv2)
    stage.forward(token, kv2)
    again = stage.forward(token, kv2)
    return alone, rounded, beside, again


def decoded_and_replayed(stage: StageModule, prompt_n: int, steps: int) -> tuple[torch.Tensor, ...]:
    """Greedy logits of ``steps`` decode steps after a prompt, and the same positions'
    logits when prompt + generated tokens are replayed as one prefill (then as chunks)."""
    prompt = _ids(prompt_n, 3, stage.vocab_size)
    kv = stage.new_kv()
    logits = [stage.forward(prompt, kv)[-1:]]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(stage.forward(torch.tensor(tokens[-1:]), kv))
    history = torch.cat([prompt, torch.tensor(tokens)])
    replayed = stage.forward(history, stage.new_kv())[prompt_n - 1 :]
    kv = stage.new_kv()
    cuts = [prompt_n // 2, history.shape[0] - prompt_n // 2]
    chunked = torch.cat([stage.forward(c, kv) for c in torch.split(history, cuts)])
    return torch.cat(logits), replayed, chunked[prompt_n - 1 :]
