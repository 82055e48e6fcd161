"""Whether a test failed, for fixtures that print their nodes' logs when it did.

``pytest_runtest_makereport`` in tests/integration/conftest.py keeps each test's
call report on its item as ``rep_call``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def call_failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test ``request`` serves failed (read in a fixture's teardown)."""
    report = getattr(request.node, "rep_call", None)
    return report is not None and bool(report.failed)


def print_logs_if_failed(request: pytest.FixtureRequest, nodes: Iterable[Any]) -> None:
    """After a failed test, each node's log tail (``node.log()``), named by its ``host``
    or ``peer_id``: pytest shows it with the failure."""
    if not call_failed(request):
        return
    for node in nodes:
        name = getattr(node, "host", None) or getattr(node, "peer_id", "?")
        print(f"--- {name} ---\n{node.log()[-6000:]}")
