"""A replica placed by demand takes load under the default objective, and goes back
to the pool once its model is idle (issue 49, item 1).

One ``run_models`` serves two tiny synthetic models (real libp2p hosts, data
plane and weights) under the default ``latency`` objective, with one member's
share left in the node's pool. Requests for B over the HTTP API pass the
policy's bar: the node starts a replica member of B, B's plan gains a second
pipeline on it, and concurrent requests for B are served by both members, each
answer equal to its single-process reference. When B's requests leave the
window (the request counter's clock is moved past it: no wall-clock wait) and
its members announce no sessions, the replica goes back to the pool after
``shrink_after`` idle rounds: B is on one pipeline again and still answers its
reference's tokens. A, idle throughout, keeps its plan.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import trio

from hetmesh.node.config import ServingConfig
from hetmesh.node.models import ModelMembers, run_models
from hetmesh.node.placer import RecentRequests
from hetmesh.scheduler.model_placement import PlacementPolicy
from tests.integration.node.inprocess_mesh import (
    free_port,
    node_config,
    stage_servers,
    until,
)
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model]

NEW_TOKENS = 48
SHARE = 512 << 20  # each member's memory: the whole of a tiny model
WINDOW_S = 600.0  # a request counts for ten minutes of the counter's clock
PROMPTS = [[1, 504 + 37 * i, 3458 - 11 * i, 282, 1029, 314, 253] for i in range(4)]


class Clock:
    """The monotonic clock, moved forward by ``skip`` (the requests' window passes)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def skip(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture(scope="module")
def model_dirs(default_model_dir: Path) -> list[Path]:
    from hetmesh.partition.store import resolve_model

    return [resolve_model("synth-tiny"), resolve_model("synth-tiny-qwen2")]


def pipelines(members: ModelMembers, key: str) -> int:
    plan = members.nodes[key].serving.plan
    return len(plan.pipelines) if plan is not None else 0


def replica_tokens(members: ModelMembers, key: str) -> int:
    """Tokens the stages of ``key``'s replica members have computed."""
    nodes = list(members.replicas.get(key, []))
    return sum(s.statistics().tokens for s in stage_servers(nodes))


async def complete(http: httpx.AsyncClient, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


async def test_a_demand_replica_takes_load_under_latency_and_goes_back_when_idle(
    tmp_path: Path, model_dirs: list[Path]
) -> None:
    serving = ServingConfig(max_context_tokens=256, block_step_s=0.0005)  # latency
    assert serving.objective == "latency"
    port = free_port()
    config = node_config(tmp_path, "node", serving, memory_bytes=3 * SHARE, api_port=port)
    a_dir, b_dir = model_dirs
    a, b = a_dir.name, b_dir.name
    expected = [reference_ids(b_dir, p, NEW_TOKENS) for p in PROMPTS]
    clock = Clock()
    policy = PlacementPolicy(grow_at=3, shrink_after=3, interval_s=0.2, window_s=WINDOW_S)
    async with trio.open_nursery() as nursery:
        members: ModelMembers = await nursery.start(
            lambda task_status: run_models(
                config,
                [str(a_dir), str(b_dir)],
                {str(a_dir): SHARE, str(b_dir): SHARE},
                placement=policy,
                requests=RecentRequests(clock),
                task_status=task_status,
            )
        )
        try:
            await until(lambda: members.nodes[a].serving.ready(), 180, "A ready")
            await until(lambda: members.nodes[b].serving.ready(), 180, "B ready")
            a_epoch = members.nodes[a].serving.plan.epoch
            assert (members.members_of(a), members.members_of(b), pipelines(members, b)) == (
                1,
                1,
                1,
            )
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
                for prompt in PROMPTS[:3]:  # B's demand: 3 requests per member
                    await complete(http, b, prompt)
                await until(lambda: members.members_of(b) == 2, 180, "a replica of B")
                await until(lambda: pipelines(members, b) == 2, 180, "B on two pipelines")

                # concurrent requests for B: the replica's pipeline serves some of them
                answers: dict[int, list[int]] = {}

                async def one(i: int) -> None:
                    answers[i] = await complete(http, b, PROMPTS[i])

                with trio.fail_after(300):
                    while replica_tokens(members, b) == 0:
                        async with trio.open_nursery() as burst:
                            for i in range(len(PROMPTS)):
                                burst.start_soon(one, i)
                        assert [answers[i] for i in range(len(PROMPTS))] == expected

                # B idle: its requests leave the window; the replica goes back to the pool
                clock.skip(2 * WINDOW_S)
                await until(lambda: members.members_of(b) == 1, 180, "B's replica given back")
                await until(lambda: pipelines(members, b) == 1, 180, "B on one pipeline")
                assert await complete(http, b, PROMPTS[0]) == expected[0]
            assert members.members_of(a) == 1, members.replicas
            assert members.nodes[a].serving.plan.epoch == a_epoch  # A never re-planned
        finally:
            members.request_stop()
