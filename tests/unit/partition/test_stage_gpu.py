"""Stages on a CUDA device agree with the CPU (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from tests.unit.partition.tiny_models import VOCAB, reference_logits, save_tiny

pytestmark = pytest.mark.gpu


def test_cuda_stages_match_cpu_full_model(tmp_path: Path) -> None:
    model = save_tiny("llama-tied", tmp_path)
    prompt = torch.randint(4, VOCAB, (33,), generator=torch.Generator().manual_seed(2))
    steps = [5, 9, 11]
    ref_prefill, ref_steps = reference_logits(model, prompt, steps)
    stages = [load_stage(tmp_path, a, b, device="cuda") for a, b in [(0, 2), (2, 5), (5, 6)]]
    kvs = [s.new_kv() for s in stages]
    x = prompt
    for stage, kv in zip(stages, kvs, strict=True):
        x = stage.forward(x, kv)
    assert x.device.type == "cuda"
    torch.testing.assert_close(x.cpu(), ref_prefill, atol=1e-4, rtol=0)
    for token, ref in zip(steps, ref_steps, strict=True):
        x = torch.tensor([token])
        for stage, kv in zip(stages, kvs, strict=True):
            x = stage.forward(x, kv)
        torch.testing.assert_close(x[-1].cpu(), ref, atol=1e-4, rtol=0)
    cpu = LocalPipeline.load(tmp_path, 2)
    gpu = LocalPipeline.load(tmp_path, 3, device="cuda")
    params = SamplingParams(max_new_tokens=10)
    ids = prompt.tolist()
    assert list(gpu.generate_ids(ids, params, eos_ids=set())) == list(
        cpu.generate_ids(ids, params, eos_ids=set())
    )
