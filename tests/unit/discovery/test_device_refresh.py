"""Device figures that drift a little do not make a new record version each time."""

from __future__ import annotations

import dataclasses

from hetmesh.discovery.service import _devices_moved
from hetmesh.resources import DeviceProfile

GIB = 1024**3


def cpu(**changes: float) -> DeviceProfile:
    base = DeviceProfile(
        peer_id="p",
        device="cpu",
        backend="cpu",
        name="x86_64",
        memory_total_bytes=16 * GIB,
        memory_free_bytes=8 * GIB,
        matmul_flops=5e10,
        memory_bandwidth_bps=2e10,
        cpu_cores_physical=2,
        cpu_cores_logical=2,
        cpu_freq_hz=2.6e9,
        utilisation=0.2,
        measured_at_s=100.0,
    )
    return dataclasses.replace(base, **changes)


def test_small_drifts_are_not_a_change() -> None:
    drifted = cpu(memory_free_bytes=8 * GIB - 64 * 2**20, utilisation=0.25, cpu_freq_hz=2.4e9)
    assert not _devices_moved([cpu()], [drifted])


def test_large_moves_and_anything_else_are_a_change() -> None:
    assert _devices_moved([cpu()], [cpu(memory_free_bytes=7 * GIB)])
    assert _devices_moved([cpu()], [cpu(utilisation=0.5)])
    assert _devices_moved([cpu()], [cpu(cpu_freq_hz=1.2e9)])
    assert _devices_moved([cpu()], [cpu(matmul_flops=2.5e10)])  # a new benchmark
    assert _devices_moved([cpu()], [cpu(), cpu(peer_id="p", device="cuda:0")])
