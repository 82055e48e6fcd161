"""Stages of the real SmolLM2-135M-Instruct reproduce the full transformers model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.profile import model_profile
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import StageModule, load_stage
from hetmesh.partition.text import TextStream, encode_prompt, load_tokenizer

pytestmark = [pytest.mark.model, pytest.mark.slow]

ATOL = 1e-4
# the transformers reference holds the dequantised fp32 weights: the stages do too
FP32 = "float32"
STEPS = 20
# 32 units: 0 embedding, 1..30 decoder layers, 31 norm + head
SPLITS = {
    "1": [(0, 32)],
    "2": [(0, 16), (16, 32)],
    "3-uneven": [(0, 5), (5, 23), (23, 32)],
    "5-embed-only-head-only": [(0, 1), (1, 11), (11, 21), (21, 31), (31, 32)],
}
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "and listening to the waves below, until one stormy night in late November, when a "
    "small boat appeared near the rocks and"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> torch.Tensor:
    ids = torch.tensor(encode_prompt(tokenizer, PROMPT))
    assert ids.shape[0] >= 32
    return ids


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, prompt_ids: torch.Tensor) -> dict[str, Any]:
    """The full model's prefill logits, greedy tokens and per-step logits (with cache)."""
    import transformers

    from hetmesh.partition.checkpoint import float_state_dict

    # transformers' own model holding the folder's weights dequantised to fp32
    # (the compact folder keeps GGUF blocks, which transformers cannot read)
    config = transformers.AutoConfig.from_pretrained(str(default_model_dir))
    config._attn_implementation = "sdpa"
    full = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = full.load_state_dict(float_state_dict(default_model_dir), strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    full.tie_weights()
    full.eval()
    with torch.no_grad():
        generated = full.generate(
            prompt_ids[None],
            attention_mask=torch.ones_like(prompt_ids)[None],
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
        )[0, prompt_ids.shape[0] :].tolist()
        out = full(prompt_ids[None], use_cache=True)
        cache, prefill, steps = out.past_key_values, out.logits[0], []
        for token in generated:
            out = full(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1])
    assert prefill[-1].argmax() == generated[0]
    return {"prefill": prefill, "tokens": generated, "steps": steps}


def _chain(stages: list[StageModule], kvs: list[Any], x: torch.Tensor) -> torch.Tensor:
    for stage, kv in zip(stages, kvs, strict=True):
        x = stage.forward(x, kv)
    return x


@pytest.mark.parametrize("split", list(SPLITS))
def test_smollm2_stages_match_full_model(
    default_model_dir: Path, prompt_ids: torch.Tensor, reference: dict[str, Any], split: str
) -> None:
    stages = [load_stage(default_model_dir, a, b, weights=FP32) for a, b in SPLITS[split]]
    kvs = [s.new_kv() for s in stages]
    logits = _chain(stages, kvs, prompt_ids)
    torch.testing.assert_close(logits, reference["prefill"], atol=ATOL, rtol=0)
    greedy = [int(logits[-1].argmax())]
    # feed the reference's tokens: step i's logits must match, and their argmax
    # must be the token transformers' generate chose next
    for i, token in enumerate(reference["tokens"]):
        out = _chain(stages, kvs, torch.tensor([token]))[-1]
        torch.testing.assert_close(out, reference["steps"][i], atol=ATOL, rtol=0)
        greedy.append(int(out.argmax()))
    assert greedy[:STEPS] == reference["tokens"]
    for stage in stages:
        assert stage.param_count() == stage.profile.range_param_count(stage.start, stage.end)


def test_smollm2_local_pipeline_greedy_equals_generate(
    default_model_dir: Path, prompt_ids: torch.Tensor, reference: dict[str, Any]
) -> None:
    pipeline = LocalPipeline.load(default_model_dir, 3, weights=FP32)
    params = SamplingParams(max_new_tokens=STEPS)
    assert (
        list(pipeline.generate_ids(prompt_ids.tolist(), params, eos_ids=set()))
        == reference["tokens"]
    )


def test_smollm2_seeded_sampling_is_reproducible_across_splits(
    default_model_dir: Path, prompt_ids: torch.Tensor
) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=5)
    one = LocalPipeline.load(default_model_dir, 1, weights=FP32)
    two = LocalPipeline.load(default_model_dir, 2, weights=FP32)
    first = list(one.generate_ids(prompt_ids.tolist(), params))
    assert first
    text = "".join(two.generate_text(prompt_ids.tolist(), params))
    assert text == one.tokenizer.decode(first, skip_special_tokens=True)


def test_smollm2_forward_batch_matches_separate_forwards(
    default_model_dir: Path, prompt_ids: torch.Tensor
) -> None:
    """Four sessions at KV lengths 0, 3, 12, 33 mixing prefill chunks and decode steps."""
    first, middle, last = (
        load_stage(default_model_dir, 0, 9, weights=FP32),
        load_stage(default_model_dir, 9, 24, weights=FP32),
        load_stage(default_model_dir, 24, 32, weights=FP32),
    )
    plans = [(0, 7), (3, 1), (12, 5), (33, 1)]  # (history, new tokens)
    ids = torch.cat([prompt_ids, prompt_ids])
    solo, batch = [], []
    for history, new in plans:
        pair = []
        for _ in range(2):
            kvs = [s.new_kv() for s in (first, middle, last)]
            if history:
                _chain([first, middle, last], kvs, ids[:history])
            pair.append((first.forward(ids[history : history + new], kvs[0]), kvs))
        hidden, kvs = pair[0]
        solo.append(last.forward(middle.forward(hidden, kvs[1]), kvs[2]))
        batch.append(pair[1])
    mids = middle.forward_batch([(hidden, kvs[1]) for hidden, kvs in batch])
    outs = last.forward_batch([(m, kvs[2]) for m, (_, kvs) in zip(mids, batch, strict=True)])
    for got, want in zip(outs, solo, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    lasts = last.forward_batch([(torch.randn(2, 576), kvs[2]) for _, kvs in batch], last_only=True)
    assert [tuple(t.shape) for t in lasts] == [(1, 49152)] * 4


def test_smollm2_profile_total(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    profile = model_profile(config)
    assert profile.total_param_count == 134_515_008
    assert load_stage(default_model_dir, 0, 32, weights=FP32).param_count() == 134_515_008


_RSS_SCRIPT = """
import sys, torch, transformers
import transformers.models.llama.modeling_llama
from hetmesh.partition.stage import load_stage

def peak_rss():  # VmHWM: this process's own high-water mark (ru_maxrss is inherited on exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")

before = peak_rss()
start, end = int(sys.argv[2]), int(sys.argv[3])
stage = load_stage(sys.argv[1], start, end, weights="float32")
x = torch.arange(16) + 100 if start == 0 else torch.randn(16, 576)
stage.forward(x, stage.new_kv())
print(peak_rss() - before)
"""


def _peak_rss_increase(model_dir: Path, start: int, end: int) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(model_dir), str(start), str(end)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_smollm2_third_stage_costs_under_half_the_memory(default_model_dir: Path) -> None:
    full = _peak_rss_increase(default_model_dir, 0, 32)
    third = _peak_rss_increase(default_model_dir, 11, 21)  # 10 of 30 layers
    assert full > 400 * 2**20  # the fp32 weights alone are 538 MB
    assert third < full / 2, (third, full)


def test_text_stream_never_splits_a_character(tokenizer: Any) -> None:
    text = "Café au lait ☕, naïve façade — 日本語のテキスト 🌊🐚 ok."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer)
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens held back a partial character
