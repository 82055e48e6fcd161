"""Four nodes, one stage with a standby replica: a generation survives losing it.

The planner needs three of the four nodes (each offers too little memory for
more of the model); the fourth becomes a standby replica of one stage. Two
ways to get there: the nodes announce one given block step time
(``--block-step-ms``), or they calibrate as in production, where a
calibration skewed by the others starting on the shared cores can make a
four-stage plan predict faster and the scheduler's ``with_standby`` must free
a device to back a stage up. The stage peer serving an in-flight greedy
generation is killed (or frozen) half way; the gateway fails over to the
replica, replays the history, and the client's tokens equal the fault-free
reference.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from hetmesh.client.mesh import TokenEvent, open_mesh_client
from hetmesh.scheduler.replan import newest_in_view
from tests.integration.node.mesh_nodes import (
    SECRET,
    encode,
    reference_ids,
    running_mesh,
    view_of,
    wait_serving,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

# The tiny model makes a token cheap: a generation long enough that the replica is
# failed while it still runs (the victim is known once the announced load shows the
# session, about a second in), whatever the machine's load.
NEW_TOKENS = 320
KILL_AFTER = 16


def _load(view, peer_id: str) -> int:
    for p in view["peers"]:
        if p["peer_id"] == peer_id:
            return int(p["record"]["load"]["active_sessions"])
    return 0


GIVEN_STEP = ("--block-step-ms", "3")


@pytest.mark.parametrize(
    ("fault", "step_args"),
    [
        pytest.param(signal.SIGKILL, GIVEN_STEP, id="kill"),
        pytest.param(signal.SIGSTOP, GIVEN_STEP, id="stall"),
        pytest.param(signal.SIGKILL, (), id="kill-calibrated"),  # the production path
    ],
)
async def test_generation_survives_losing_the_serving_replica(
    tmp_path, tiny_model_dir, fault, step_args
):
    ids = encode(tiny_model_dir, "Tell me a story about a lighthouse keeper.", chat=True)
    expected = reference_ids(tiny_model_dir, ids, NEW_TOKENS)
    with running_mesh(tmp_path, 4, *step_args, model=tiny_model_dir) as nodes:
        # calibrating nodes replan as their measurements arrive: allow for that
        await trio.to_thread.run_sync(lambda: wait_serving(nodes[0], pipelines=2, timeout_s=360))
        plan = newest_in_view(await view_of(nodes[0]))
        assert plan is not None
        primary, replica = plan.pipelines[0], plan.pipelines[1]
        ((first, second),) = [
            (a.peer_id, b.peer_id)
            for a, b in zip(primary.stages, replica.stages, strict=True)
            if a.peer_id != b.peer_id
        ]
        by_peer = {n.peer_id: n for n in nodes}
        gateway = next(n for n in nodes if n.peer_id not in (first, second))
        got: list[int] = []
        victim = ""
        try:
            async with open_mesh_client(gateway.addr, mesh_secret=SECRET) as mesh:
                async for event in mesh.stream(prompt_ids=ids, max_new_tokens=NEW_TOKENS):
                    if not isinstance(event, TokenEvent) or event.token_id < 0:
                        continue
                    got.append(event.token_id)
                    if len(got) >= KILL_AFTER and not victim:
                        # fail the replica that really serves this session (the router's
                        # choice shows in the stages' announced load, about once a second)
                        view = await view_of(gateway)
                        serving = [p for p in (first, second) if _load(view, p) >= 1]
                        if len(serving) == 1:
                            victim = serving[0]
                            os.kill(by_peer[victim].proc.pid, fault)
        finally:
            if victim and fault == signal.SIGSTOP:
                os.kill(by_peer[victim].proc.pid, signal.SIGCONT)
        assert victim, "the generation ended before the serving replica could be failed"
        assert got == expected
        view = await view_of(gateway)
        me = next(p for p in view["peers"] if p["health"] == "self")
        assert me["record"]["extra"]["gateway"]["recoveries"] >= 1
