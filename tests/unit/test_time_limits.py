"""The suite's time limits (tests/conftest.py): a hung test fails with its stack, and the
run goes on; trio tests still run, and a hung one leaves trio usable for the next."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import PROCESS_TIMEOUT_S, SLOW_TIMEOUT_S, time_limit_s

REPO = Path(__file__).resolve().parents[2]

HANGING = """
import threading
import time

import pytest
import trio


def test_sync_hang():
    threading.Event().wait()  # blocks forever in C


async def test_trio_hang():
    await trio.sleep_forever()


async def test_trio_after_a_hang():
    await trio.sleep(0.01)


def test_sync_after_a_hang():
    pass


@pytest.mark.timeout(300)
async def test_trio_own_limit():
    await trio.sleep(0.01)
"""


@pytest.mark.timeout(180)
def test_a_hanging_test_fails_with_its_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "pytest.ini").write_text(
        textwrap.dedent(
            """
            [pytest]
            trio_mode = true
            timeout = 3
            """
        )
    )
    (tmp_path / "test_hanging.py").write_text(HANGING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=150,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "test_hanging.py::test_sync_hang FAILED" in out, out
    assert "Timeout (>3.0s) from pytest-timeout" in out
    assert "threading.Event().wait()" in out  # where it hung
    assert "test_hanging.py::test_trio_hang FAILED" in out, out
    assert "Timeout (>3s): cancelled where it waited" in out
    assert "await trio.sleep_forever()" in out
    for name in ("test_trio_after_a_hang", "test_sync_after_a_hang", "test_trio_own_limit"):
        assert f"test_hanging.py::{name} PASSED" in out, out
    assert "2 failed, 3 passed" in out


class _Marked:
    """Just enough of a test item for ``time_limit_s``: its markers."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = [m.mark for m in marks]

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.marks if m.name == name), None)


@pytest.mark.parametrize(
    ("marks", "limit_s"),
    [
        ((), 60.0),
        ((pytest.mark.slow,), SLOW_TIMEOUT_S),
        ((pytest.mark.multiprocess, pytest.mark.slow), PROCESS_TIMEOUT_S),
        ((pytest.mark.netns,), PROCESS_TIMEOUT_S),
        ((pytest.mark.model,), PROCESS_TIMEOUT_S),
        ((pytest.mark.timeout(240), pytest.mark.multiprocess), 240.0),
        ((pytest.mark.timeout(timeout=5),), 5.0),
    ],
)
def test_time_limit_by_marker(marks: tuple[pytest.MarkDecorator, ...], limit_s: float) -> None:
    assert time_limit_s(_Marked(*marks), 60.0) == limit_s  # type: ignore[arg-type]
