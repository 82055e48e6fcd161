"""GPU profiles through pynvml and torch (runs only where CUDA is present)."""

from __future__ import annotations

import pytest

from hetmesh.discovery import profiling

pytestmark = pytest.mark.gpu


def _require_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_gpu_profiles_list_every_nvidia_device_with_measured_flops() -> None:
    _require_cuda()
    import torch

    flops = profiling.measure_gpu_flops(budget_s=0.3)
    assert set(flops) == set(range(torch.cuda.device_count()))
    assert all(f > 1e12 for f in flops.values())  # any CUDA GPU beats a TFLOP/s in fp16
    gpus = profiling.gpu_profiles("P", flops)
    assert [g.device for g in gpus] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for gpu in gpus:
        assert gpu.backend == "cuda"
        assert 0 < gpu.memory_free_bytes <= gpu.memory_total_bytes
        assert gpu.compute_capability.count(".") == 1
        assert gpu.matmul_flops > 1e12
