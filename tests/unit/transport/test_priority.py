"""HETMESH_CONTROL_NICE: trio's thread nicer than the data path (real threads, Linux)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from hetmesh.transport import priority

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}

    def run() -> None:
        out["value"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out["value"]


def test_the_setting_is_bounded_and_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(priority.CONTROL_NICE_ENV, raising=False)
    assert priority.control_nice() == 0
    for raw, want in (("5", 5), ("40", 19), ("-3", 0), ("x", 0)):
        monkeypatch.setenv(priority.CONTROL_NICE_ENV, raw)
        assert priority.control_nice() == want
    monkeypatch.setenv(priority.CONTROL_NICE_ENV, "0")
    monkeypatch.setattr(priority, "_base", None)
    assert _in_thread(priority.nice_control_thread) is None  # off: nothing changes
    assert priority._base is None


def test_the_control_thread_is_nicer_and_its_data_path_threads_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(priority.CONTROL_NICE_ENV, "4")
    monkeypatch.setattr(priority, "_base", None)
    base = _nice()
    if base + 4 > priority.MAX_NICE:
        pytest.skip("this process is too nice already")

    def control() -> tuple[int | None, int, int, int]:
        got = priority.nice_control_thread()  # on "trio's" thread
        now = _nice()

        def data_path() -> tuple[int, int]:
            inherited = _nice()  # a new thread takes its creator's nice
            priority.data_path_thread()
            return inherited, _nice()

        inherited, after = _in_thread(data_path)
        return got, now, inherited, after

    got, now, inherited, after = _in_thread(control)
    assert got == now == base + 4
    assert inherited == base + 4
    may_lower = os.geteuid() == 0  # root may lower a nice again (or CAP_SYS_NICE, RLIMIT_NICE)
    if may_lower:
        assert after == base
    else:
        assert after in (base, base + 4)  # without the right it keeps trio's nice
    assert _nice() == base  # the caller's own thread is untouched
