"""The default model's int4 logits do not depend on the thread count the chooser picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition.stage import load_stage
from hetmesh.partition.threads import ThreadChooser

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = [1, 504, 3458, 282, 4649, 314]


def test_int4_logits_equal_at_one_and_two_threads(default_model_dir: Path) -> None:
    stage = load_stage(default_model_dir, 0, 32, weights="int4")
    caller = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # two threads: a chooser that probes every step, so both counts run
            stage.threads = ThreadChooser(probe=4, first_period=1) if threads == 2 else None
            kv = stage.new_kv()
            logits = [stage.forward(torch.tensor(PROMPT), kv, last_only=True)[-1]]
            for _ in range(6):
                token = torch.tensor([int(logits[-1].argmax())])
                logits.append(stage.forward(token, kv, last_only=True)[-1])
            runs.append(logits)
    finally:
        torch.set_num_threads(caller)
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
