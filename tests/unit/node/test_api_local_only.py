"""An API without a key answers its own machine only: no other site's page can drive it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from hetmesh.node.api_serve import serve_http
from tests.unit.node.test_api import MODEL, FakeBackend

BODY = {"model": MODEL, "prompt": "one two", "max_tokens": 2}


@pytest.fixture
async def local(nursery: trio.Nursery) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend, int]]:
    backend = FakeBackend()
    url = await nursery.start(lambda task_status: serve_http(backend, task_status=task_status))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        yield http, backend, int(url.rsplit(":", 1)[1])


async def test_its_own_names_and_origins_are_served(
    local: tuple[httpx.AsyncClient, FakeBackend, int],
) -> None:
    http, _, port = local
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert (await http.get("/v1/models", headers={"Host": host})).status_code == 200, host
    for origin in (f"http://localhost:{port}", f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
        reply = await http.post("/v1/completions", json=BODY, headers={"Origin": origin})
        assert reply.status_code == 200, (origin, reply.text)


@pytest.mark.parametrize(
    "headers",
    [
        {"Host": "evil.example"},  # DNS rebinding: a name of the page's own
        {"Host": "evil.example:{port}"},
        {"Host": "127.0.0.1:1"},  # another port
        {"Origin": "http://evil.example"},  # a cross-site request
        {"Origin": "http://localhost:3000"},  # another local site
        {"Origin": "null"},  # a sandboxed page or a file
    ],
)
async def test_a_foreign_host_or_origin_is_refused_with_403(
    local: tuple[httpx.AsyncClient, FakeBackend, int], headers: dict[str, str]
) -> None:
    http, backend, port = local
    headers = {k: v.format(port=port) for k, v in headers.items()}
    for reply in (
        await http.post("/v1/completions", json=BODY, headers=headers),
        await http.get("/v1/hetmesh/status", headers=headers),
    ):
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"]["code"] == "foreign_origin"
        assert "refused" in reply.text or "not this API's" in reply.text
    assert backend.encoded == 0
    assert (await http.post("/v1/completions", json=BODY)).status_code == 200  # still serving


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_not_sent_as_json_is_refused_with_415(
    local: tuple[httpx.AsyncClient, FakeBackend, int], content_type: str | None
) -> None:
    """A page may post text/plain or a form cross-site without asking (no preflight);
    its body is JSON text all the same. Refused before it is read."""
    http, backend, _ = local
    headers = {"Content-Type": content_type} if content_type else {}
    reply = await http.post("/v1/completions", content=json.dumps(BODY).encode(), headers=headers)
    assert reply.status_code == 415, reply.text
    assert "application/json" in reply.json()["error"]["message"]
    assert backend.encoded == 0
    ok = {"Content-Type": "application/json; charset=utf-8"}
    reply = await http.post("/v1/completions", content=json.dumps(BODY).encode(), headers=ok)
    assert reply.status_code == 200
