"""CPU quotas and memory limits for the testbed's hosts, on cgroup v1 or v2.

- **v1** (one hierarchy per controller, ``/sys/fs/cgroup/cpu``, ``.../memory``):
  a host gets a group in each controller it needs; ``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us``, ``memory.limit_in_bytes``, peak in
  ``memory.max_usage_in_bytes``.
- **v2** (one unified hierarchy, ``cgroup.controllers`` at its root): the root
  must list the controller and pass it down (``+cpu``/``+memory`` in
  ``cgroup.subtree_control``); a host gets one group with ``cpu.max``
  ("quota period"), ``memory.max`` and, from Linux 5.19, ``memory.peak``.

:func:`missing` says which needed controller is absent (for a skip reason);
nothing here assumes the real ``/sys/fs/cgroup``, so the v2 logic is tested
on a temporary directory laid out like one.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000

# what each need is called in a skip reason
CPU = "cpu"
MEMORY = "memory"
MEMORY_PEAK = "memory peak"


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """The cgroup hierarchy mounted at ``root``: v1 (per controller) or v2 (unified)."""

    version: Literal[1, 2]
    root: Path

    def missing(self, needs: Collection[str], *, kernel: str | None = None) -> str | None:
        """Why ``needs`` (of CPU, MEMORY, MEMORY_PEAK) cannot be met here, or None."""
        if self.version == 1:
            files = {
                CPU: self.root / "cpu" / "cpu.cfs_quota_us",
                MEMORY: self.root / "memory" / "memory.limit_in_bytes",
                MEMORY_PEAK: self.root / "memory" / "memory.max_usage_in_bytes",
            }
            for need in needs:
                if not files[need].exists():
                    return f"needs the cgroup v1 {need} controller ({files[need]} is missing)"
            return None
        available = _words(self.root / "cgroup.controllers")
        for need in needs:
            controller = MEMORY if need == MEMORY_PEAK else need
            if controller not in available:
                return (
                    f"needs the cgroup v2 {controller} controller "
                    f"(not in {self.root / 'cgroup.controllers'})"
                )
        release = os.uname().release if kernel is None else kernel
        if MEMORY_PEAK in needs and _kernel_version(release) < (5, 19):
            return f"needs cgroup v2 memory.peak (Linux 5.19 or later; this is {release})"
        return None

    def enable(self, needs: Collection[str]) -> None:
        """v2: pass the needed controllers down from the root (v1: nothing to do).

        Raises ``OSError`` where the kernel refuses (e.g. the root is a
        container's cgroup that holds processes itself).
        """
        if self.version == 1:
            return
        control = self.root / "cgroup.subtree_control"
        enabled = _words(control)
        for controller in sorted({MEMORY if n == MEMORY_PEAK else n for n in needs}):
            if controller not in enabled:
                # one controller a write: the kernel rejects the whole line otherwise
                with control.open("a") as f:
                    f.write(f"+{controller}\n")

    def create(
        self,
        name: str,
        made: list[Path],
        *,
        cpu_quota_us: int | None = None,
        memory_limit_bytes: int | None = None,
    ) -> tuple[Path, ...]:
        """Make ``name``'s groups with these limits; the directories a process must join.

        Only what is asked for is made. Each directory is appended to ``made``
        as soon as it exists, so the caller can remove it (``rmdir``) even if
        a later step fails.
        """
        first = len(made)
        if self.version == 1:
            if cpu_quota_us is not None:
                cpu = _mkdir(self.root / "cpu" / name, made)
                (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(cpu_quota_us))
            if memory_limit_bytes is not None:
                memory = _mkdir(self.root / "memory" / name, made)
                (memory / "memory.limit_in_bytes").write_text(str(memory_limit_bytes))
            return tuple(made[first:])
        if cpu_quota_us is None and memory_limit_bytes is None:
            return ()
        needs = [CPU] * (cpu_quota_us is not None) + [MEMORY] * (memory_limit_bytes is not None)
        self.enable(needs)
        group = _mkdir(self.root / name, made)
        if cpu_quota_us is not None:
            (group / "cpu.max").write_text(f"{cpu_quota_us} {PERIOD_US}")
        if memory_limit_bytes is not None:
            (group / "memory.max").write_text(str(memory_limit_bytes))
        return tuple(made[first:])

    def memory_peak_bytes(self, groups: Collection[Path]) -> int:
        """The most memory the processes in ``groups`` ever used together."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        for group in groups:
            if (group / name).exists():
                return int((group / name).read_text().strip())
        raise FileNotFoundError(f"no {name} in any of {sorted(map(str, groups))}")


def detect(root: Path = CGROUP_ROOT) -> Hierarchy | None:
    """The hierarchy mounted at ``root``, or None where there is none."""
    if (root / "cgroup.controllers").exists():
        return Hierarchy(2, root)
    if (root / "cpu").is_dir() or (root / "memory").is_dir():
        return Hierarchy(1, root)
    return None


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of a kernel release string such as ``6.8.0-45-generic``."""
    parts = release.split("-")[0].split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return (0, 0)


def _mkdir(path: Path, made: list[Path]) -> Path:
    path.mkdir()
    made.append(path)
    return path


__all__ = ["CGROUP_ROOT", "CPU", "MEMORY", "MEMORY_PEAK", "PERIOD_US", "Hierarchy", "detect"]
