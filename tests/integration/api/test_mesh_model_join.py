"""A ``--model mesh`` node joins the model in most demand (issue 49, item 1).

One ``run_models`` node serves two tiny synthetic models (real libp2p hosts,
data plane and weights): A on one member, B on two (``min_replicas``). With no
demand anywhere a joining ``--model mesh`` node would take A (the fewest
members). Requests for B over the node's HTTP API are counted and announced in
B's members' records (the recent-request part of the demand signal), so B has
more demand per member than A, and a ``--model mesh`` node started then, with
an empty cache, fetches B's weights from the mesh, is planned with B's members
and B answers with its single-process reference's tokens. A is untouched.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from hetmesh.node.config import ServingConfig
from hetmesh.node.daemon import Node, run_node
from hetmesh.node.models import ModelMembers, run_models
from hetmesh.scheduler.demand import DEMAND_KEY
from hetmesh.scheduler.model_placement import PlacementPolicy
from tests.integration.node.inprocess_mesh import PROMPT_IDS, free_port, node_config, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model]

NEW_TOKENS = 16
SHARE = 512 << 20  # each member's memory: the whole of a tiny model


@pytest.fixture(scope="module")
def model_dirs(default_model_dir: Path) -> list[Path]:
    from hetmesh.partition.store import resolve_model

    return [resolve_model("synth-tiny"), resolve_model("synth-tiny-qwen2")]


def announced_recent(members: ModelMembers, key: str) -> int:
    """The recent requests ``key``'s members of this process announce, together."""
    return held_recent(members, None, key)


def held_recent(members: ModelMembers, holder: Node | None, key: str) -> int:
    """The recent requests ``key``'s members announce, as ``holder`` holds their records
    (None: each member's own record)."""
    total = 0
    for node in [members.nodes[key], *members.replicas.get(key, [])]:
        if holder is None or node is holder:
            record = node.discovery.local_record(advance=False)
        else:
            entry = holder.discovery.table.entries.get(node.peer_id)
            record = entry.record if entry is not None else None
        if record is not None:
            total += int((record.extra.get(DEMAND_KEY) or {}).get("recent", 0))
    return total


async def test_a_mesh_node_joins_the_model_the_api_sees_demand_for(
    tmp_path: Path, model_dirs: list[Path]
) -> None:
    serving = ServingConfig(max_context_tokens=256, block_step_s=0.0005)
    port = free_port()
    config = node_config(tmp_path, "node", serving, memory_bytes=3 * SHARE, api_port=port)
    a_dir, b_dir = model_dirs
    a, b = a_dir.name, b_dir.name
    expected = reference_ids(b_dir, PROMPT_IDS, NEW_TOKENS)
    # rounds often, a long window, and no growth here: the joiner is the only new member
    policy = PlacementPolicy(grow_at=10**6, interval_s=0.2, window_s=600)
    async with trio.open_nursery() as nursery:
        members: ModelMembers = await nursery.start(
            lambda task_status: run_models(
                config,
                [str(a_dir), str(b_dir)],
                {str(a_dir): SHARE, str(b_dir): SHARE},
                min_replicas={str(b_dir): 2},
                placement=policy,
                task_status=task_status,
            )
        )
        try:
            await until(lambda: members.nodes[a].serving.ready(), 180, "A ready")
            await until(lambda: members.nodes[b].serving.ready(), 180, "B ready")
            a_epoch = members.nodes[a].serving.plan.epoch
            body = {"model": b, "prompt": PROMPT_IDS, "max_tokens": 2}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
                for _ in range(4):
                    reply = await http.post("/v1/completions", json=body)
                    assert reply.status_code == 200, reply.text
                await until(lambda: announced_recent(members, b) == 4, 60, "B's demand announced")
                assert announced_recent(members, a) == 0
                # and published: the joiner learns the members' records from its bootstrap,
                # A's node, which must hold the versions that carry the demand (in CI it
                # held older ones and the joiner, seeing no demand, joined A)
                await until(
                    lambda: held_recent(members, members.nodes[a], b) == 4,
                    60,
                    "B's demand in the records the joiner's bootstrap holds",
                )

                joining = ServingConfig(
                    model="mesh",
                    cache_dir=tmp_path / "joiner-cache",
                    max_context_tokens=256,
                    block_step_s=0.0005,
                )
                first = str(members.nodes[a].discovery.addrs[0])
                joiner_config = node_config(
                    tmp_path, "joiner", joining, memory_bytes=SHARE, bootstrap=(first,)
                )
                joiner: Node = await nursery.start(run_node, joiner_config)
                try:
                    assert joiner.serving.model_key == b
                    b_node = members.nodes[b]

                    def planned_with_b() -> bool:
                        plan = b_node.serving.plan
                        return plan is not None and any(
                            s.peer_id == joiner.peer_id for p in plan.pipelines for s in p.stages
                        )

                    await until(planned_with_b, 180, "the joiner in B's plan")
                    await until(b_node.serving.ready, 180, "B ready on its new plan")
                    final = {**body, "max_tokens": NEW_TOKENS, "temperature": 0}
                    reply = await http.post("/v1/completions", json=final)
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["choices"][0]["token_ids"] == expected
                finally:
                    joiner.request_stop()
            assert members.nodes[a].serving.plan.epoch == a_epoch
        finally:
            members.request_stop()
