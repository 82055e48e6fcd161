"""A cut's gateway sends each decode step's successor from the thread that brings
its token in (hetmesh.node.gateway_lane), and the outputs stay the reference's.

Two in-process daemons split the tiny test model over the real data plane; the
client's gateway is on one of them, so the token comes either over a link (the
reader thread sends the next step) or from this node's last stage (its device
thread does). With ``HETMESH_GATEWAY_LANE=0`` no step leaves that way, and the
tokens are the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from hetmesh.client.mesh import TokenEvent, open_mesh_client
from hetmesh.node.config import ServingConfig
from tests.integration.node.inprocess_mesh import (
    PROMPT_IDS,
    SECRET,
    generate,
    open_mesh,
    stage_servers,
    until,
)
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = 40


@pytest.mark.parametrize("lane", ["1", "0"])
async def test_a_cut_sends_its_next_steps_as_tokens_come_in_and_matches_the_reference(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, lane: str
) -> None:
    monkeypatch.setenv("HETMESH_GATEWAY_LANE", lane)
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, TOKENS)
    other_prompt = [7, 300, 41, 12]
    other = reference_ids(tiny_model_dir, other_prompt, TOKENS)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        servers = stage_servers(mesh.nodes)
        assert len(servers) == 2, "the tiny model must be cut in two"
        gateway = mesh.nodes[0].serving.gateway  # the client's (mesh.addr)
        assert gateway is not None
        assert await generate(mesh.addr, TOKENS) == expected
        if lane == "1":
            # steps after the first decode step left from the reader thread (not every
            # one: a token back before trio re-armed the lane is sent by trio, as on a
            # loaded machine)
            assert gateway.lane.sent > 0, gateway.lane.sent
        else:
            assert gateway.lane.sent == 0
        results: dict[int, list[int]] = {}

        async def run(i: int, prompt: list[int]) -> None:
            results[i] = await generate(mesh.addr, TOKENS, prompt)

        async with trio.open_nursery() as nursery:  # two sessions at once
            nursery.start_soon(run, 0, list(PROMPT_IDS))
            nursery.start_soon(run, 1, other_prompt)
        assert results == {0: expected, 1: other}

        def ended() -> bool:
            stats = [s.statistics().kv for s in servers]
            return all(k.sessions == 0 and k.blocks_free == k.blocks_total for k in stats)

        await until(ended, 60, "every session to end on every stage")
        assert gateway.statistics().tokens_out == 3 * TOKENS


LONG, SHORT = 120, 40  # a long stream, and a short one run while it is open


@pytest.mark.parametrize("many", ["1", "0"])
async def test_with_stage_groups_the_lane_sends_every_sessions_next_steps(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, many: str
) -> None:
    monkeypatch.setenv("HETMESH_GATEWAY_LANE", "1")
    monkeypatch.setenv("HETMESH_STAGE_GROUPS", "1")
    monkeypatch.setenv("HETMESH_GATEWAY_LANE_MANY", many)
    other_prompt = [7, 300, 41, 12]
    expected = {
        "long": reference_ids(tiny_model_dir, PROMPT_IDS, LONG),
        "short": reference_ids(tiny_model_dir, other_prompt, SHORT),
    }
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        gateway = mesh.nodes[0].serving.gateway
        assert gateway is not None
        results: dict[str, list[int]] = {}
        started = trio.Event()

        async def long_stream() -> None:
            out: list[int] = []
            async with open_mesh_client(mesh.addr, mesh_secret=SECRET) as client:
                request = {"prompt_ids": list(PROMPT_IDS), "max_new_tokens": LONG}
                async for event in client.stream(**request):
                    if isinstance(event, TokenEvent) and event.token_id >= 0:
                        out.append(event.token_id)
                        started.set()
            results["long"] = out

        async def short_stream() -> None:  # while the long one runs: two sessions open
            await started.wait()
            results["short"] = await generate(mesh.addr, SHORT, other_prompt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            nursery.start_soon(short_stream)
        assert results == expected
        sent, beside = gateway.lane.sent, gateway.lane.sent_beside_others
        if many == "1":  # steps sent while both sessions were armed (a token back before
            # trio re-armed its session is sent by trio: not every step, under load)
            assert beside > 0, (sent, beside)
        else:  # only the long one's while it was alone: none beside the short one's
            assert beside == 0, (sent, beside)
            assert sent <= LONG, sent


@pytest.mark.parametrize("own", ["1", "0"])
async def test_a_gateway_on_the_first_stage_computes_its_next_steps_on_the_reader_thread(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, own: str
) -> None:
    """The client's gateway holds the first stage: each next step is that stage's
    forward on the reader thread that brings the token in (its lane), not a hop
    through trio; ``HETMESH_GATEWAY_LANE_OWN=0`` sends it through trio as before."""
    monkeypatch.setenv("HETMESH_GATEWAY_LANE", "1")
    monkeypatch.setenv("HETMESH_STAGE_LANE", "1")
    monkeypatch.setenv("HETMESH_GATEWAY_LANE_OWN", own)
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, TOKENS)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh:
        servers = stage_servers(mesh.nodes)
        assert len(servers) == 2, "the tiny model must be cut in two"
        entry = next(
            n
            for n in mesh.nodes
            if any(s.stage.start == 0 for s in n.serving.stages.servers().values())
        )
        gateway = entry.serving.gateway
        assert gateway is not None
        assert await generate(str(entry.discovery.addrs[0]), TOKENS) == expected
        first = servers[0].statistics()
        if own == "1":
            # steps the first stage's lane took: only its own gateway feeds it, and only
            # this path hands it steps off trio (not every one: a token back before
            # trio re-armed the session is sent by trio, as on a loaded machine)
            assert first.lane_steps > 0, first
        else:
            assert first.lane_steps == 0, first

        def ended() -> bool:
            stats = [s.statistics().kv for s in servers]
            return all(k.sessions == 0 and k.blocks_free == k.blocks_total for k in stats)

        await until(ended, 60, "every session to end on every stage")
        assert gateway.statistics().tokens_out == TOKENS
