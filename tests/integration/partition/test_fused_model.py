"""The default model with fused projections: the same logits, bit for bit, as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = "The capital of France is"
# bench/decode.py checks 64 tokens on every run; the suite keeps this short
TOKENS = {"float32": 32, "int4": 16}


def _pipeline(model_dir: Path, fmt: str, fuse: bool) -> LocalPipeline:
    stage = load_stage(model_dir, 0, 32, weights=fmt, fuse=fuse)
    assert stage.fused is fuse
    return LocalPipeline([stage], model_dir=model_dir)


def _greedy_logits(pipeline: LocalPipeline, prompt: str, steps: int) -> list[torch.Tensor]:
    """The last-token logits of a prefill and ``steps - 1`` greedy decode steps."""
    session = pipeline.new_session(SamplingParams(max_new_tokens=steps))
    x = torch.tensor(pipeline.tokenizer.encode(prompt), dtype=torch.int64)
    logits = []
    try:
        for _ in range(steps):
            out = pipeline.forward(x, session.kvs, last_only=True)  # (1, vocab)
            logits.append(out[-1].clone())
            x = torch.tensor([int(out[-1].argmax())])
    finally:
        session.free()
    return logits


@pytest.mark.parametrize("fmt", list(TOKENS))
def test_fused_default_model_matches_separate_products(default_model_dir: Path, fmt: str) -> None:
    separate = _pipeline(default_model_dir, fmt, fuse=False)
    fused = _pipeline(default_model_dir, fmt, fuse=True)
    expected = _greedy_logits(separate, PROMPT, TOKENS[fmt])
    got = _greedy_logits(fused, PROMPT, TOKENS[fmt])
    assert len(got) == TOKENS[fmt]
    # token equality follows; bit-identical logits are the stronger claim
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"{fmt}: logits differ at step {step}"
