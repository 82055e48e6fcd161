"""A scripted decode round of several sessions (hetmesh.partition.lean_round) gives each
row the bits of the single-session step and of the eager round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.partition import exact_gemm
from hetmesh.partition import stage as stage_module
from hetmesh.partition.exact_gemm import WIDE_ROWS
from hetmesh.partition.lean_round import ROUND_ENV, round_default
from hetmesh.partition.stage import StageModule, load_stage
from tests.unit.partition.tiny_models import VOCAB, count_calls

HIDDEN = 128


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def wide_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose int4 products are all whole blocks of 64 rows (no padding)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 320,
        "tie_word_embeddings": False,
    }
    if request.param == "llama":
        config = transformers.LlamaConfig(**common)
    else:  # a window shorter than the prompts: each layer's own first key
        config = transformers.MistralConfig(**common, sliding_window=9)
    torch.manual_seed(5)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp(f"round-{request.param}")
    model.save_pretrained(str(folder))
    return folder


def _input(stage: StageModule, n: int, generator: torch.Generator) -> torch.Tensor:
    if stage.has_embed:
        return torch.randint(4, VOCAB, (n,), generator=generator)
    return torch.randn(n, HIDDEN, generator=generator)


def _rounds(
    stage: StageModule, prompts: list[int], steps: int, mode: str
) -> tuple[list[list[torch.Tensor]], list[bool]]:
    """Each session's prefill and ``steps`` decode tokens, all sessions in one pool of
    small blocks (so growing sessions' blocks interleave): ``mode`` ``single`` /
    ``single-script`` steps one session at a time, ``eager`` / ``script`` a round of all
    of them (``*script``: the round's script on). Returns each step's outputs and
    whether each session's blocks still formed one run at the end."""
    generator = torch.Generator().manual_seed(7)
    pool = stage.new_pool(64)
    sessions = [stage.new_kv(pool) for _ in prompts]
    outputs = [
        [stage.forward(_input(stage, n, generator), kv, last_only=True)]
        for n, kv in zip(prompts, sessions, strict=True)
    ]
    stage.lean_round = mode.endswith("script")
    for _ in range(steps):
        rows = [_input(stage, 1, generator) for _ in sessions]
        if mode.startswith("single"):
            step = [
                stage.forward(x, kv, last_only=True) for x, kv in zip(rows, sessions, strict=True)
            ]
        else:
            step = stage.forward_batch(list(zip(rows, sessions, strict=True)), last_only=True)
        for out, row in zip(outputs, step, strict=True):
            out.append(row)
    return outputs, [kv.contiguous for kv in sessions]


def _stage(folder: Path, start: int, end: int, fuse: bool) -> StageModule:
    stage = load_stage(folder, start, end, weights="int4", fuse=fuse)
    assert stage.lean
    assert stage.lean_script
    if not stage._gemm():
        pytest.skip("exact attention makes one call per query for this shape on this CPU")
    return stage


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("units", [(0, 5), (1, 3)])
@pytest.mark.parametrize("rows", [None, WIDE_ROWS])
def test_a_scripted_round_gives_every_row_its_single_step_bits(
    monkeypatch: pytest.MonkeyPatch,
    wide_dir: Path,
    units: tuple[int, int],
    fuse: bool,
    rows: int | None,
) -> None:
    """Sessions of 3 (keys padded to 16), 14, 40 and 250 tokens (its steps cross the key
    block at 256) step 10 times: the scripted round's outputs (logits of the whole
    model, or a middle stage's hidden states) equal the lone scripted step's and the
    eager round's bit for bit; some sessions' blocks stop forming one run on the way,
    and their lone steps take the round's script too (else eager layers), same bits.
    ``rows``: the probe's verdict forced to WIDE_ROWS rows a product (Llama 3.x 8B's
    shape: a query head's row padded with zero rows), else the probe's own."""
    stage = _stage(wide_dir, *units, fuse)
    if rows is not None:
        monkeypatch.setitem(exact_gemm._VERDICTS, (4, 2, 32), rows)
        assert stage._gemm_rows() == rows
    scripted_rounds = count_calls(monkeypatch, stage_module, "round_layers")
    lone_steps = count_calls(monkeypatch, stage_module, "decode_layers")
    prompts, steps = [3, 14, 40, 250], 10
    single, _ = _rounds(stage, prompts, steps, "single")
    lone = len(lone_steps)
    assert 0 < lone < steps * len(prompts)  # a session whose blocks split steps eagerly
    assert not scripted_rounds
    single_scripted, _ = _rounds(stage, prompts, steps, "single-script")
    assert len(lone_steps) == 2 * lone  # the same steps read one run of blocks ...
    assert len(scripted_rounds) == steps * len(prompts) - lone  # ... the others not
    eager, _ = _rounds(stage, prompts, steps, "eager")
    assert len(scripted_rounds) == steps * len(prompts) - lone
    scripted, runs = _rounds(stage, prompts, steps, "script")
    assert len(scripted_rounds) == steps * len(prompts) - lone + steps  # a call a round
    assert len(lone_steps) == 2 * lone  # no lone step in a round
    assert not all(runs)  # blocks interleaved: the rows' slots are gathered
    for outputs in zip(single, single_scripted, eager, scripted, strict=True):
        for a, b, c, d in zip(*outputs, strict=True):
            assert torch.equal(a, d)
            assert torch.equal(b, d)
            assert torch.equal(c, d)


def test_sessions_of_different_pools_take_the_eager_round(
    monkeypatch: pytest.MonkeyPatch, wide_dir: Path
) -> None:
    stage = _stage(wide_dir, 0, 5, False)
    scripted_rounds = count_calls(monkeypatch, stage_module, "round_layers")
    generator = torch.Generator().manual_seed(8)
    sessions = [stage.new_kv(), stage.new_kv()]  # a pool each
    for kv in sessions:
        stage.forward(_input(stage, 5, generator), kv)
    stage.forward_batch([(_input(stage, 1, generator), kv) for kv in sessions])
    assert not scripted_rounds


def test_round_switch_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, wide_dir: Path
) -> None:
    monkeypatch.setenv(ROUND_ENV, "0")
    assert not round_default()
    assert not load_stage(wide_dir, 0, 2, weights="int4").lean_round
    monkeypatch.delenv(ROUND_ENV)
    assert round_default()
    assert load_stage(wide_dir, 0, 2, weights="int4").lean_round
