"""One node decides where demand adds a replica, for the whole mesh (issue 49, item 1).

Two ``run_models`` nodes (real libp2p hosts, data plane and weights) serve the
same two tiny synthetic models, one member each; the first has room for one
more member, the second for two. Requests for B arrive at the first node's
API only. The placement leader (the node of least id, whichever it is) reads
B's demand (the first node's announced recent requests) and orders one replica
of B from the node with the most room, the second; the first node, although
its own API saw the requests and it has room, adds none, and neither adds a
second replica once B's demand per member is under the bar. B then answers
with its single-process reference's tokens on its three members.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from hetmesh.node.config import ServingConfig
from hetmesh.node.models import ModelMembers, run_models
from hetmesh.scheduler.model_placement import PLACEMENT_KEY, PlacementPolicy
from tests.integration.node.inprocess_mesh import PROMPT_IDS, free_port, node_config, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model]

NEW_TOKENS = 16
SHARE = 512 << 20  # each member's memory: the whole of a tiny model
ROUNDS_AFTER = 15  # placement rounds both nodes run after the replica, adding nothing


@pytest.fixture(scope="module")
def model_dirs(default_model_dir: Path) -> list[Path]:
    from hetmesh.partition.store import resolve_model

    return [resolve_model("synth-tiny"), resolve_model("synth-tiny-qwen2")]


def b_members_in_plan(members: ModelMembers, key: str) -> int:
    plan = members.nodes[key].serving.plan
    if plan is None:
        return 0
    return len({s.peer_id for p in plan.pipelines for s in p.stages})


async def test_the_leader_orders_the_replica_from_the_node_with_most_room(
    tmp_path: Path, model_dirs: list[Path]
) -> None:
    serving = ServingConfig(max_context_tokens=256, block_step_s=0.0005)
    a_dir, b_dir = model_dirs
    a, b = a_dir.name, b_dir.name
    expected = reference_ids(b_dir, PROMPT_IDS, NEW_TOKENS)
    policy = PlacementPolicy(grow_at=3, shrink_after=10**6, interval_s=0.2, window_s=600)
    models = [str(a_dir), str(b_dir)]
    shares = {str(a_dir): SHARE, str(b_dir): SHARE}
    port = free_port()
    first_config = node_config(tmp_path, "n1", serving, memory_bytes=3 * SHARE, api_port=port)
    async with trio.open_nursery() as nursery:
        n1: ModelMembers = await nursery.start(
            lambda task_status: run_models(
                first_config, models, shares, placement=policy, task_status=task_status
            )
        )
        second_config = node_config(
            tmp_path,
            "n2",
            serving,
            memory_bytes=4 * SHARE,
            bootstrap=(str(n1.nodes[a].discovery.addrs[0]),),
        )
        n2: ModelMembers = await nursery.start(
            lambda task_status: run_models(
                second_config, models, shares, placement=policy, task_status=task_status
            )
        )
        try:
            await until(lambda: b_members_in_plan(n1, b) == 2, 180, "B planned on both nodes")
            await until(lambda: n1.nodes[b].serving.ready(), 180, "B ready")

            def sees_other_pool(members: ModelMembers) -> bool:
                alive = members.nodes[a].discovery.alive()
                mine = {n.peer_id for n in members.nodes.values()}
                return any(
                    e.record is not None
                    and e.peer_id not in mine
                    and PLACEMENT_KEY in e.record.extra
                    for e in alive
                )

            # each node's placer reads the other's pool before any demand arrives
            await until(lambda: sees_other_pool(n1) and sees_other_pool(n2), 120, "the pools")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
                body = {"model": b, "prompt": PROMPT_IDS, "max_tokens": 2}
                for _ in range(6):  # 6 recent requests over B's 2 members: 3 per member
                    reply = await http.post("/v1/completions", json=body)
                    assert reply.status_code == 200, reply.text
                await until(lambda: n2.members_of(b) == 2, 180, "a replica of B on n2")
                await until(lambda: b_members_in_plan(n1, b) == 3, 180, "B on three members")
                # several more rounds on both nodes: nobody else adds a member of B
                r1, r2 = n1.placer.rounds, n2.placer.rounds
                await until(
                    lambda: (
                        n1.placer.rounds >= r1 + ROUNDS_AFTER
                        and n2.placer.rounds >= r2 + ROUNDS_AFTER
                    ),
                    120,
                    "more placement rounds",
                )
                assert (n1.members_of(b), n2.members_of(b)) == (1, 2)
                assert (n1.members_of(a), n2.members_of(a)) == (1, 1)
                final = {**body, "max_tokens": NEW_TOKENS, "temperature": 0}
                for _ in range(3):
                    reply = await http.post("/v1/completions", json=final)
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["choices"][0]["token_ids"] == expected
        finally:
            n2.request_stop()
            n1.request_stop()
