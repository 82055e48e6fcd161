"""Fixtures shared by integration test files (see tests/integration/shared_mesh.py)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.integration.api.api_mesh import Mesh
from tests.integration.shared_mesh import SHARED

SHARED_FIXTURE = "shared_mesh3"


@pytest.fixture
def shared_mesh3(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Mesh:
    """Three nodes serving the default model, the first with the HTTP API (``api_url``).

    Shared by consecutive tests: never kill, restart or reconfigure its nodes.
    """
    return SHARED.get(tmp_path_factory.mktemp("shared-mesh3"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    # the last test in a row that uses the mesh: stop it rather than let it idle
    following = getattr(nextitem, "fixturenames", ()) if nextitem is not None else ()
    if SHARED.running and SHARED_FIXTURE not in following:
        SHARED.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    SHARED.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":  # read by tests.integration.reports
        item.rep_call = report  # type: ignore[attr-defined]
    return report
