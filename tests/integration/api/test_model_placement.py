"""Placement by demand inside a running node serving several models (issue 49).

One ``run_models`` process serves two tiny synthetic models (real libp2p hosts,
data plane and weights), A kept at two members by ``min_replicas``, with memory
left in the node's pool. Requests for B arrive over the HTTP API: B's demand per
member passes the policy's bar, the node starts a replica member of B and B's
planner re-plans onto two pipelines, while a stream of A, held open across the
change, goes on untouched (same tokens as its reference, its plan unchanged, no
session replayed). B then answers with its own reference's tokens.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from hetmesh.node.config import ServingConfig
from hetmesh.node.models import ModelMembers, run_models
from hetmesh.protocol.generate import SamplingParams
from hetmesh.scheduler.model_placement import PlacementPolicy
from tests.integration.node.inprocess_mesh import PROMPT_IDS, free_port, node_config, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model]

NEW_TOKENS = 16
SHARE = 512 << 20  # each member's memory: the whole of a tiny model


@pytest.fixture(scope="module")
def model_dirs(default_model_dir: Path) -> list[Path]:
    """synth-tiny and synth-tiny-qwen2 in the cache (the default model: their tokenizer)."""
    from hetmesh.partition.store import resolve_model

    return [resolve_model("synth-tiny"), resolve_model("synth-tiny-qwen2")]


def pipelines(members: ModelMembers, key: str) -> int:
    plan = members.nodes[key].serving.plan
    return len(plan.pipelines) if plan is not None else 0


async def test_demand_for_b_gives_b_a_replica_without_touching_a(
    tmp_path: Path, model_dirs: list[Path]
) -> None:
    # throughput: a model that fits one member is planned as one pipeline per member
    serving = ServingConfig(objective="throughput", max_context_tokens=256, block_step_s=0.0005)
    port = free_port()
    config = node_config(tmp_path, "node", serving, memory_bytes=4 * SHARE, api_port=port)
    a_dir, b_dir = model_dirs
    a, b = a_dir.name, b_dir.name
    expected = {d.name: reference_ids(d, PROMPT_IDS, NEW_TOKENS) for d in model_dirs}
    policy = PlacementPolicy(grow_at=3, shrink_after=10**6, interval_s=0.2, window_s=600)
    async with trio.open_nursery() as nursery:
        members: ModelMembers = await nursery.start(
            lambda task_status: run_models(
                config,
                [str(a_dir), str(b_dir)],
                {str(a_dir): SHARE, str(b_dir): SHARE},
                min_replicas={str(a_dir): 2},
                placement=policy,
                task_status=task_status,
            )
        )
        try:
            await run_checks(members, port, expected, a, b)
        finally:
            members.request_stop()


async def run_checks(
    members: ModelMembers, port: int, expected: dict[str, list[int]], a: str, b: str
) -> None:
    # A's minimum of two members gives it two pipelines; B starts with its one member
    assert (members.members_of(a), members.members_of(b)) == (2, 1)
    await until(lambda: pipelines(members, a) == 2, 180, "A on two pipelines")
    await until(lambda: members.nodes[b].serving.ready(), 180, "B ready")
    assert pipelines(members, b) == 1, members.nodes[b].serving.plan
    a_node = members.nodes[a]
    a_epoch = a_node.serving.plan.epoch
    backend = members.backend()
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    out: list[int] = []
    stream = backend.for_model(a).stream(PROMPT_IDS, params)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        async with contextlib.aclosing(stream):
            async for token, _ in stream:
                if token < 0:
                    continue
                out.append(token)
                if len(out) == 3:  # A's stream held open while B's demand grows
                    body = {"model": b, "prompt": PROMPT_IDS, "max_tokens": 2}
                    for _ in range(4):
                        reply = await http.post("/v1/completions", json=body)
                        assert reply.status_code == 200, reply.text
                    await until(lambda: members.members_of(b) == 2, 180, "a replica of B")
                    await until(lambda: pipelines(members, b) == 2, 180, "B on two pipelines")
        assert out == expected[a]  # A's stream: untouched
        gateway: Any = a_node.serving.gateway
        assert gateway.statistics().recoveries == 0
        assert gateway.statistics().sessions_failed == 0
        assert a_node.serving.plan.epoch == a_epoch  # A's plan did not change
        assert members.members_of(a) == 2
        # B answers on its new plan with its reference's tokens
        body = {"model": b, "prompt": PROMPT_IDS, "max_tokens": NEW_TOKENS, "temperature": 0}
        for _ in range(3):
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == expected[b]
