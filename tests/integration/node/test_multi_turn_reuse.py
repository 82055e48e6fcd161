"""A conversation's next turn reuses the previous answer's KV, through a real node.

Turn 1 generates an answer; turn 2 sends the prompt and that answer back. The
gateway's close names the blocks of the whole history (prompt and answer), and
every stage, reached through the node's own control path (a local stage and a
remote one over the session protocol), must keep them in its prefix cache: turn
2 then skips the previous prompt and answer less the last partial block. Two
in-process daemons serve the tiny test model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.node.config import ServingConfig
from hetmesh.partition.blocks import BLOCK_TOKENS
from tests.integration.node.inprocess_mesh import generate, open_mesh, stage_servers, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

PROMPT = [7, 3, 11, 5] * 5 + [9, 8]  # 22 tokens: one full block and a partial one
ANSWER_TOKENS = 40  # the history then ends 62 tokens in: three full blocks


async def test_the_next_turn_reuses_the_previous_prompt_and_answer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        gateway = mesh.nodes[0].serving.gateway
        assert gateway is not None
        servers = stage_servers(mesh.nodes)
        assert len(servers) == 2  # a stage on the gateway's node and one on the other

        def closed() -> bool:
            stats = [s.statistics().kv for s in servers]
            return gateway.statistics().active_sessions == 0 and all(k.sessions == 0 for k in stats)

        answer = await generate(mesh.addr, ANSWER_TOKENS, PROMPT)
        assert answer == reference_ids(tiny_model_dir, PROMPT, ANSWER_TOKENS)
        await until(closed, 120, "turn 1's session to close on every stage")
        history = PROMPT + answer
        # more blocks than the prompt's own: only the answer's KV can cover them
        assert len(history) // BLOCK_TOKENS > len(PROMPT) // BLOCK_TOKENS + 1

        skipped = gateway.statistics().prefix_tokens_skipped
        hits = [s.statistics().kv.prefix_hit_tokens for s in servers]
        follow = await generate(mesh.addr, 4, history)
        assert follow == reference_ids(tiny_model_dir, history, 4)

        covered = len(history) // BLOCK_TOKENS * BLOCK_TOKENS  # less the last partial block
        assert gateway.statistics().prefix_tokens_skipped - skipped == covered
        for server, before in zip(servers, hits, strict=True):
            assert server.statistics().kv.prefix_hit_tokens - before == covered
