"""Profiling: cgroup limits (v1 and v2), memory caps, the benchmark cache, no-GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.discovery import profiling
from hetmesh.discovery.profiling import Benchmark, CgroupLimits


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_profiling_reads_cgroup_v1_cpu_quota_and_memory_limit(tmp_path: Path) -> None:
    _write(tmp_path / "cpu/grp/cpu.cfs_quota_us", "25000\n")
    _write(tmp_path / "cpu/grp/cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "memory/grp/memory.limit_in_bytes", str(2 << 30))
    _write(tmp_path / "memory/grp/memory.usage_in_bytes", str(1 << 30))
    proc = "4:memory:/grp\n2:cpuacct:/\n1:cpu:/grp\n0::/\n"
    limits = profiling.read_cgroup_limits(tmp_path, proc)
    assert limits == CgroupLimits(
        cpu_cores=0.25, memory_limit_bytes=2 << 30, memory_usage_bytes=1 << 30
    )


def test_profiling_v1_unlimited_means_no_limits(tmp_path: Path) -> None:
    _write(tmp_path / "cpu,cpuacct/cpu.cfs_quota_us", "-1")
    _write(tmp_path / "cpu,cpuacct/cpu.cfs_period_us", "100000")
    _write(tmp_path / "memory/memory.limit_in_bytes", "9223372036854771712")
    limits = profiling.read_cgroup_limits(tmp_path, "3:cpu,cpuacct:/\n2:memory:/\n")
    assert limits.cpu_cores is None
    assert limits.memory_limit_bytes is None


def test_profiling_reads_cgroup_v2(tmp_path: Path) -> None:
    _write(tmp_path / "box/cpu.max", "150000 100000\n")
    _write(tmp_path / "box/memory.max", "1073741824\n")
    _write(tmp_path / "box/memory.current", "1000\n")
    limits = profiling.read_cgroup_limits(tmp_path, "0::/box\n")
    assert limits == CgroupLimits(
        cpu_cores=1.5, memory_limit_bytes=1 << 30, memory_usage_bytes=1000
    )
    _write(tmp_path / "box/cpu.max", "max 100000\n")
    _write(tmp_path / "box/memory.max", "max\n")
    assert profiling.read_cgroup_limits(tmp_path, "0::/box\n").cpu_cores is None


def test_profiling_missing_cgroup_files_mean_no_limits(tmp_path: Path) -> None:
    assert profiling.read_cgroup_limits(tmp_path, "") == CgroupLimits(None, None, None)


@pytest.mark.parametrize(
    ("limits", "max_memory", "expected"),
    [
        (CgroupLimits(None, None, None), None, (16, 10)),
        (CgroupLimits(None, 8, 3), None, (8, 5)),
        (CgroupLimits(None, 8, 7), None, (8, 1)),
        (CgroupLimits(None, None, None), 4, (4, 4)),
        (CgroupLimits(None, 8, 1), 6, (6, 6)),
        (CgroupLimits(None, 32, 1), None, (16, 10)),  # a limit above the host changes nothing
    ],
)
def test_profiling_effective_memory_honours_cgroup_and_flag(
    limits: CgroupLimits, max_memory: int | None, expected: tuple[int, int]
) -> None:
    assert profiling.effective_memory(16, 10, limits, max_memory) == expected


def test_profiling_effective_cores_follow_the_quota() -> None:
    assert profiling.effective_cores(64, CgroupLimits(0.5, None, None)) == 0.5
    assert profiling.effective_cores(1, CgroupLimits(None, None, None)) == 1.0


def test_profiling_benchmark_cache_round_trip(tmp_path: Path) -> None:
    bench = Benchmark(1e11, 2e10, 123.0, "key-a")
    profiling.store_benchmark(tmp_path, bench)
    profiling.store_benchmark(tmp_path, Benchmark(5.0, 6.0, 7.0, "key-b"))
    assert profiling.load_cached_benchmark(tmp_path, "key-a") == bench
    assert profiling.load_cached_benchmark(tmp_path, "missing") is None
    (tmp_path / profiling.CACHE_FILE).write_text("{not json")
    assert profiling.load_cached_benchmark(tmp_path, "key-a") is None


def test_profiling_cached_benchmark_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = profiling.machine_key(profiling.read_cgroup_limits())
    profiling.store_benchmark(tmp_path, Benchmark(42.0, 43.0, 1.0, key))

    def boom(*_a: object, **_k: object) -> tuple[float, float]:
        raise AssertionError("measured although cached")

    monkeypatch.setattr(profiling, "measure_cpu", boom)
    assert profiling.benchmark_cpu(tmp_path).matmul_flops == 42.0


def test_profiling_measures_positive_speeds_within_its_budget() -> None:
    import time

    cpu_began = time.process_time()  # CPU time: a loaded machine stretches only wall time
    flops, bandwidth = profiling.measure_cpu(budget_s=0.3, threads=1)
    cpu_s = time.process_time() - cpu_began
    assert cpu_s < 10.0, f"a 0.3 s budget used {cpu_s:.1f} s of CPU"  # loose: no runaway loop
    assert flops > 1e8
    assert bandwidth > 1e8


def test_profiling_rates_count_cpu_time_not_time_spent_waiting() -> None:
    import time

    def step() -> float:
        time.sleep(0.01)  # off the CPU, as a process waiting for a busy core is
        return 1.0

    wall = profiling._best_rate(step, 0.1, 0.05)
    cpu = profiling._best_rate(step, 0.1, 0.05, cpu_clock=time.thread_time)
    assert wall <= 105.0  # at most one step per 10 ms of wall time
    assert cpu > 10 * wall


def test_profiling_a_cpu_quota_scales_the_matmul_speed() -> None:
    whole, _ = profiling.measure_cpu(budget_s=0.3, threads=1)
    tenth, _ = profiling.measure_cpu(budget_s=0.3, threads=1, cores=0.1)
    # a tenth of a core: a tenth of a core's speed (two measurements: loose bounds)
    assert 0.02 * whole < tenth < 0.5 * whole


def test_profiling_cpu_profile_respects_max_memory() -> None:
    bench = Benchmark(1e9, 1e9, 1.0, "k")
    profile = profiling.cpu_profile("P", bench, max_memory_bytes=1 << 30)
    assert profile.memory_total_bytes <= 1 << 30
    assert profile.memory_free_bytes <= profile.memory_total_bytes
    assert profile.backend == "cpu"
    assert profile.matmul_flops == 1e9


def test_profiling_without_nvidia_driver_reports_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert profiling.gpu_profiles("P") == []
    devices = profiling.device_profiles("P", Benchmark(1.0, 1.0, 1.0, "k"))
    assert [d.device for d in devices] == ["cpu"]


def test_profiling_leaves_the_calling_threads_torch_threads_as_it_found_them() -> None:
    """The profile runs in a reused worker thread: a stage load later ran there on the
    profile's two-thread team (spin-waiting on a loaded machine, issue 43)."""
    import threading

    import torch

    seen: list[int] = []

    def worker() -> None:
        torch.set_num_threads(1)
        profiling.measure_cpu(budget_s=0.05, threads=2)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1]
