"""The memory a node really uses, beside what the plan charged it (issue 42, item 4).

``in use``: the resident set of this process, or — where the node runs in a
cgroup of its own with a memory limit (``bench/hetero.py``'s hosts, a
container) — that cgroup's usage (``memory.current`` / ``memory.usage_in_bytes``,
page cache of the weights included), which is what the limit is enforced on. A
cgroup shared with other processes (a login session, a CI runner) says nothing
about this node: then the resident set.

``charged``: the adopted plan's ``memory_bytes`` of the stages it gives this
node (weights + KV budget + workspace + reserve, see
:class:`~hetmesh.scheduler.cost.CostModel`); ``runtime``: the most the process
used while it held no stage (the interpreter, torch, libp2p, the tokenizer, the
calibration's leftovers), which the plan does not charge.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil

from hetmesh.resources import DeviceProfile, PeerId
from hetmesh.scheduler.records import Plan

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class MemoryInUse:
    bytes: int
    source: str  # "rss" or "cgroup"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup(root: Path, proc_cgroup: str) -> tuple[Path, str] | None:
    """This process's memory cgroup folder and its version ("v1"/"v2"), if it is not
    the root one and is visible here."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    for path, base, version in ((v1, root / "memory", "v1"), (v2, root, "v2")):
        if path is None or path in ("", "/"):
            continue
        folder = base / path.lstrip("/")
        if folder.is_dir():
            return folder, version
    return None


def cgroup_usage(
    root: Path = CGROUP_ROOT, proc_cgroup: str | None = None, pids: set[int] | None = None
) -> int | None:
    """The usage of this process's memory cgroup, where the cgroup is its own (no
    process outside ``pids``, default this one and its children) and has a limit;
    None otherwise."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    found = _own_cgroup(root, proc_cgroup)
    if found is None:
        return None
    folder, version = found
    limit = _read(folder / ("memory.max" if version == "v2" else "memory.limit_in_bytes"))
    if limit is None or limit == "max" or int(limit) >= 1 << 60:
        return None
    procs = _read(folder / "cgroup.procs")
    if procs is None:
        return None
    if pids is None:
        me = psutil.Process(os.getpid())
        pids = {me.pid, *(c.pid for c in me.children(recursive=True))}
    if not {int(p) for p in procs.split()} <= pids:
        return None
    usage = _read(folder / ("memory.current" if version == "v2" else "memory.usage_in_bytes"))
    return int(usage) if usage else None


def memory_in_use() -> MemoryInUse:
    """What this node uses now (see the module docstring)."""
    usage = cgroup_usage()
    if usage is not None:
        return MemoryInUse(usage, "cgroup")
    return MemoryInUse(int(psutil.Process(os.getpid()).memory_info().rss), "rss")


def charged_bytes(plan: Plan | None, peer_id: PeerId) -> int:
    """What ``plan`` charges ``peer_id``: the memory of each distinct stage it holds."""
    if plan is None:
        return 0
    stages = {
        (s.device, s.start, s.end): s.memory_bytes
        for p in plan.pipelines
        for s in p.stages
        if s.peer_id == peer_id
    }
    return sum(stages.values())


def offered_cap(max_memory_bytes: int | None, beside_plan_bytes: int) -> int | None:
    """The memory cap a node offers the planner: its ``--max-memory`` less what it
    holds beside the plan's stages (a draft model at its gateway: weights and open
    sessions' KV), so a stage that no longer fits is not placed here. Without a cap
    (None) the machine's available memory already counts what the process holds."""
    if max_memory_bytes is None:
        return None
    return max(0, max_memory_bytes - max(0, beside_plan_bytes))


K = TypeVar("K")


def device_capacity(devices: Iterable[DeviceProfile], peer_id: PeerId, device: str) -> int | None:
    """The memory ``peer_id`` offers the planner on ``device`` (its announced
    ``memory_total_bytes``: the machine's, or its ``--max-memory`` cap); None if unknown."""
    for d in devices:
        if d.peer_id == peer_id and d.device == device:
            return d.memory_total_bytes
    return None


def must_release_first(
    charges: Mapping[K, int], held: Set[K], mine: Set[K], key: K, capacity: int | None
) -> bool:
    """Whether stage ``key`` may load only once the stages this node holds (or is still
    loading) that the plan no longer gives it are gone.

    The planner plans each node on its whole memory (what our own stages hold is
    ours to use), so a re-plan that moves a node from one stage to another assumes
    the old one is released; a node keeping the old stage serving until the new one
    is loaded holds both at once. Where the plan's ``charges`` of ``held`` and of
    ``key`` together exceed ``capacity``, that is an OOM kill (issue 43: a successor
    coordinator's plan told a 2 GiB host still loading ``[11, 23)`` to load
    ``[0, 11)``). Held stages the plan still gives us never make a load wait: the
    plan fits them with ``key``. Unknown ``capacity``: no waiting (as before).
    """
    if capacity is None:
        return False
    others = set(held) - {key}
    if not others - set(mine):
        return False
    return sum(charges.get(k, 0) for k in others) + charges.get(key, 0) > capacity


MEMORY_KEY = "memory"  # the announcement's extra entry (hetmesh status, the dashboard)
_MIB = 1 << 20


class MemoryReport:
    """What a node announces under :data:`MEMORY_KEY`: ``in_use`` (bytes), ``source``
    ("rss"/"cgroup"), ``charged`` (the plan's charge), ``runtime`` (before any stage).

    A new entry only when the charge changes or the use moves by more than
    ``threshold`` (a record version per wiggle of the allocator would be gossip)."""

    def __init__(self, runtime: int, threshold: float = 0.02) -> None:
        self.runtime = runtime
        self._threshold = threshold
        self._last: dict[str, int | str] | None = None

    def update(self, used: MemoryInUse, charged: int) -> dict[str, int | str] | None:
        """The entry to announce now, or None to keep the last one."""
        last = self._last
        kept = (self.runtime // _MIB * _MIB, charged, used.source)
        if last is not None and (last["runtime"], last["charged"], last["source"]) == kept:
            before = int(last["in_use"])
            if abs(used.bytes - before) <= max(8 * _MIB, self._threshold * before):
                return None
        self._last = {
            "in_use": used.bytes // _MIB * _MIB,
            "source": used.source,
            "charged": charged,
            "runtime": self.runtime // _MIB * _MIB,
        }
        return dict(self._last)


__all__ = [
    "MEMORY_KEY",
    "MemoryInUse",
    "MemoryReport",
    "cgroup_usage",
    "charged_bytes",
    "device_capacity",
    "memory_in_use",
    "must_release_first",
    "offered_cap",
]
