"""A node joins a two-node mesh while a generation is in flight; later a stage is lost.

The coordinator judges the grown mesh by the replan rule (a new placement only
if it is better, else at most a standby replica for the newcomer), every node
converges on one plan epoch, the in-flight stream finishes exactly as the
single-process reference does, and the newcomer serves requests too. Then the
peer of a stage that has no replica leaves mid-stream: the gateway waits for
the next plan (the two survivors can hold the model) and replays the history
through it, and the stream still equals the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from hetmesh.node.config import ServingConfig
from tests.integration.node.inprocess_mesh import PROMPT_IDS, generate, open_mesh, until, wait_ready
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = 100


async def test_a_join_keeps_streams_exact_and_a_lost_stage_replays_through_the_next_plan(
    tmp_path: Path, default_model_dir: Path
) -> None:
    # float32: two 500 MiB nodes must split it (the default model's own int4 fits one)
    expected = reference_ids(default_model_dir, PROMPT_IDS, TOKENS, "float32")
    serving = ServingConfig(
        max_sessions=2, max_context_tokens=512, block_step_s=0.002, weights="float32"
    )
    async with open_mesh(tmp_path, serving, 2) as mesh:
        before = mesh.nodes[0].serving.plan
        assert before is not None
        gateway = mesh.nodes[1].serving.gateway
        got: list[list[int]] = []
        async with trio.open_nursery() as nursery:

            async def in_flight() -> None:
                got.append(await generate(str(mesh.nodes[1].discovery.addrs[0]), TOKENS))

            nursery.start_soon(in_flight)
            await until(lambda: gateway.statistics().tokens_out > 0, 120, "the first token")
            newcomer = await mesh.join()
            # the coordinator stays the one the mesh followed, whatever the newcomer's id
            named = mesh.nodes[0].serving.statistics().coordinator
            boss = next(n for n in mesh.nodes if n.peer_id == named)

            def judged() -> bool:
                # the coordinator has planned with the newcomer among its inputs
                snapshot = boss.serving.follower.planned_on
                return snapshot is not None and any(
                    d.peer_id == newcomer.peer_id for d in snapshot.devices
                )

            def converged() -> bool:
                plans = [n.serving.plan for n in mesh.nodes]
                return judged() and all(p is not None and p == plans[0] for p in plans)

            await until(converged, 120, "every node to follow the coordinator's plan")
            # the new plan was settled while the stream was still generating
            assert gateway.statistics().active_sessions == 1, "the stream ended before the join"
        assert got == [expected]  # the stream in flight during the join is exact

        after = mesh.nodes[0].serving.plan
        assert {n.serving.plan.epoch for n in mesh.nodes} == {after.epoch}
        if after != before:  # changed by the rule: a better placement, or a standby added
            assert after.epoch > before.epoch
            better = after.decode_latency_s < before.decode_latency_s
            assert better or len(after.pipelines) > len(before.pipelines), (before, after)
        pipelines = len(after.pipelines)
        await wait_ready(newcomer, pipelines)
        # requests may enter at the newcomer as at any node
        assert await generate(str(newcomer.discovery.addrs[0]), 12) == expected[:12]

        # a stage nobody backs up loses its peer mid-stream: the gateway replays the
        # history through the next plan, which the two survivors serve between them
        # a peer every pipeline needs: with no replica of its stage, losing it leaves none
        needed = set.intersection(*(set(p.peers) for p in after.pipelines))
        assert needed, f"every stage has a replica: {after.pipelines}"
        doomed = next(n for n in mesh.nodes if n.peer_id in needed)
        entry = next(n for n in mesh.nodes if n is not doomed)
        survivor_gateway = entry.serving.gateway
        recoveries = survivor_gateway.statistics().recoveries
        tokens_before = survivor_gateway.statistics().tokens_out
        replayed: list[list[int]] = []
        async with trio.open_nursery() as nursery:

            async def through_the_loss() -> None:
                replayed.append(await generate(str(entry.discovery.addrs[0]), 40))

            nursery.start_soon(through_the_loss)
            await until(
                lambda: survivor_gateway.statistics().tokens_out >= tokens_before + 5,
                120,
                "the stream to be under way",
            )
            doomed.request_stop()
        assert replayed == [expected[:40]]
        assert survivor_gateway.statistics().recoveries > recoveries
        final = entry.serving.plan
        assert final.epoch > after.epoch
        assert all(s.peer_id != doomed.peer_id for p in final.pipelines for s in p.stages)
