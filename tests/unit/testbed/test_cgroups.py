"""The testbed's cgroup logic (hetmesh/testbed/cgroups.py) on temporary directories laid out like a
cgroup v1 or v2 hierarchy: what it writes, what it checks, what it reads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.testbed.cgroups import CPU, MEMORY, MEMORY_PEAK, Hierarchy, detect
from hetmesh.testbed.netns import unavailable_reason


def _v2(root: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def _v1(root: Path, *controllers: str) -> Path:
    files = {
        "cpu": ("cpu.cfs_quota_us", "cpu.cfs_period_us"),
        "memory": ("memory.limit_in_bytes", "memory.max_usage_in_bytes"),
    }
    for controller in controllers:
        (root / controller).mkdir(parents=True)
        for name in files[controller]:
            (root / controller / name).write_text("0\n")
    return root


def test_detect_tells_v2_from_v1_and_from_nothing(tmp_path: Path) -> None:
    assert detect(_v2(tmp_path / "unified")) == Hierarchy(2, tmp_path / "unified")
    assert detect(_v1(tmp_path / "legacy", "cpu")) == Hierarchy(1, tmp_path / "legacy")
    (tmp_path / "empty").mkdir()
    assert detect(tmp_path / "empty") is None


def test_v2_group_gets_cpu_max_and_memory_max_after_enabling_both(tmp_path: Path) -> None:
    hierarchy = Hierarchy(2, _v2(tmp_path))
    made: list[Path] = []
    groups = hierarchy.create("hmh1", made, cpu_quota_us=25_000, memory_limit_bytes=800 << 20)
    assert groups == (tmp_path / "hmh1",) == tuple(made)  # one group holds both limits
    assert (tmp_path / "hmh1" / "cpu.max").read_text() == "25000 100000"
    assert (tmp_path / "hmh1" / "memory.max").read_text() == str(800 << 20)
    # passed down from the root, one controller per write
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu\n+memory\n"


def test_v2_enables_only_what_is_not_enabled_yet(tmp_path: Path) -> None:
    root = _v2(tmp_path)
    (root / "cgroup.subtree_control").write_text("cpu\n")  # as the kernel lists them
    hierarchy = Hierarchy(2, root)
    hierarchy.create("a", [], cpu_quota_us=50_000)
    assert not (root / "a" / "memory.max").exists()
    hierarchy.create("b", [], memory_limit_bytes=1 << 30)
    assert (root / "cgroup.subtree_control").read_text() == "cpu\n+memory\n"
    assert hierarchy.create("c", []) == ()
    assert not (root / "c").exists()


def test_v1_groups_live_in_each_controller(tmp_path: Path) -> None:
    hierarchy = Hierarchy(1, _v1(tmp_path, "cpu", "memory"))
    made: list[Path] = []
    groups = hierarchy.create("hmh0", made, cpu_quota_us=50_000, memory_limit_bytes=1 << 30)
    assert groups == (tmp_path / "cpu" / "hmh0", tmp_path / "memory" / "hmh0")
    assert (tmp_path / "cpu" / "hmh0" / "cpu.cfs_quota_us").read_text() == "50000"
    assert (tmp_path / "cpu" / "hmh0" / "cpu.cfs_period_us").read_text() == "100000"
    assert (tmp_path / "memory" / "hmh0" / "memory.limit_in_bytes").read_text() == str(1 << 30)


def test_a_failed_step_still_reports_the_directory_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _v2(tmp_path)
    real_write = Path.write_text

    def refuse_memory_max(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name == "memory.max":
            raise PermissionError("the kernel said no")
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_text", refuse_memory_max)
    made: list[Path] = []
    with pytest.raises(PermissionError):
        Hierarchy(2, root).create("hmh2", made, cpu_quota_us=1000, memory_limit_bytes=1 << 30)
    assert made == [root / "hmh2"]  # so the caller's teardown removes it


def test_missing_controllers_are_named(tmp_path: Path) -> None:
    no_memory = Hierarchy(2, _v2(tmp_path / "v2", "cpu pids"))
    assert no_memory.missing([CPU]) is None
    reason = no_memory.missing([CPU, MEMORY])
    assert reason is not None
    assert "cgroup v2 memory controller" in reason
    v1_cpu_only = Hierarchy(1, _v1(tmp_path / "v1", "cpu"))
    assert v1_cpu_only.missing([CPU]) is None
    reason = v1_cpu_only.missing([CPU, MEMORY])
    assert reason is not None
    assert "cgroup v1 memory controller" in reason


@pytest.mark.parametrize(
    ("kernel", "ok"),
    [("5.15.0-91-generic", False), ("5.19.0", True), ("6.8.0-45-generic", True), ("4.4", False)],
)
def test_v2_memory_peak_needs_linux_5_19(tmp_path: Path, kernel: str, ok: bool) -> None:
    hierarchy = Hierarchy(2, _v2(tmp_path))
    reason = hierarchy.missing([MEMORY, MEMORY_PEAK], kernel=kernel)
    assert (reason is None) == ok, reason
    if not ok:
        assert reason is not None
        assert "memory.peak" in reason
        assert kernel in reason


def test_memory_peak_is_read_from_the_version_s_file(tmp_path: Path) -> None:
    v2 = Hierarchy(2, _v2(tmp_path / "v2"))
    (group,) = v2.create("h", [], memory_limit_bytes=1 << 30)
    (group / "memory.peak").write_text("123456\n")
    assert v2.memory_peak_bytes([group]) == 123456
    v1 = Hierarchy(1, _v1(tmp_path / "v1", "cpu", "memory"))
    groups = v1.create("h", [], cpu_quota_us=1000, memory_limit_bytes=1 << 30)
    (groups[1] / "memory.max_usage_in_bytes").write_text("654321\n")
    assert v1.memory_peak_bytes(groups) == 654321
    with pytest.raises(FileNotFoundError, match=r"memory\.max_usage_in_bytes"):
        v1.memory_peak_bytes(groups[:1])


def test_the_testbed_skips_with_the_missing_controller_as_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hetmesh.testbed.netns as netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(netns, "_run", lambda *argv: None)  # `ip netns add` works
    root = _v2(tmp_path / "v2", "cpu pids")
    reason = unavailable_reason(need_cgroups=True, cgroup_needs=(CPU, MEMORY), cgroup_root=root)
    assert reason is not None
    assert "cgroup v2 memory controller" in reason
    assert unavailable_reason(need_cgroups=True, cgroup_needs=(CPU,), cgroup_root=root) is None
    assert (root / "cgroup.subtree_control").read_text() == "+cpu\n"  # enabled on the way
    (tmp_path / "none").mkdir()
    reason = unavailable_reason(need_cgroups=True, cgroup_root=tmp_path / "none")
    assert reason is not None
    assert "needs cgroups" in reason
