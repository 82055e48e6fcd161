"""Synth checkpoints served by our stages: K stages equal one process, hidden states
stay finite and bounded through every layer, transformers reads the same model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import resolve_model
from hetmesh.partition.synth import LOGIT_STD, RESIDUAL_RMS, SHAPES, SynthFormat, SynthSpec
from hetmesh.partition.synth_write import write_folder
from hetmesh.partition.text import encode_prompt
from tests.unit.partition.synth_cache import synth_cache

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = "The lighthouse keeper climbed the spiral stairs every evening, counting the steps"
STEPS = 12


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return synth_cache(tmp_path_factory.mktemp("synth"), default_model_dir)


@pytest.mark.parametrize(
    ("name", "native"),
    [
        ("synth-tiny", "int4"),  # GGUF Q4_1 blocks, held as int4
        ("synth-tiny-qwen2", "int4"),
        ("synth-tiny-bf16", None),  # bf16 where the CPU multiplies it, else float32
        ("synth-tiny-qwen2-q8_0", "int8"),
    ],
)
def test_three_stages_give_one_process_s_logits_and_tokens(
    name: str, native: str | None, cache: Path
) -> None:
    folder = resolve_model(name, cache_dir=cache)
    one = LocalPipeline.load(folder, 1)
    three = LocalPipeline.load(folder, 3)
    assert len(three.stages) == 3
    assert one.weights == three.weights
    assert native is None or one.weights.value == native
    ids = encode_prompt(one.tokenizer, PROMPT)
    with torch.no_grad():
        whole = one.forward(torch.tensor(ids), [s.new_kv() for s in one.stages])
        cut = three.forward(torch.tensor(ids), [s.new_kv() for s in three.stages])
    assert torch.isfinite(whole).all()
    assert torch.equal(cut, whole)
    params = SamplingParams(max_new_tokens=STEPS)
    tokens = list(one.generate_ids(ids, params))
    assert len(tokens) == STEPS  # the head's special words are zero: no early end
    assert list(three.generate_ids(ids, params)) == tokens


def hidden_rms_per_unit(pipeline: LocalPipeline, ids: list[int]) -> list[torch.Tensor]:
    """Each stage's output (one unit a stage): hidden states' RMS per token, then logits."""
    x = torch.tensor(ids)
    outs = []
    with torch.no_grad():
        for stage in pipeline.stages:
            x = stage.forward(x, stage.new_kv())
            outs.append(x)
    return outs


@pytest.mark.parametrize("family", ["synth-tiny", "synth-tiny-qwen2"])
@pytest.mark.parametrize("layers", [4, 32])
def test_hidden_states_stay_finite_and_bounded_through_every_layer(
    family: str, layers: int, tmp_path: Path, default_model_dir: Path
) -> None:
    """At a real model's depth too (32 layers of the tiny width): the residual stream's
    RMS stays near :data:`RESIDUAL_RMS`, the logits' spread near :data:`LOGIT_STD`."""
    import transformers

    shape = dataclasses.replace(SHAPES[family], num_hidden_layers=layers)
    folder = tmp_path / "m"
    write_folder(SynthSpec(shape, SynthFormat.BF16), folder, default_model_dir)
    units = layers + 2
    ours = LocalPipeline.load(folder, units, weights="float32")
    ids = encode_prompt(ours.tokenizer, PROMPT)
    outs = hidden_rms_per_unit(ours, ids)
    for unit, hidden in enumerate(outs[:-1]):
        assert torch.isfinite(hidden).all(), unit
        rms = hidden.pow(2).mean(-1).sqrt()
        assert rms.max() < 2 * RESIDUAL_RMS, (unit, rms.max())
        assert rms.min() > 0.05 or unit == 0, (unit, rms.min())  # unit 0: embeddings
    logits = outs[-1]
    assert torch.isfinite(logits).all()
    assert LOGIT_STD / 2 < float(logits.std()) < 2 * LOGIT_STD
    # transformers reads the folder as the same model, hidden states and logits
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    assert len(ref.hidden_states) == layers + 1
    for layer, hidden in enumerate(ref.hidden_states[:-1]):  # the last is after the norm
        torch.testing.assert_close(outs[layer][None], hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[None], ref.logits, atol=1e-3, rtol=1e-4)
