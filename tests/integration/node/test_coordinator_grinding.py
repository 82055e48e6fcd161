"""A member that joins with a ground low peer id does not become the coordinator.

Two in-process serving daemons (real libp2p hosts, the tiny model) follow their
coordinator's plan; a hostile member (tests/integration/node/hostile.py) joins with
a peer id below both and announces the plan the mesh follows, one epoch up, signed
by itself: a sane plan that every node would have followed while the coordinator
was the lowest live id (it was, before issue 45). Each node must refuse it, keep
its coordinator and plan, and still generate the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.node.config import ServingConfig
from tests.integration.node.hostile import open_hostile_member
from tests.integration.node.inprocess_mesh import (
    PROMPT_IDS,
    SECRET,
    generate,
    open_mesh,
    until,
)
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = 8


async def test_a_ground_low_peer_id_does_not_take_the_coordinator(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, TOKENS)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        nodes = mesh.nodes

        def settled() -> bool:
            plans = [n.serving.plan for n in nodes]
            bosses = {n.serving.statistics().coordinator for n in nodes}
            return plans[0] is not None and plans[0] == plans[1] and len(bosses) == 1

        await until(settled, 120, "both nodes to follow one coordinator's plan")
        boss = nodes[0].serving.statistics().coordinator
        followed = nodes[0].serving.plan
        assert boss
        assert followed is not None
        model = nodes[0].discovery.local_record(advance=False).extra["model"]
        lowest = min(n.peer_id for n in nodes)
        async with open_hostile_member(
            mesh.addr, lowest, model, below=True, secret=SECRET
        ) as hostile:
            assert hostile.peer_id < lowest  # it would have coordinated by the old rule
            wire = followed.with_epoch(followed.epoch + 1).to_wire()
            hostile.announce(({"plan": wire, "plan_signature": hostile.sign(wire)}, ()), 0)

            def judged() -> bool:
                # each node's plan loop had the member's plan in view: it refused it, or
                # (the old rule) took the member for its coordinator
                return all(
                    hostile.peer_id in n.serving.follower.refused
                    or n.serving.statistics().coordinator == hostile.peer_id
                    for n in nodes
                )

            await until(judged, 60, "both nodes to judge the ground member's plan")
            for node in nodes:
                assert node.serving.statistics().coordinator == boss
                # its plan, not the member's
                assert node.serving.follower.coordination.signer == boss
            assert await generate(mesh.addr, TOKENS) == expected


async def test_a_coordinator_that_leaves_is_succeeded_by_a_member_of_its_plan(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, TOKENS)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 3, model=tiny_model_dir) as mesh:
        nodes = mesh.nodes

        def bosses(among: list) -> set[str]:
            return {n.serving.statistics().coordinator for n in among}

        def on_one_plan(among: list) -> bool:
            plans = [n.serving.plan for n in among]
            return plans[0] is not None and all(p == plans[0] for p in plans)

        await until(
            lambda: on_one_plan(nodes) and len(bosses(nodes)) == 1 and "" not in bosses(nodes),
            120,
            "the three nodes to follow one coordinator's plan",
        )
        (boss,) = bosses(nodes)
        leaving = next(n for n in nodes if n.peer_id == boss)
        rest = [n for n in nodes if n is not leaving]
        leaving.request_stop()

        def succeeded() -> bool:
            named = bosses(rest)
            plan = rest[0].serving.plan
            return (
                len(named) == 1
                and boss not in named
                and on_one_plan(rest)
                and plan is not None
                and all(s.peer_id != boss for p in plan.pipelines for s in p.stages)
            )

        await until(succeeded, 120, "the survivors to follow their new coordinator's plan")
        (successor,) = bosses(rest)
        assert successor in {n.peer_id for n in rest}
        assert rest[0].serving.follower.coordination.signer == successor
        assert await generate(str(rest[0].discovery.addrs[0]), TOKENS) == expected
