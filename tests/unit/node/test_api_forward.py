"""A request for a model another node serves is forwarded to that node's API
(:mod:`hetmesh.node.api_forward`): two real HTTP APIs over fake backends, and the
pure reading of the peers' announced APIs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from hetmesh.node.api_forward import (
    API_KEY,
    FORWARDED_HEADER,
    api_entry,
    api_targets,
    forward_token,
)
from hetmesh.node.api_serve import serve_http
from tests.unit.node.test_api import MODEL, FakeBackend

OTHER = "other-model"


class OtherBackend(FakeBackend):
    """A node serving only OTHER."""

    def models(self) -> list[str]:
        return [OTHER]


@pytest.fixture
async def pair(
    nursery: trio.Nursery,
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend, OtherBackend, str]]:
    """``here`` serves MODEL and knows ``there`` (OTHER) from the mesh."""
    here, there = FakeBackend(), OtherBackend()
    there_url = await nursery.start(lambda task_status: serve_http(there, task_status=task_status))
    here_url = await nursery.start(lambda task_status: serve_http(here, task_status=task_status))
    here.remotes = {OTHER: [there_url]}
    async with httpx.AsyncClient(base_url=here_url, timeout=10) as http:
        yield http, here, there, there_url


async def test_a_model_only_a_peer_serves_is_answered_through_it(
    pair: tuple[httpx.AsyncClient, FakeBackend, OtherBackend, str],
) -> None:
    http, here, there, _ = pair
    listed = (await http.get("/v1/models")).json()
    assert [m["id"] for m in listed["data"]] == [MODEL, OTHER]
    body = {"model": OTHER, "prompt": "one two three", "max_tokens": 3}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == OTHER
    assert reply.json()["choices"][0]["text"] == " t0 t1 t2."
    assert (here.encoded, there.encoded) == (0, 1)  # the peer tokenised and generated it
    # its own model stays here
    mine = await http.post("/v1/completions", json={**body, "model": MODEL})
    assert mine.json()["model"] == MODEL
    assert (here.encoded, there.encoded) == (1, 1)


async def test_a_forwarded_stream_arrives_event_by_event(
    pair: tuple[httpx.AsyncClient, FakeBackend, OtherBackend, str],
) -> None:
    http, _, there, _ = pair
    body = {
        "model": OTHER,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    chunks = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " t0 t1 t2 t3."
    assert {c["model"] for c in chunks} == {OTHER}
    assert there.encoded == 1


async def test_errors_come_back_as_the_peer_gave_them_and_nothing_loops(
    pair: tuple[httpx.AsyncClient, FakeBackend, OtherBackend, str],
) -> None:
    http, here, _, there_url = pair
    # the peer refuses a bad parameter: its 400, relayed
    bad = {"model": OTHER, "prompt": "x", "max_tokens": -1}
    reply = await http.post("/v1/completions", json=bad)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_tokens"
    # an already forwarded request is never forwarded again: 404 here
    headers = {FORWARDED_HEADER: "1"}
    body = {"model": OTHER, "prompt": "x", "max_tokens": 1}
    reply = await http.post("/v1/completions", json=body, headers=headers)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
    # a peer that no longer answers: 503, and the node keeps serving
    here.remotes = {OTHER: ["http://127.0.0.1:9"]}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "model_unreachable"
    # the next peer in the list is tried
    here.remotes = {OTHER: ["http://127.0.0.1:9", there_url]}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    assert (await http.get("/health")).status_code == 200


def test_api_targets_read_each_peers_announced_api() -> None:
    addrs = ("/ip4/10.0.0.7/tcp/4001/p2p/QmX",)
    found = api_targets(
        [
            ("a", {API_KEY: api_entry("0.0.0.0", 8000)}, addrs),  # wildcard: its address
            ("a", {API_KEY: api_entry("10.0.0.7", 8001)}, addrs),
            ("a", {API_KEY: api_entry("192.168.1.2", 8004)}, addrs),  # not its address
            ("a", {API_KEY: api_entry("metadata.internal", 80)}, addrs),  # a name
            ("b", {API_KEY: api_entry("::", 8002)}, ("/ip6/fe80::1/tcp/1",)),
            ("c", {}, addrs),  # no API: not a target
            ("", {API_KEY: api_entry("10.0.0.9", 8003)}, addrs),  # serves nothing
            ("d", {API_KEY: {"port": "80"}}, addrs),  # malformed: ignored
            ("e", {API_KEY: {"port": 80}}, ()),  # no host and no address
        ]
    )
    assert found == {
        "a": ["http://10.0.0.7:8000", "http://10.0.0.7:8001"],
        "b": ["http://[fe80::1]:8002"],
    }


async def test_a_forwarded_request_presents_the_mesh_token_never_the_clients_key(
    nursery: trio.Nursery,
) -> None:
    """Two keyed nodes with different client keys: ``here`` forwards with the token
    derived from the mesh secret, which ``there`` accepts on a forwarded completion
    only: not on another route, not without the forwarded mark, not from a node of
    another mesh."""
    token = forward_token("mesh secret")
    assert token is not None
    assert token == forward_token("mesh secret")
    assert token != forward_token("another mesh")
    assert forward_token(None) is None
    here, there = FakeBackend(), OtherBackend()

    async def start(backend: FakeBackend, key: str, token: str | None) -> str:
        url: str = await nursery.start(
            lambda task_status: serve_http(
                backend, api_key=key, forward_token=token, task_status=task_status
            )
        )
        return url

    there_url = await start(there, "there's client key", token)
    here_url = await start(here, "here's client key", token)
    here.remotes = {OTHER: [there_url]}
    body = {"model": OTHER, "prompt": "one two three", "max_tokens": 3}
    mine = {"authorization": "Bearer here's client key"}
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await http.post(here_url + "/v1/completions", json=body, headers=mine)
        assert reply.status_code == 200, reply.text  # there never saw here's client key
        assert there.encoded == 1
        # the token is no key: not without the mark, not for other routes
        as_peer = {"authorization": f"Bearer {token}"}
        marked = {**as_peer, FORWARDED_HEADER: "1"}
        plain = await http.post(there_url + "/v1/completions", json=body, headers=as_peer)
        assert plain.status_code == 401
        status = await http.get(there_url + "/v1/hetmesh/status", headers=marked)
        assert status.status_code == 401
        assert (await http.get(there_url + "/v1/models", headers=marked)).status_code == 401
        direct = await http.post(there_url + "/v1/completions", json=body, headers=marked)
        assert direct.status_code == 200
        # a node of another mesh cannot forward here
        here.remotes = {}
        stranger = {"authorization": f"Bearer {forward_token('another mesh')}"}
        refused = await http.post(
            there_url + "/v1/completions", json=body, headers={**stranger, FORWARDED_HEADER: "1"}
        )
        assert refused.status_code == 401
        assert there.encoded == 2
