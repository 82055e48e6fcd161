"""Device profiles: what this machine can do, measured, within its own limits.

- CPU figures come from psutil and honour the node's cgroup (v1 or v2): a CPU
  quota becomes fractional effective cores, a memory limit caps total and free
  memory, and ``--max-memory`` caps them further.
- Speeds are measured, never looked up: a short fp32 matmul benchmark
  (FLOP/s) and a large tensor copy (memory bandwidth), together ≤ ~2 s.
  Results are cached per machine (and per CPU limit) in the data directory
  and re-measured by the node when it is idle.
- NVIDIA GPUs come from pynvml; no pynvml, no driver or no GPU means a CPU
  profile only, never an error.

Everything here is blocking: the node calls it through ``trio.to_thread``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from hetmesh.resources import DeviceProfile, PeerId

log = logging.getLogger(__name__)

CACHE_FILE = "profile-cache.json"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    cpu_cores: float | None  # effective cores allowed by the quota; None = no quota
    memory_limit_bytes: int | None  # None = no limit
    memory_usage_bytes: int | None


@dataclass(frozen=True, slots=True)
class Benchmark:
    matmul_flops: float
    memory_bandwidth_bps: float
    measured_at_s: float  # wall clock
    key: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Map controller name -> cgroup path from /proc/self/cgroup text ("" key = v2)."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            paths[""] = path
        for c in controllers.split(","):
            if c:
                paths[c] = path
    return paths


def _controller_dir(root: Path, names: tuple[str, ...], path: str) -> Path | None:
    for name in names:
        base = root / name
        if base.is_dir():
            candidate = base / path.lstrip("/")
            return candidate if candidate.is_dir() else base
    return None


def read_cgroup_limits(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> CgroupLimits:
    """The CPU quota and memory limit of this process's cgroup (v1 or v2)."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    paths = _cgroup_paths(proc_cgroup)
    cores: float | None = None
    mem_limit: int | None = None
    mem_usage: int | None = None

    cpu_path = paths.get("cpu")
    if cpu_path is not None:  # v1
        d = _controller_dir(root, ("cpu", "cpu,cpuacct", "cpuacct,cpu"), cpu_path)
        if d is not None:
            quota = _read(d / "cpu.cfs_quota_us")
            period = _read(d / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0 and int(period) > 0:
                cores = int(quota) / int(period)
    elif "" in paths:  # v2
        d = root / paths[""].lstrip("/")
        cpu_max = _read(d / "cpu.max")
        if cpu_max:
            quota_s, _, period_s = cpu_max.partition(" ")
            if quota_s != "max" and period_s:
                cores = int(quota_s) / int(period_s)

    mem_path = paths.get("memory")
    if mem_path is not None:  # v1
        d = _controller_dir(root, ("memory",), mem_path)
        if d is not None:
            limit = _read(d / "memory.limit_in_bytes")
            if limit and int(limit) < _UNLIMITED:
                mem_limit = int(limit)
            usage = _read(d / "memory.usage_in_bytes")
            mem_usage = int(usage) if usage else None
    elif "" in paths:  # v2
        d = root / paths[""].lstrip("/")
        limit = _read(d / "memory.max")
        if limit and limit != "max":
            mem_limit = int(limit)
        usage = _read(d / "memory.current")
        mem_usage = int(usage) if usage else None
    return CgroupLimits(cpu_cores=cores, memory_limit_bytes=mem_limit, memory_usage_bytes=mem_usage)


def effective_memory(
    host_total: int,
    host_available: int,
    limits: CgroupLimits,
    max_memory_bytes: int | None,
) -> tuple[int, int]:
    """(total, free) bytes this node may use: host figures capped by cgroup and flag."""
    total, free = host_total, host_available
    if limits.memory_limit_bytes is not None and limits.memory_limit_bytes < total:
        total = limits.memory_limit_bytes
        used = limits.memory_usage_bytes or 0
        free = min(free, max(total - used, 0))
    if max_memory_bytes is not None and max_memory_bytes < total:
        free = min(free, max_memory_bytes)
        total = max_memory_bytes
    return total, min(free, total)


def effective_cores(logical: int, limits: CgroupLimits) -> float:
    affinity = logical
    with contextlib.suppress(AttributeError, OSError):
        affinity = len(os.sched_getaffinity(0))
    cores = float(min(logical, affinity))
    if limits.cpu_cores is not None:
        cores = min(cores, limits.cpu_cores)
    return cores


def machine_key(limits: CgroupLimits) -> str:
    """Cache key: same machine, same CPU allowance, same torch."""
    machine = _read(Path("/etc/machine-id")) or socket.gethostname()
    # the installed version, read without importing torch (seconds at start-up): a
    # node whose benchmark is cached, or that serves nothing, never loads torch
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        torch_version = "none"
    cores = "max" if limits.cpu_cores is None else f"{limits.cpu_cores:.3f}"
    return f"{machine}|{platform.machine()}|cpu={cores}|torch={torch_version}"


def _best_rate(
    step: Callable[[], float],
    budget_s: float,
    window_s: float,
    cpu_clock: Callable[[], float] | None = None,
) -> float:
    """Run ``step`` (returns work done) for ``budget_s``; the best rate over windows.

    Other processes only ever slow a window down, so the best window is the
    closest to what this node can sustain; windows span more than one CFS
    period (100 ms) so a CPU quota is still fully reflected. With ``cpu_clock``
    the rate is per second of that clock (CPU time): the work a core does
    while it runs, whatever else shares the machine.
    """
    best = 0.0
    deadline = time.perf_counter() + budget_s
    clock = cpu_clock or time.perf_counter
    while True:
        start, start_cpu = time.perf_counter(), clock()
        work = 0.0
        while True:
            work += step()
            now = time.perf_counter()
            if now - start >= window_s:
                break
        spent = clock() - start_cpu
        if spent > 0:
            best = max(best, work / spent)
        if now >= deadline:
            return best


def measure_cpu(
    budget_s: float = 1.5, threads: int | None = None, cores: float | None = None
) -> tuple[float, float]:
    """(matmul FLOP/s, memory bandwidth bytes/s) measured with torch on the CPU.

    The matmul's speed is taken per second of CPU time, with one thread and with
    ``threads`` threads, and scaled to the ``cores`` this node may use (its CPU
    quota; default ``threads``): a core's work does not depend on what else runs
    on the machine, so a loaded machine measures what a quiet one does, and a
    quarter-core quota gives a quarter of a core's speed (measured over wall
    time, a window can catch three quota slices in 2.25 periods). The better of
    the two counts: on a busy machine a multi-threaded matmul can do worse than
    a single thread (its threads wait for each other at every barrier, and spin).
    """
    import torch

    caller_threads = torch.get_num_threads()  # this thread's team, restored on return
    threads = max(1, threads or caller_threads)
    cores = threads if cores is None else max(cores, 1e-3)
    n = 512
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    flop = 2.0 * n * n * n

    def matmul() -> float:
        torch.mm(a, b)
        return flop

    flops = 0.0
    counts = [1, threads] if threads > 1 else [1]
    for count in counts:
        torch.set_num_threads(count)
        torch.mm(a, b)  # warm up
        share = budget_s * 0.65 / len(counts)
        # one thread runs the product in this thread; more add the pool's CPU time
        clock = time.thread_time if count == 1 else time.process_time
        per_cpu_s = _best_rate(matmul, share, window_s=min(0.25, share / 2), cpu_clock=clock)
        flops = max(flops, per_cpu_s * min(count, cores))
    torch.set_num_threads(threads)

    src = torch.empty(16 * 1024 * 1024 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    nbytes = 2.0 * src.numel() * src.element_size()  # read + write

    def copy() -> float:
        dst.copy_(src)
        return nbytes

    bandwidth = _best_rate(copy, budget_s * 0.35, window_s=min(0.2, budget_s * 0.12))
    # the caller's worker thread is reused (a stage load ran on a team of `threads`)
    torch.set_num_threads(caller_threads)
    return flops, bandwidth


def load_cached_benchmark(data_dir: Path, key: str) -> Benchmark | None:
    raw = _read(data_dir / CACHE_FILE)
    if raw is None:
        return None
    try:
        entry = json.loads(raw).get(key)
        if not entry:
            return None
        return Benchmark(
            matmul_flops=float(entry["matmul_flops"]),
            memory_bandwidth_bps=float(entry["memory_bandwidth_bps"]),
            measured_at_s=float(entry["measured_at_s"]),
            key=key,
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        log.warning("ignoring an unreadable benchmark cache in %s", data_dir)
        return None


def store_benchmark(data_dir: Path, bench: Benchmark) -> None:
    path = data_dir / CACHE_FILE
    try:
        existing = json.loads(_read(path) or "{}")
        if not isinstance(existing, dict):
            existing = {}
    except ValueError:
        existing = {}
    existing[bench.key] = {
        "matmul_flops": bench.matmul_flops,
        "memory_bandwidth_bps": bench.memory_bandwidth_bps,
        "measured_at_s": bench.measured_at_s,
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(existing, indent=1))
    tmp.replace(path)


def benchmark_cpu(data_dir: Path, *, refresh: bool = False, budget_s: float = 1.5) -> Benchmark:
    """The CPU benchmark for this machine: cached unless ``refresh``."""
    limits = read_cgroup_limits()
    key = machine_key(limits)
    if not refresh:
        cached = load_cached_benchmark(data_dir, key)
        if cached is not None:
            return cached
    cores = effective_cores(psutil.cpu_count() or 1, limits)
    flops, bandwidth = measure_cpu(budget_s, threads=max(1, math.ceil(cores)), cores=cores)
    bench = Benchmark(flops, bandwidth, time.time(), key)
    with contextlib.suppress(OSError):
        store_benchmark(data_dir, bench)
    return bench


def cpu_profile(
    peer_id: PeerId, bench: Benchmark, *, max_memory_bytes: int | None = None
) -> DeviceProfile:
    """The CPU's DeviceProfile with current memory and load figures."""
    limits = read_cgroup_limits()
    vm = psutil.virtual_memory()
    total, free = effective_memory(vm.total, vm.available, limits, max_memory_bytes)
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    cores = effective_cores(logical, limits)
    freq = 0.0
    with contextlib.suppress(Exception):
        f = psutil.cpu_freq()
        freq = float(f.current) * 1e6 if f else 0.0
    util = psutil.cpu_percent(interval=None) / 100.0
    return DeviceProfile(
        peer_id=peer_id,
        device="cpu",
        backend="cpu",
        name=platform.processor() or platform.machine() or "cpu",
        memory_total_bytes=total,
        memory_free_bytes=free,
        matmul_flops=bench.matmul_flops,
        memory_bandwidth_bps=bench.memory_bandwidth_bps,
        cpu_cores_physical=min(physical, max(1, math.ceil(cores))),
        cpu_cores_logical=max(1, math.ceil(cores)),
        cpu_freq_hz=freq,
        utilisation=min(max(util, 0.0), 1.0),
        measured_at_s=bench.measured_at_s,
    )


def gpu_profiles(
    peer_id: PeerId, measured_flops: dict[int, float] | None = None
) -> list[DeviceProfile]:
    """One DeviceProfile per NVIDIA GPU via pynvml; [] without pynvml, driver or GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    profiles: list[DeviceProfile] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            util = 0.0
            with contextlib.suppress(Exception):
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            cc = ""
            with contextlib.suppress(Exception):
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            profiles.append(
                DeviceProfile(
                    peer_id=peer_id,
                    device=f"cuda:{i}",
                    backend="cuda",
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_total_bytes=int(mem.total),
                    memory_free_bytes=int(mem.free),
                    matmul_flops=(measured_flops or {}).get(i, 0.0),
                    memory_bandwidth_bps=0.0,
                    utilisation=util,
                    compute_capability=cc,
                    measured_at_s=time.time(),
                )
            )
    except Exception:
        log.warning("reading GPUs through pynvml failed; reporting the CPU only", exc_info=True)
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return profiles


def _nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded (its device nodes exist); cheap, no torch."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()


def measure_gpu_flops(budget_s: float = 0.5) -> dict[int, float]:
    """fp16 matmul FLOP/s per CUDA device; {} without CUDA."""
    if not _nvidia_driver_present():
        return {}  # no GPU to measure: spare a membership-only node the torch import
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        out: dict[int, float] = {}
        for i in range(torch.cuda.device_count()):
            dev = torch.device(f"cuda:{i}")
            n = 4096
            a = torch.randn(n, n, device=dev, dtype=torch.float16)
            b = torch.randn(n, n, device=dev, dtype=torch.float16)
            torch.mm(a, b)
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            count = 0
            while time.perf_counter() - start < budget_s:
                for _ in range(10):
                    torch.mm(a, b)
                torch.cuda.synchronize(dev)
                count += 10
            out[i] = 2.0 * n**3 * count / (time.perf_counter() - start)
        return out
    except Exception:
        log.warning("measuring GPU FLOP/s failed", exc_info=True)
        return {}


def device_profiles(
    peer_id: PeerId,
    bench: Benchmark,
    *,
    gpu_flops: dict[int, float] | None = None,
    max_memory_bytes: int | None = None,
    only: str | None = None,
) -> tuple[DeviceProfile, ...]:
    """Every device of this node (``only``: restrict to one torch device string)."""
    devices = [cpu_profile(peer_id, bench, max_memory_bytes=max_memory_bytes)]
    devices += gpu_profiles(peer_id, gpu_flops)
    if only is not None:
        picked = [d for d in devices if d.device == only or d.device.startswith(only + ":")]
        if not picked:
            log.warning("no device %r here; offering the CPU", only)
        devices = picked or devices[:1]
    return tuple(devices)


def system_idle(threshold: float = 0.25) -> bool:
    """True when the machine is quiet enough to re-run the benchmark."""
    busy: float = psutil.cpu_percent(interval=0.2) / 100.0
    return busy < threshold


__all__ = [
    "Benchmark",
    "CgroupLimits",
    "benchmark_cpu",
    "cpu_profile",
    "device_profiles",
    "effective_cores",
    "effective_memory",
    "gpu_profiles",
    "measure_cpu",
    "measure_gpu_flops",
    "read_cgroup_limits",
    "system_idle",
]
