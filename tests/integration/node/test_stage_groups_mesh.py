"""Concurrent streams through a cut, with the stages' micro-batch groups
(hetmesh.node.stage_groups) on and off: the outputs stay the reference's.

Two in-process daemons split the tiny test model over the real data plane (libp2p
control, the shm/TCP data plane); three streams at once share the stages' rounds
(a round's share is two of three sessions, so groups of two and one form), and
every session ends, freeing every stage's KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from hetmesh.node.config import ServingConfig
from tests.integration.node.inprocess_mesh import (
    PROMPT_IDS,
    generate,
    open_mesh,
    stage_servers,
    until,
)
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = 24
PROMPTS = [list(PROMPT_IDS), [7, 300, 41, 12], [900, 901, 55]]


@pytest.mark.parametrize("groups", ["1", "0"])
async def test_concurrent_streams_through_a_cut_match_the_reference(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, groups: str
) -> None:
    monkeypatch.setenv("HETMESH_STAGE_GROUPS", groups)
    expected = {i: reference_ids(tiny_model_dir, p, TOKENS) for i, p in enumerate(PROMPTS)}
    serving = ServingConfig(max_sessions=4, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        servers = stage_servers(mesh.nodes)
        assert len(servers) == 2, "the tiny model must be cut in two"
        assert all((s._groups is not None) == (groups == "1") for s in servers)
        for _ in range(2):  # twice: the second streams meet the first ones' groups
            results: dict[int, list[int]] = {}

            async def run(i: int, into: dict[int, list[int]] = results) -> None:
                into[i] = await generate(mesh.addr, TOKENS, PROMPTS[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(run, i)
            assert results == expected

        def ended() -> bool:
            stats = [s.statistics().kv for s in servers]
            return all(k.sessions == 0 and k.blocks_free == k.blocks_total for k in stats)

        await until(ended, 60, "every session to end on every stage")
