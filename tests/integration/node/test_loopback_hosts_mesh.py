"""Two daemons of one host, on a cut: each announces its host in its record's data-plane
entry, so the snapshot a coordinator plans on knows their link is loopback (its drift
moves no plan, hetmesh.scheduler.replan); and the gateway counts its turn, a decode
token in to the next step out, once for every step it sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.discovery.wire import Announcement
from hetmesh.node.config import ServingConfig
from hetmesh.node.plan_follower import HOST_KEY, snapshot
from hetmesh.node.serving import announced_host
from tests.integration.node.inprocess_mesh import PROMPT_IDS, generate, open_mesh, until
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = 12


async def test_one_hosts_nodes_announce_it_and_the_gateway_counts_its_turns(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, TOKENS)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        first, second = mesh.nodes
        discovery = first.discovery

        def records() -> list[Announcement]:
            peers = [e.record for e in discovery.alive() if e.record is not None]
            return [discovery.local_record(advance=False), *peers]

        def both_announced() -> bool:
            got = records()
            return len(got) == 2 and all(r.data_plane.get(HOST_KEY) for r in got)

        await until(both_announced, 60, "both records to name their host")
        mesh_now, _ = snapshot(records())
        assert dict(mesh_now.hosts) == {
            first.peer_id: announced_host(),
            second.peer_id: announced_host(),
        }
        assert mesh_now.colocated(first.peer_id, second.peer_id)

        gateway = first.serving.gateway
        assert gateway is not None
        before = gateway.statistics()
        assert await generate(mesh.addr, TOKENS) == expected
        stats = gateway.statistics()
        turns = (stats.lane_turns - before.lane_turns) + (stats.trio_turns - before.trio_turns)
        plan = first.serving.plan
        assert plan is not None
        if plan.pipelines[0].stages[0].peer_id == first.peer_id:
            # the gateway's own first stage: a next step is that stage's forward, no turn
            assert turns == 0, stats
        else:
            # every step after the prefill's left on a token's arrival (the last token
            # wants none), each counted once at most, by the lane or by trio
            assert TOKENS // 2 <= turns <= TOKENS - 1, stats
            assert stats.lane_turn_s + stats.trio_turn_s > 0
