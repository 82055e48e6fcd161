"""Two models on one mesh, from one node process (issue 49, item 1).

``run_models`` serves the default model and a tiny synthetic one, one member
each, with real libp2p hosts, the real data plane and real weights; its HTTP
API lists both and routes by ``model``. Both stream at once, each equal to its
own single-process reference; removing the synthetic model mid-stream, and
adding it back, over the API's ``/v1/hetmesh/models``, leaves the default
model's stream, plan and sessions untouched.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from rich.console import Console

from hetmesh.cli.status_view import load_table, plan_table, summarize
from hetmesh.node.config import ServingConfig
from hetmesh.node.events import Feed
from hetmesh.node.models import ModelMembers, run_models
from hetmesh.protocol.generate import SamplingParams
from tests.integration.node.inprocess_mesh import PROMPT_IDS, free_port, node_config, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model]

SYNTH = "synth-tiny"  # 4 layers of 64: the smallest synth shape, milliseconds a token
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def synth_dir(default_model_dir: Path) -> Path:
    """synth-tiny in the hetmesh cache beside the default model (its tokenizer's source),
    written once (~7 MB, under the cache's lock)."""
    from hetmesh.partition.store import resolve_model

    return resolve_model(SYNTH)


async def tokens_of(stream: AsyncGenerator[tuple[int, str], None]) -> list[int]:
    async with contextlib.aclosing(stream):
        return [t async for t, _ in stream if t >= 0]


async def test_two_models_serve_at_once_and_one_leaves_without_touching_the_other(
    tmp_path: Path, default_model_dir: Path, synth_dir: Path
) -> None:
    serving = ServingConfig(max_context_tokens=512, block_step_s=0.0005)
    port = free_port()
    config = node_config(tmp_path, "node", serving, memory_bytes=3 << 30, api_port=port)
    models = [str(default_model_dir), str(synth_dir)]
    big, small = default_model_dir.name, synth_dir.name
    expected = {
        big: reference_ids(default_model_dir, PROMPT_IDS, NEW_TOKENS),
        small: reference_ids(synth_dir, PROMPT_IDS, NEW_TOKENS),
    }
    async with trio.open_nursery() as nursery:
        members: ModelMembers = await nursery.start(
            run_models, config, models, {str(synth_dir): 512 << 20}
        )
        try:
            await run_checks(members, port, expected, big, small)
        finally:
            members.request_stop()


async def run_checks(
    members: ModelMembers,
    port: int,
    expected: dict[str, list[int]],
    big: str,
    small: str,
) -> None:
    assert list(members.nodes) == [big, small]
    nodes = members.nodes
    # one member per model, each planned by its own coordinator: a plan per model
    await until(lambda: all(n.serving.ready() for n in nodes.values()), 180, "both models ready")
    plans = {key: n.serving.plan for key, n in nodes.items()}
    assert {key: p.model_name for key, p in plans.items()} == {big: big, small: small}
    assert nodes[big].peer_id != nodes[small].peer_id
    # both members are in one mesh: each sees the other
    assert nodes[small].peer_id in {e.peer_id for e in nodes[big].discovery.alive()}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        listed = (await http.get("/v1/models")).json()
        assert sorted(m["id"] for m in listed["data"]) == sorted([big, small])
        for key in (big, small):  # routed by model: each its own model's tokens
            body = {"model": key, "prompt": "x", "max_tokens": 4, "temperature": 0}
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == key
        # status shows each model's plan and load
        view = (await http.get("/v1/hetmesh/status")).json()
    summary = summarize(view)
    shown = {m["model"]: m for m in summary["models"]}
    assert sorted(shown) == sorted([big, small])
    for key, node in nodes.items():
        assert shown[key]["plan"]["model"] == key
        assert shown[key]["peers"] == [node.peer_id]
        assert all(p["ready"] for p in shown[key]["plan"]["pipelines"])
    console = Console(record=True, width=200)
    console.print(plan_table(summary))
    console.print(load_table(summary))  # a model column beside each peer
    printed = console.export_text()
    assert f"for {big}:" in printed
    assert f"for {small}:" in printed
    assert printed.count(small) >= 3  # its plan's title, its load line, its peer's row
    # and so does the dashboard's feed: one plan per model
    feed = Feed(lambda: view)
    feed.tick()
    hello = json.loads(feed.hello().split("data: ", 1)[1])
    plans = hello["snapshot"]["plans"]
    assert {key: p["model_name"] for key, p in plans.items()} == {big: big, small: small}

    backend = members.backend()
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    got: dict[str, list[int]] = {}

    async def one(key: str) -> None:
        got[key] = await tokens_of(backend.for_model(key).stream(PROMPT_IDS, params))

    async with trio.open_nursery() as both:  # both models at once
        both.start_soon(one, big)
        both.start_soon(one, small)
    assert got == expected

    # the small model leaves (over the API) while the big one streams
    big_epoch = nodes[big].serving.plan.epoch

    async def big_stream_while(change: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
        """The big model's stream equals its reference although ``change`` ran over
        the API after its third token."""
        out: list[int] = []
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300)
        stream = backend.for_model(big).stream(PROMPT_IDS, params)
        async with http, contextlib.aclosing(stream):
            async for token, _ in stream:
                if token < 0:
                    continue
                out.append(token)
                if len(out) == 3:
                    await change(http)
        assert out == expected[big]

    async def remove(http: httpx.AsyncClient) -> None:
        removed = await http.delete(f"/v1/hetmesh/models/{small}")
        assert removed.status_code == 200, removed.text

    await big_stream_while(remove)
    assert list(members.nodes) == [big]
    gateway: Any = nodes[big].serving.gateway
    assert gateway.statistics().recoveries == 0  # no session of the big model was replayed
    assert gateway.statistics().sessions_failed == 0
    assert nodes[big].serving.plan.epoch == big_epoch  # its plan did not change
    assert backend.models() == [big]

    # and comes back (by its name) while the big one streams: planned again
    async def add(http: httpx.AsyncClient) -> None:
        body = {"model": SYNTH, "memory_bytes": 512 << 20}
        added = await http.post("/v1/hetmesh/models", json=body)
        assert added.status_code == 201, added.text
        assert added.json()["id"] == small

    await big_stream_while(add)
    assert gateway.statistics().recoveries == 0
    assert nodes[big].serving.plan.epoch == big_epoch
    await until(lambda: members.nodes[small].serving.ready(), 120, "the small model back")
    assert backend.models() == [big, small]
    assert await tokens_of(backend.for_model(small).stream(PROMPT_IDS, params)) == expected[small]
