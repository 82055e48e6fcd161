"""The memory a node announces (hetmesh.node.memory): its own cgroup's usage or its
RSS, beside what the plan charged it; and how ``hetmesh status`` shows it."""

from __future__ import annotations

import os
from pathlib import Path

from hetmesh.cli.status import memory_texts
from hetmesh.node.memory import (
    MemoryInUse,
    MemoryReport,
    cgroup_usage,
    charged_bytes,
    memory_in_use,
)
from hetmesh.scheduler.records import Pipeline, Plan, Stage

MIB = 1 << 20


def cgroup(root: Path, version: str, path: str, *, limit: str, procs: list[int], usage: int) -> str:
    """A fake cgroup tree under ``root``; returns the /proc/self/cgroup text for it."""
    if version == "v2":
        folder = root / path.lstrip("/")
        folder.mkdir(parents=True)
        (folder / "memory.max").write_text(limit + "\n")
        (folder / "memory.current").write_text(f"{usage}\n")
        text = f"0::{path}\n"
    else:
        folder = root / "memory" / path.lstrip("/")
        folder.mkdir(parents=True)
        (folder / "memory.limit_in_bytes").write_text(limit + "\n")
        (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
        text = f"4:memory:{path}\n1:cpu:/\n"
    (folder / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    return text


def test_the_usage_of_a_limited_cgroup_of_its_own_counts(tmp_path: Path) -> None:
    for version in ("v2", "v1"):
        root = tmp_path / version
        text = cgroup(root, version, "/hosts/a", limit=str(600 * MIB), procs=[41, 42], usage=7)
        assert cgroup_usage(root, text, pids={41, 42, 43}) == 7


def test_a_shared_unlimited_or_root_cgroup_says_nothing_of_the_node(tmp_path: Path) -> None:
    text = cgroup(tmp_path / "a", "v2", "/session", limit=str(MIB), procs=[41, 99], usage=7)
    assert cgroup_usage(tmp_path / "a", text, pids={41}) is None  # 99 is not ours
    text = cgroup(tmp_path / "b", "v2", "/free", limit="max", procs=[41], usage=7)
    assert cgroup_usage(tmp_path / "b", text, pids={41}) is None  # no limit
    text = cgroup(tmp_path / "c", "v1", "/big", limit=str(1 << 62), procs=[41], usage=7)
    assert cgroup_usage(tmp_path / "c", text, pids={41}) is None  # v1's "no limit"
    assert cgroup_usage(tmp_path, "0::/\n", pids={41}) is None  # the root cgroup
    assert cgroup_usage(tmp_path, "0::/not/here\n", pids={41}) is None  # not visible


def test_this_process_reports_a_real_resident_set() -> None:
    used = memory_in_use()
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    rss_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    if used.source == "rss":
        assert abs(used.bytes - rss_kib * 1024) < 64 * MIB
    assert used.bytes > 16 * MIB  # an interpreter with torch's deps: never nothing


def _stage(peer: str, start: int, end: int, memory: int) -> Stage:
    return Stage(
        peer_id=peer,
        device="cpu",
        start=start,
        end=end,
        decode_step_s=0.01,
        batch_step_s=0.01,
        prefill_s_per_1k=0.1,
        link_out_s=0.0,
        memory_bytes=memory,
    )


def test_the_charge_is_each_distinct_stage_of_the_node_once() -> None:
    def pipeline(*stages: Stage) -> Pipeline:
        return Pipeline(
            stages=stages,
            decode_latency_s=0.03,
            prefill_s_per_1k=0.3,
            bottleneck_s=0.01,
            throughput_tps=10.0,
        )

    shared = _stage("a", 0, 10, 100)  # in both pipelines: held once
    plan = Plan(
        epoch=1,
        model_name="m",
        objective="latency",
        strategy="exact",
        pipelines=(
            pipeline(shared, _stage("b", 10, 32, 300)),
            pipeline(shared, _stage("a", 10, 32, 250)),
        ),
        objective_value=0.03,
        decode_latency_s=0.03,
        prefill_s_per_1k=0.3,
        throughput_tps=20.0,
    )
    assert charged_bytes(plan, "a") == 350
    assert charged_bytes(plan, "b") == 300
    assert charged_bytes(plan, "c") == 0
    assert charged_bytes(None, "a") == 0


def test_a_report_is_new_only_when_the_charge_or_the_use_moves() -> None:
    report = MemoryReport(runtime=400 * MIB + 5)
    first = report.update(MemoryInUse(500 * MIB + 123, "rss"), 200 * MIB)
    assert first == {
        "in_use": 500 * MIB,
        "source": "rss",
        "charged": 200 * MIB,
        "runtime": 400 * MIB,
    }
    assert report.update(MemoryInUse(505 * MIB, "rss"), 200 * MIB) is None  # a wiggle
    moved = report.update(MemoryInUse(540 * MIB, "rss"), 200 * MIB)
    assert moved is not None
    assert moved["in_use"] == 540 * MIB
    recharged = report.update(MemoryInUse(540 * MIB, "rss"), 300 * MIB)
    assert recharged is not None
    assert recharged["charged"] == 300 * MIB


def test_status_shows_the_memory_in_use_beside_the_charge() -> None:
    record = {
        "extra": {
            "memory": {
                "in_use": 612 * MIB,
                "source": "cgroup",
                "charged": 215 * MIB,
                "runtime": 401 * MIB,
            }
        }
    }
    used, charged = memory_texts(record, [])
    assert used == "612.0 MiB (cgroup)"
    assert charged == "215.0 MiB + 401.0 MiB runtime"
    # a node announcing none: its devices' total less free, as before
    devices = [{"memory_total_bytes": 300 * MIB, "memory_free_bytes": 100 * MIB}]
    assert memory_texts({"extra": {}}, devices) == ("200.0 MiB", "-")


def test_a_move_releases_first_only_when_old_and_new_would_not_fit_together() -> None:
    from hetmesh.node.memory import must_release_first

    charges = {(0, 11): 1700, (11, 23): 1700, (23, 34): 300}
    old, new = (11, 23), (0, 11)
    # the successor's plan of issue 43: still holding [11, 23), told to load [0, 11)
    assert must_release_first(charges, {old, new}, {new}, new, 2048)
    assert not must_release_first(charges, {old, new}, {new}, new, 4096)  # room for both
    assert not must_release_first(charges, {old, new}, {new}, new, None)  # offer unknown
    # a stage the plan still gives us never makes a load wait (the plan fits them)
    assert not must_release_first(charges, {old, new}, {old, new}, new, 2048)
    # nothing else held: nothing to wait for
    assert not must_release_first(charges, {new}, {new}, new, 1000)
    # a small leftover beside the new stage fits
    assert not must_release_first(charges, {(23, 34), new}, {new}, new, 2048)


def test_the_capacity_is_the_peers_own_devices_offer() -> None:
    from hetmesh.node.memory import device_capacity
    from hetmesh.resources import DeviceProfile

    def device(peer: str, name: str, total: int) -> DeviceProfile:
        return DeviceProfile(
            peer_id=peer,
            device=name,
            backend="cpu",
            name=name,
            memory_total_bytes=total,
            memory_free_bytes=total,
            matmul_flops=1e9,
            memory_bandwidth_bps=1e9,
        )

    devices = [device("b", "cpu", 7), device("a", "cuda:0", 5), device("a", "cpu", 3)]
    assert device_capacity(devices, "a", "cpu") == 3
    assert device_capacity(devices, "a", "mps") is None
