"""Lean decoder layers (hetmesh.partition.lean) give the stage's outputs bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition import stage as stage_module
from hetmesh.partition.lean import DECODE_ENV, LEAN_ENV, decode_default, lean_default, supports
from hetmesh.partition.stage import StageModule, load_stage
from tests.unit.partition.tiny_models import FAMILIES, VOCAB, count_calls, save_tiny

FORMATS = ("float32", "bfloat16", "int8", "int4")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"lean-{request.param}")
    model = save_tiny(request.param, folder)
    with torch.no_grad():  # qwen2's q/k/v biases: nonzero, so their path is checked
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    return folder


def _run(
    stage: StageModule, lean: bool, prompts: list[torch.Tensor], steps: int
) -> list[torch.Tensor]:
    """Prefill sessions (one whole, one in two chunks, one together with another), then
    decode them alone and in rounds; every output in order."""
    stage.lean = lean
    kvs = [stage.new_kv() for _ in prompts]
    outputs = [stage.forward(prompts[0], kvs[0])]
    outputs += [stage.forward(prompts[1][:5], kvs[1]), stage.forward(prompts[1][5:], kvs[1])]
    outputs += stage.forward_batch([(prompts[2], kvs[2]), (prompts[3], kvs[3])])
    tokens = [int(out[-1].argmax()) for out in (outputs[0], outputs[2], outputs[3], outputs[4])]
    for step in range(steps):
        rows = range(len(kvs)) if step % 2 else [step % len(kvs)]  # alone, then a round
        batch = [(torch.tensor([tokens[i]]), kvs[i]) for i in rows]
        for i, out in zip(rows, stage.forward_batch(batch), strict=True):
            outputs.append(out)
            tokens[i] = int(out[-1].argmax())
    return outputs


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_layers_outputs_bit_identical(tiny_dir: Path, fmt: str) -> None:
    stage = load_stage(tiny_dir, 0, 6, weights=fmt)
    assert stage.lean  # every tiny family's layers are supported, on by default
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (19, 11, 7, 14)]
    expected = _run(stage, False, prompts, steps=8)
    got = _run(stage, True, prompts, steps=8)
    assert len(got) == len(expected) == 5 + 4 + 4 * 4
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_lean_decode_takes_lone_int4_decode_tokens_bit_identical(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    # (a fused group's path, q and k roped as one: the default model's test, tiny
    # widths do not fuse in int4)
    stage = load_stage(tiny_dir, 0, 6, weights="int4")
    assert stage.lean
    assert stage.lean_decode
    calls = count_calls(monkeypatch, stage_module, "lean_decode")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (19, 11, 7, 14)]
    stage.lean_decode = False
    expected = _run(stage, False, prompts, steps=8)
    lean_layers = _run(stage, True, prompts, steps=8)
    assert not calls
    stage.lean_decode = True
    got = _run(stage, True, prompts, steps=8)
    # the four lone decode steps, each through every layer (rounds and prefills: lean_layer)
    assert len(calls) == 4 * stage.num_layers > 0
    for a, b, c in zip(got, lean_layers, expected, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_lean_middle_stage_hidden_states_bit_identical(tiny_dir: Path) -> None:
    stage = load_stage(tiny_dir, 1, 4, weights="int4")  # layers only: hidden states out
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    outs = []
    for lean in (False, True):
        stage.lean = lean
        kv = stage.new_kv()
        outs.append([stage.forward(hidden, kv), stage.forward(hidden[:1], kv)])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_lean_switch_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    monkeypatch.setenv(LEAN_ENV, "0")
    assert not lean_default()
    assert not load_stage(tiny_dir, 0, 2, weights="int4").lean
    monkeypatch.delenv(LEAN_ENV)
    assert lean_default()
    monkeypatch.setenv(DECODE_ENV, "0")
    assert not decode_default()
    assert not load_stage(tiny_dir, 0, 2, weights="int4").lean_decode
    monkeypatch.delenv(DECODE_ENV)
    assert decode_default()
    assert load_stage(tiny_dir, 0, 2, weights="int4").lean_decode
    # transformers' own attention (a mask, not key spans): the layers stay transformers'
    assert not load_stage(tiny_dir, 0, 2, weights="int4", attn_implementation="sdpa").lean


def test_layers_the_lean_forward_does_not_know_are_left_alone() -> None:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    assert not supports(Qwen3DecoderLayer(config, 0))  # its q/k norms
    assert not supports(torch.nn.Linear(4, 4))
