"""The API over a scripted backend (LogprobsBackend), for the logprobs and
structured-output tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from hetmesh.node.api_serve import serve_http
from tests.unit.node.test_api_logprobs import LogprobsBackend


@pytest.fixture
async def api(nursery: trio.Nursery) -> AsyncIterator[tuple[httpx.AsyncClient, LogprobsBackend]]:
    backend = LogprobsBackend()
    url = await nursery.start(lambda task_status: serve_http(backend, task_status=task_status))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        yield http, backend
