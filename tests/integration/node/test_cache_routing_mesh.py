"""Cache-aware routing across two replicas of the default model (issue 14, item 3).

Two serving daemons in this test's trio run (:mod:`inprocess_mesh`), each able
to hold the whole model, planned for throughput: two single-stage pipelines.
A first request is steered off the pipeline an idle mesh would pick (that one
holds dummy sessions); the conversation's next turn then goes back to the
pipeline holding its prefix although the other is idle and first in line,
skips the cached prefill, and both turns equal the single-process reference —
through the gateway that routed the first turn (its own memory and the stages'
announced prefix summaries). Another gateway finds none of those blocks: a
stage shares them only with the gateway whose session computed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hetmesh.partition.blocks import BLOCK_TOKENS
from hetmesh.partition.prefill import PREFILL_CHUNK_TOKENS
from hetmesh.partition.prefix import block_hashes
from hetmesh.scheduler.prefix_summary import matched_blocks
from tests.integration.node.inprocess_mesh import (
    generate,
    hold_a_slot,
    open_replicas,
    until,
)
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(420)]

# a long first turn (arbitrary in-vocabulary ids): 10 full blocks and a tail. Every turn
# stays shorter than two prefill chunks, so it is prefilled whole by one replica: a longer
# prompt's gateway may borrow the idle replica for its prefill (hetmesh.node.split), and
# that replica would then run a share of the turn too
FIRST_TURN = [(17 * i + 5) % 40000 + 100 for i in range(10 * BLOCK_TOKENS + 5)]
NEW_TOKENS = 6
HELD = 3  # dummy sessions that make the idle choice look busy


def stage_of(node: Any) -> Any:
    (server,) = node.serving.stages.servers().values()
    return server


def tokens_of(node: Any) -> int:
    return int(stage_of(node).statistics().tokens)


def pipeline_of(node: Any) -> str:
    plan = node.serving.plan
    return next(p.key for p in plan.pipelines if node.peer_id in p.peers)


def skipped(node: Any) -> int:
    return int(node.serving.gateway.statistics().prefix_tokens_skipped)


async def served_by(nodes: Sequence[Any], gateway: Any, prompt: list[int]) -> tuple[Any, list[int]]:
    """Generate ``prompt`` through ``gateway``; the node whose stage ran it, and the ids."""
    before = [tokens_of(n) for n in nodes]
    out = await generate(str(gateway.discovery.addrs[0]), NEW_TOKENS, prompt)

    def ran() -> list[Any]:
        return [n for n, b in zip(nodes, before, strict=True) if tokens_of(n) > b]

    # a stage sends its tokens from its device thread and counts them once the batch is
    # back on trio: the client can have the last token before the count moves
    await until(ran, 30, "the stage that ran the request counting it")
    assert len(ran()) == 1, f"{len(ran())} pipelines ran one request"
    return ran()[0], out


async def test_next_turn_goes_back_to_the_pipeline_holding_its_prefix(
    tmp_path: Path, default_model_dir: Path
) -> None:
    async with open_replicas(tmp_path) as mesh:
        nodes = mesh.nodes
        front, back = nodes

        # the pipeline an idle mesh picks: a short request with no shared prefix
        idle_choice, _ = await served_by(nodes, front, [7, 8, 9])
        other = next(n for n in nodes if n is not idle_choice)
        idle_key = pipeline_of(idle_choice)

        # first turn while the idle choice looks busy: it runs on the other pipeline
        for i in range(HELD):
            hold_a_slot(stage_of(idle_choice), f"held-{i}")
        # a load announced within a plan tick of our request's end there is read less that
        # request (Gateway.sessions_during: it may have been sampled while it ran), and a
        # record whose load stays put is not sent again: one held session may go unseen
        await until(
            lambda: (
                front.serving.routes.loads(front.serving.plan)[idle_key].active_sessions >= HELD - 1
            ),
            60,
            "the gateway seeing the held sessions",
        )
        ran, first_out = await served_by(nodes, front, FIRST_TURN)
        assert ran is other
        for i in range(HELD):
            stage_of(idle_choice).close(f"held-{i}")
        await until(
            lambda: all(
                n.serving.routes.loads(n.serving.plan)[idle_key].active_sessions == 0 for n in nodes
            ),
            60,
            "every gateway seeing the idle choice idle again",
        )
        assert first_out == reference_ids(default_model_dir, FIRST_TURN, NEW_TOKENS)

        # the next turn through the same gateway: back to its cache, prefill skipped
        second_turn = [*FIRST_TURN, *first_out, 42, 43, 44, 45]
        cached = len(block_hashes([*FIRST_TURN, *first_out])) * BLOCK_TOKENS
        before = skipped(front)
        ran, second_out = await served_by(nodes, front, second_turn)
        assert ran is other
        assert skipped(front) - before >= len(FIRST_TURN) // BLOCK_TOKENS * BLOCK_TOKENS
        assert skipped(front) - before <= cached
        assert second_out == reference_ids(default_model_dir, second_turn, NEW_TOKENS)

        # the stage announces the prefix, salted and scoped to the gateway that ran it:
        # the first gateway reads it in the summary, the other finds none of it (a stage
        # shares a block only with the gateway whose session computed it: issue 45)
        third_turn = [*second_turn, *second_out, 46, 47]
        assert len(third_turn) < 2 * PREFILL_CHUNK_TOKENS  # whole: one replica
        hashes = block_hashes(third_turn)

        def seen_by(node: Any) -> int:
            routes = node.serving.routes
            return matched_blocks(routes.summary_names(hashes), routes.summary_of()(_stage(other)))

        await until(
            lambda: seen_by(front) >= len(second_turn) // BLOCK_TOKENS,
            60,
            "the first gateway seeing its cached prefix in the announced summary",
        )
        assert seen_by(back) == 0
        before = skipped(back)
        _, third_out = await served_by(nodes, back, third_turn)
        assert skipped(back) == before
        assert third_out == reference_ids(default_model_dir, third_turn, NEW_TOKENS)


def _stage(node: Any) -> Any:
    """``node``'s stage in its plan (the router's record of it)."""
    plan = node.serving.plan
    return next(s for p in plan.pipelines for s in p.stages if s.peer_id == node.peer_id)
