"""Speculative decoding through node processes serving the default model cut in three
stages (issue 48): a copy-heavy greedy stream through a gateway started with
``--speculative-k 4`` is the single process's, token for token, and the gateway's
announced counters show drafts sent and kept, more than one token a step."""

from __future__ import annotations

import pytest
import trio

from hetmesh.client.mesh import TokenEvent, open_mesh_client
from hetmesh.scheduler.replan import newest_in_view
from tests.integration.node.mesh_nodes import (
    SECRET,
    NodeProc,
    cut_memory_cap,
    cut_mesh,
    encode,
    fetch_view,
    reference_ids,
    view_of,
    wait_for,
    wait_serving,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

NEW_TOKENS = 48
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
    "the wick, polished the great lens, and wound the clockwork that turned the light."
)
PROMPT = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"


async def _stream(gateway: NodeProc, ids: list[int]) -> list[int]:
    got: list[int] = []
    async with open_mesh_client(gateway.addr, mesh_secret=SECRET) as mesh:
        async for event in mesh.stream(prompt_ids=ids, max_new_tokens=NEW_TOKENS):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                got.append(event.token_id)
    return got


def _counters(view: dict) -> dict[str, float]:
    me = next(p for p in view["peers"] if p.get("health") == "self")
    return dict(me["record"]["extra"].get("gateway") or {})


async def test_drafts_through_a_three_stage_cut_give_the_reference(tmp_path, default_model_dir):
    ids = encode(default_model_dir, PROMPT, chat=True)
    expected = reference_ids(default_model_dir, ids, NEW_TOKENS)
    cap = cut_memory_cap(default_model_dir, 3)
    with cut_mesh(tmp_path, 3, "--max-memory", cap, "--speculative-k", "4") as nodes:
        await trio.to_thread.run_sync(lambda: wait_serving(nodes[0], timeout_s=300))
        plan = newest_in_view(await view_of(nodes[0]))
        assert plan is not None
        assert all(len(p.stages) == 3 for p in plan.pipelines), "a cut in three"
        gateway = next(n for n in nodes if n.peer_id == plan.pipelines[0].stages[0].peer_id)
        assert await _stream(gateway, ids) == expected

        def announced() -> dict[str, float] | None:
            counters = _counters(fetch_view(gateway.addr))
            return counters if counters.get("tokens_out", 0) >= len(expected) else None

        # what the gateway's node announces next (a record goes out every few seconds)
        counters = await trio.to_thread.run_sync(
            lambda: wait_for(announced, 30, "the gateway's counters")
        )
    assert counters["drafted"] > counters["accepted"] > 0
    assert counters["verified_tokens"] > counters["verify_steps"]  # > 1 token a step
