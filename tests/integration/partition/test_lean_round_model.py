"""The default model's scripted decode rounds (hetmesh.partition.lean_round): each row's
logits bit for bit those of the lone step and of the eager round."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition import stage as stage_module
from hetmesh.partition.stage import StageModule, load_stage
from tests.unit.partition.tiny_models import count_calls

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = [[1, 504, 3458], [1, 504, 3458, 282, 4649, 314, 2113, 30] * 3, [17, 2113] * 9]
STEPS = 6


def _steps(stage: StageModule, together: bool, script: bool) -> list[list[torch.Tensor]]:
    """Each prompt's last logits, then STEPS greedy steps of all sessions: one round each
    (``together``) or one session at a time; the round's script on or off."""
    stage.lean_round = script
    pool = stage.new_pool(64)
    sessions = [stage.new_kv(pool) for _ in PROMPTS]
    logits = [
        [stage.forward(torch.tensor(p), kv, last_only=True)[-1]]
        for p, kv in zip(PROMPTS, sessions, strict=True)
    ]
    for _ in range(STEPS):
        rows = [torch.tensor([int(out[-1].argmax())]) for out in logits]
        items = list(zip(rows, sessions, strict=True))
        if together:
            step = stage.forward_batch(items, last_only=True)
        else:
            step = [stage.forward(x, kv, last_only=True) for x, kv in items]
        for out, row in zip(logits, step, strict=True):
            out.append(row[-1])
    return logits


@pytest.mark.parametrize("fuse", [False, True])
def test_default_model_rounds_scripted_bit_identical(
    monkeypatch: pytest.MonkeyPatch, default_model_dir: Path, fuse: bool
) -> None:
    stage = load_stage(default_model_dir, 0, 32, weights="int4", fuse=fuse)
    if not stage._gemm():
        pytest.skip("exact attention makes one call per query for this shape on this CPU")
    rounds = count_calls(monkeypatch, stage_module, "round_layers")
    eager = _steps(stage, together=True, script=False)
    lone = _steps(stage, together=False, script=False)
    assert not rounds
    scripted = _steps(stage, together=True, script=True)
    assert len(rounds) == STEPS
    for a, b, c in zip(scripted, eager, lone, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert torch.equal(x, y)
            assert torch.equal(x, z)
