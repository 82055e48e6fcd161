"""The shared mesh's life cycle (tests/integration/shared_mesh.py), with a fake start-up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import shared_mesh


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []

    @contextlib.contextmanager
    def fake_mesh(tmp_path: Path) -> Iterator[str]:
        if tmp_path.name == "broken":
            log.append("failed")
            raise AssertionError("the node never became ready")
        log.append(f"start {tmp_path.name}")
        try:
            yield f"mesh in {tmp_path.name}"
        finally:
            log.append(f"stop {tmp_path.name}")

    monkeypatch.setattr(shared_mesh, "running_mesh", fake_mesh)
    return log


def test_the_mesh_starts_once_for_consecutive_users_and_again_after_a_close(
    events: list[str],
) -> None:
    shared = shared_mesh.SharedMesh()
    assert not shared.running
    assert shared.get(Path("a")) == "mesh in a"
    assert shared.get(Path("b")) == "mesh in a"  # the running one, not a second
    assert shared.running
    shared.close()
    assert not shared.running
    shared.close()  # nothing left to stop
    assert shared.get(Path("c")) == "mesh in c"
    shared.close()
    assert events == ["start a", "stop a", "start c", "stop c"]


def test_a_failed_start_fails_later_users_at_once_until_closed(events: list[str]) -> None:
    shared = shared_mesh.SharedMesh()
    with pytest.raises(AssertionError, match="never became ready"):
        shared.get(Path("broken"))
    assert shared.running  # the failure is kept, so the next test does not wait again
    with pytest.raises(RuntimeError, match="failed to start earlier: AssertionError"):
        shared.get(Path("a"))
    shared.close()
    assert shared.get(Path("a")) == "mesh in a"
    shared.close()
    assert events == ["failed", "start a", "stop a"]
