"""A client that stops reading a stream stops its generation.

The SDK's stream (the libp2p generate protocol) closes when its reader leaves
it; the node must then end the session on every stage rather than run on to
``max_new_tokens`` for nobody. Two in-process daemons serve the tiny test model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from hetmesh.client.mesh import TokenEvent, open_mesh_client
from hetmesh.node.config import ServingConfig
from tests.integration.node.inprocess_mesh import (
    PROMPT_IDS,
    SECRET,
    open_mesh,
    stage_servers,
)
from tests.integration.node.inprocess_mesh import until as until_
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

ASKED = 400  # far more than are read: a generation left running produces all of them
READ = 3


async def test_a_stream_left_by_its_reader_ends_on_every_stage(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, READ)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        gateway = mesh.nodes[0].serving.gateway
        servers = stage_servers(mesh.nodes)
        got: list[int] = []
        async with open_mesh_client(mesh.addr, mesh_secret=SECRET) as client:
            events = client.stream(prompt_ids=list(PROMPT_IDS), max_new_tokens=ASKED)
            async with contextlib.aclosing(events) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent) and event.token_id >= 0:
                        got.append(event.token_id)
                        if len(got) == READ:
                            break  # the reader leaves: the SDK closes its stream
        assert got == expected

        def ended() -> bool:
            stats = [s.statistics().kv for s in servers]
            done = all(k.sessions == 0 and k.blocks_free == k.blocks_total for k in stats)
            return done and gateway.statistics().active_sessions == 0

        await until_(ended, 120, "the session to end on every stage")
        produced = gateway.statistics().tokens_out
        assert READ <= produced < ASKED, produced
