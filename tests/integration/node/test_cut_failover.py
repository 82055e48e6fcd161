"""A stage host of a four-stage cut dies mid-stream, with no standby replica to take over.

Four node processes serve the default model (its own int4 weights) cut in four
stages, one per node, so no spare device backs a stage up. A stage host is
SIGKILLed while a greedy generation runs through another node:

- the three survivors can hold the model (``--plan-strategy even``, memory caps
  that let two nodes hold it): the coordinator places it again on them, they load
  the units they lack, and the client's stream resumes (the gateway replays the
  history) with the tokens of one process holding the whole model;
- they cannot (memory caps that make the model need four nodes, the planner's own
  strategy): the stream fails with ``InsufficientCapacity`` naming the memory
  missing and the units that lost their host — not ``NoRoute`` after the route
  wait — and a new request to the same gateway is refused the same way.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from hetmesh.client.mesh import TokenEvent, open_mesh_client
from hetmesh.errors import InsufficientCapacity
from hetmesh.scheduler.records import Plan
from hetmesh.scheduler.replan import newest_in_view
from tests.integration.node.mesh_nodes import (
    SECRET,
    NodeProc,
    cut_memory_cap,
    cut_mesh,
    encode,
    reference_ids,
    view_of,
    wait_serving,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

NEW_TOKENS = 40
KILL_AFTER = 6
PROMPT = "Tell me a story about a lighthouse keeper."


async def _four_stages(nodes: list[NodeProc]) -> Plan:
    await trio.to_thread.run_sync(lambda: wait_serving(nodes[0], timeout_s=300))
    plan = newest_in_view(await view_of(nodes[0]))
    assert plan is not None
    assert len(plan.pipelines) == 1, "a spare device would back a stage up"
    assert len({s.peer_id for s in plan.pipelines[0].stages}) == 4
    return plan


def _roles(nodes: list[NodeProc], plan: Plan) -> tuple[NodeProc, NodeProc]:
    """The gateway (the first stage's host) and the victim (the third stage's)."""
    by_peer = {n.peer_id: n for n in nodes}
    stages = plan.pipelines[0].stages
    return by_peer[stages[0].peer_id], by_peer[stages[2].peer_id]


async def _stream_killing(
    gateway: NodeProc, victim: NodeProc, ids: list[int], got: list[int]
) -> None:
    """Stream a greedy generation through ``gateway`` into ``got``; SIGKILL ``victim``
    once :data:`KILL_AFTER` tokens arrived."""
    async with open_mesh_client(gateway.addr, mesh_secret=SECRET) as mesh:
        async for event in mesh.stream(prompt_ids=ids, max_new_tokens=NEW_TOKENS):
            if not isinstance(event, TokenEvent) or event.token_id < 0:
                continue
            got.append(event.token_id)
            if len(got) == KILL_AFTER:
                os.kill(victim.proc.pid, signal.SIGKILL)


async def test_survivors_that_hold_the_model_resume_the_stream(tmp_path, default_model_dir):
    ids = encode(default_model_dir, PROMPT, chat=True)
    expected = reference_ids(default_model_dir, ids, NEW_TOKENS)
    assert len(expected) > KILL_AFTER
    # two nodes could hold the model: the even split over four, then three, fits
    cap = cut_memory_cap(default_model_dir, 2)
    with cut_mesh(tmp_path, 4, "--plan-strategy", "even", "--max-memory", cap) as nodes:
        plan = await _four_stages(nodes)
        gateway, victim = _roles(nodes, plan)
        got: list[int] = []
        await _stream_killing(gateway, victim, ids, got)
        assert victim.proc.wait(timeout=30) == -signal.SIGKILL
        assert got == expected
        after = newest_in_view(await view_of(gateway))
        assert after is not None
        assert after.epoch > plan.epoch
        placed = [(s.peer_id, s.start, s.end) for s in after.pipelines[0].stages]
        assert len(placed) == 3
        assert victim.peer_id not in {p for p, _, _ in placed}
        me = next(p for p in (await view_of(gateway))["peers"] if p["health"] == "self")
        assert me["record"]["extra"]["gateway"]["recoveries"] >= 1


async def test_survivors_that_cannot_hold_the_model_refuse_at_once(tmp_path, default_model_dir):
    ids = encode(default_model_dir, PROMPT, chat=True)
    with cut_mesh(tmp_path, 4, "--max-memory", cut_memory_cap(default_model_dir, 4)) as nodes:
        plan = await _four_stages(nodes)
        gateway, victim = _roles(nodes, plan)
        lost = next(s for s in plan.pipelines[0].stages if s.peer_id == victim.peer_id)
        got: list[int] = []
        with pytest.raises(InsufficientCapacity) as refused:
            await _stream_killing(gateway, victim, ids, got)
        assert len(got) >= KILL_AFTER
        message = str(refused.value)
        assert "more free memory is needed" in message
        assert f"units [{lost.start},{lost.end})" in message
        assert victim.peer_id in message
        # the gateway keeps serving: a new request hears the same at once
        async with open_mesh_client(gateway.addr, mesh_secret=SECRET) as mesh:
            with pytest.raises(InsufficientCapacity, match="more free memory is needed"):
                async for _ in mesh.stream(prompt_ids=ids, max_new_tokens=4):
                    pass
        assert gateway.proc.poll() is None
