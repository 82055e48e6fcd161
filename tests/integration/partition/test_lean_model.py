"""The default model with lean decoder layers: the same logits, bit for bit, as without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.partition import stage as stage_module
from hetmesh.partition.stage import StageModule, load_stage

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = [1, 504, 3458, 282, 4649, 314, 2113, 30]
STEPS = 12


def _greedy_logits(
    stage: StageModule, lean: bool, lean_decode: bool = True, script: bool = True
) -> list[torch.Tensor]:
    """The last-token logits of a prefill (in two chunks) and greedy decode steps
    (through lean.lean_decode where ``lean_decode``, scripted where ``script``)."""
    stage.lean, stage.lean_decode, stage.lean_script = lean, lean_decode, script
    kv = stage.new_kv()
    stage.forward(torch.tensor(PROMPT[:3]), kv)
    logits = [stage.forward(torch.tensor(PROMPT[3:]), kv, last_only=True)[-1]]
    for _ in range(STEPS):
        token = int(logits[-1].argmax())
        logits.append(stage.forward(torch.tensor([token]), kv, last_only=True)[-1])
    return logits


@pytest.mark.parametrize(("fmt", "fuse"), [("int4", False), ("int4", True), ("int8", False)])
def test_lean_default_model_matches_transformers_layers(
    monkeypatch: pytest.MonkeyPatch, default_model_dir: Path, fmt: str, fuse: bool
) -> None:
    stage = load_stage(default_model_dir, 0, 32, weights=fmt, fuse=fuse)
    assert stage.lean  # on by default for the default model's layers
    calls: dict[str, int] = {"lean_decode": 0, "decode_layers": 0}
    for name in calls:
        real = getattr(stage_module, name)

        def counted(
            *args: object, name: str = name, real: Any = real, **kwargs: object
        ) -> torch.Tensor:
            calls[name] += 1
            return real(*args, **kwargs)  # type: ignore[no-any-return]

        monkeypatch.setattr(stage_module, name, counted)
    expected = _greedy_logits(stage, lean=False)
    got = _greedy_logits(stage, lean=True)
    # each int4 decode step scripted (one call), plain or fused, its attention exact
    # attention's way for this shape (products, or one call per query)
    scripted = fmt == "int4"
    per_run = STEPS * stage.num_layers if fmt == "int4" else 0
    assert calls["decode_layers"] == (STEPS if scripted else 0)
    assert calls["lean_decode"] == (0 if scripted else per_run)
    unscripted = _greedy_logits(stage, lean=True, script=False)
    assert calls["lean_decode"] == (per_run if scripted else 2 * per_run)
    layers_only = _greedy_logits(stage, lean=True, lean_decode=False)
    assert len(got) == STEPS + 1
    # a fused int4 group is one kernel call whose columns the members take
    assert (stage._lean_plans()[0].qkv.columns is not None) is (fuse and fmt == "int4")
    for step, (a, b, c, d) in enumerate(zip(got, expected, layers_only, unscripted, strict=True)):
        assert torch.equal(a, b), f"{fmt}: logits differ at step {step}"
        assert torch.equal(c, b), f"{fmt}: lean_layer's logits differ at step {step}"
        assert torch.equal(d, b), f"{fmt}: lean_decode's logits differ at step {step}"


def test_scripted_int4_step_takes_heads_wider_than_the_hidden_size(tiny_model_dir: Path) -> None:
    """The tests' tiny model has 4 heads of 64 over a hidden size of 64: its attention's
    output is not one contiguous row. The scripted int4 step (which a gateway's int4
    draft model runs) gives the unscripted path's logits instead of failing."""
    stage = load_stage(tiny_model_dir, 0, 32, weights="int4")
    unscripted = _greedy_logits(stage, lean=True, script=False)
    scripted = _greedy_logits(stage, lean=True, script=True)
    for step, (a, b) in enumerate(zip(scripted, unscripted, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
