"""A request for a model only another node serves is forwarded there (issue 49).

Two real nodes in one mesh (real libp2p hosts, data plane and weights), each
serving one tiny synthetic model with its own HTTP API: each node's API lists
both models and answers a request for the other's, streamed or not, with the
tokens of that model's single-process reference.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import trio

from hetmesh.node.config import ServingConfig
from hetmesh.node.daemon import run_node
from hetmesh.node.runtime import Node
from tests.integration.node.inprocess_mesh import PROMPT_IDS, free_port, node_config, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model]

MODELS = ("synth-tiny", "synth-tiny-qwen2")  # milliseconds a token
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dirs(default_model_dir: Path) -> list[Path]:
    """Both synthetic models in the hetmesh cache (the default model: their tokenizer)."""
    from hetmesh.partition.store import resolve_model

    return [resolve_model(name) for name in MODELS]


async def stream_ids(http: httpx.AsyncClient, body: dict[str, object]) -> list[int]:
    ids: list[int] = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids") or []
    return ids


async def test_each_nodes_api_answers_for_the_model_only_the_other_serves(
    tmp_path: Path, model_dirs: list[Path]
) -> None:
    serving = ServingConfig(max_context_tokens=256, block_step_s=0.0005)
    ports = [free_port(), free_port()]
    expected = {d.name: reference_ids(d, PROMPT_IDS, NEW_TOKENS) for d in model_dirs}
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i, (model, port) in enumerate(zip(model_dirs, ports, strict=True)):
            config = node_config(
                tmp_path,
                f"n{i}",
                dataclasses.replace(serving, model=str(model)),
                memory_bytes=1 << 30,
                api_port=port,
                bootstrap=tuple(str(n.discovery.addrs[0]) for n in nodes),
            )
            nodes.append(await nursery.start(run_node, config))
        try:
            await until(lambda: all(n.serving.ready() for n in nodes), 180, "both ready")
            names = [n.serving.model_key for n in nodes]
            assert sorted(names) == sorted(expected)
            for i, port in enumerate(ports):
                other = names[1 - i]
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=120
                ) as http:
                    # the peer's API is in its record once announced: listed here
                    await until_listed(http, other)
                    body = {"model": other, "prompt": PROMPT_IDS, "max_tokens": NEW_TOKENS}
                    reply = await http.post("/v1/completions", json={**body, "temperature": 0})
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["model"] == other
                    assert reply.json()["choices"][0]["token_ids"] == expected[other]
                    assert await stream_ids(http, {**body, "temperature": 0}) == expected[other]
            # the other node generated them: its gateway counted the tokens, ours none
            for node in nodes:
                assert node.serving.gateway.statistics().tokens_out == 2 * NEW_TOKENS
        finally:
            for node in nodes:
                node.request_stop()


async def until_listed(http: httpx.AsyncClient, model: str) -> None:
    async def listed() -> bool:
        models = (await http.get("/v1/models")).json()["data"]
        return model in {m["id"] for m in models}

    for _ in range(300):  # the peers' records spread within a few gossip rounds
        if await listed():
            return
        await trio.sleep(0.2)
    raise AssertionError(f"{model} never listed")
