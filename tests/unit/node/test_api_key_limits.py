"""Completions in flight per API key (429 past the limit), beside the per-address
limit: on the real ASGI stack with the fake backend of ``test_api``."""

from __future__ import annotations

import httpx
import trio

from hetmesh.node.api import ClientPolicy
from hetmesh.node.api_serve import serve_http
from tests.unit.node.test_api import MODEL, FakeBackend

KEY = "s3cret"
BODY = {"model": MODEL, "prompt": "one two", "max_tokens": 3, "stream": True}


async def _serve(nursery: trio.Nursery, backend: FakeBackend, api_key: str | None) -> str:
    # loopback addresses are not limited: only the key's limit can refuse these
    policy = ClientPolicy(max_requests_per_client=1, max_requests_per_key=2)
    url: str = await nursery.start(
        lambda task_status: serve_http(
            backend, api_key=api_key, policy=policy, task_status=task_status
        )
    )
    backend.first_token_free = True
    backend.step = trio.Event()  # streams hold after their first token
    return url


async def test_each_api_key_has_a_bounded_number_of_requests_in_flight() -> None:
    backend = FakeBackend()
    headers = {"authorization": f"Bearer {KEY}"}
    async with trio.open_nursery() as nursery:
        url = await _serve(nursery, backend, KEY)
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
            async with (
                http.stream("POST", "/v1/completions", json=BODY) as first,
                http.stream("POST", "/v1/completions", json=BODY) as second,
            ):
                assert first.status_code == second.status_code == 200
                third = await http.post("/v1/completions", json={**BODY, "stream": False})
                assert third.status_code == 429
                error = third.json()["error"]
                assert error["code"] == "too_many_requests"
                assert "API key already has 2 requests in flight" in error["message"]
                assert error["hetmesh_error"] == "Rejected"
                backend.step.set()
                for reply in (first, second):
                    assert "[DONE]" in "".join([t async for t in reply.aiter_text()])
            for _ in range(3):  # the key's slots are free again
                reply = await http.post("/v1/completions", json={**BODY, "stream": False})
                assert reply.status_code == 200
        nursery.cancel_scope.cancel()


async def test_without_an_api_key_only_addresses_are_limited() -> None:
    backend = FakeBackend()
    async with trio.open_nursery() as nursery:
        url = await _serve(nursery, backend, None)
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=BODY) as first,
            http.stream("POST", "/v1/completions", json=BODY) as second,
        ):
            third = await http.post("/v1/completions", json={**BODY, "max_tokens": 1})
            assert (first.status_code, second.status_code) == (200, 200)
            assert third.status_code == 200  # only the first token: it needs no step
            backend.step.set()
        nursery.cancel_scope.cancel()
