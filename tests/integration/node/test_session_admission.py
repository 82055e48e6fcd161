"""KV admission and idle expiry through a real two-node mesh.

Both daemons run in this test's trio run (:mod:`inprocess_mesh`), so the
gateway's admission wait and the idle-session limit, which the CLI does not
expose, can be short. Admission and preemption are mechanisms: those meshes
serve the tiny test model (tests/tiny_model.py) and compare with its reference;
the idle-expiry test keeps the default model, whose generation must outlast the
idle limit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from hetmesh.errors import Rejected
from hetmesh.node.config import ServingConfig
from hetmesh.node.gateway import GatewayTimeouts
from tests.integration.node.inprocess_mesh import (
    PROMPT_IDS,
    SECRET,
    free_port,
    generate,
    hold_a_slot,
    open_mesh,
    stage_servers,
)
from tests.integration.node.inprocess_mesh import until as until_
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

# the admission wait where a request must get through on a loaded machine (a busy
# reply, then the holder's slot freed), and where it must be rejected
ADMIT_S = 60.0
REJECT_S = 5.0


def admission_state(nodes: Any) -> str:
    """Each stage's open sessions and kept places (a failed admission's evidence)."""
    parts = []
    for server in stage_servers(nodes):
        kv = server.kv
        parts.append(
            f"stage [{server.stage.start},{server.stage.end}): open {sorted(kv._entries)}, "
            f"waiting {dict(kv._waiters)}, lapsed {sorted(kv._lapsed)}"
        )
    return " | ".join(parts)


async def until_idle(server: Any) -> None:
    """Wait until ``server`` holds no session (the last request's close arrived)."""
    await until_(lambda: server.kv.statistics().sessions == 0, 60, "the stage holding no session")


async def test_more_sessions_than_max_sessions_wait_then_get_rejected(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, 8)
    port = free_port()
    serving = ServingConfig(
        max_sessions=1,
        max_context_tokens=512,
        block_step_s=0.002,
        timeouts=GatewayTimeouts(admission_s=ADMIT_S),  # the rejection phase shortens it
    )
    async with open_mesh(
        tmp_path, serving, 2, first={"api_port": port}, model=tiny_model_dir
    ) as mesh:
        gateway = mesh.nodes[0].serving.gateway
        first = stage_servers(mesh.nodes)[0]

        # two requests at once on stages that admit one session: both finish
        results: list[list[int]] = []

        async def one() -> None:
            try:
                results.append(await generate(mesh.addr, 4))
            except Rejected as exc:  # say what each stage held and kept in line
                raise AssertionError(f"{exc}; {admission_state(mesh.nodes)}") from exc

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(one)
        assert results == [expected[:4]] * 2

        # a request that finds the mesh full waits, and goes through once a slot frees;
        # a finished session's close reaches the stage after its last token
        await until_idle(first)
        busy_before = gateway.statistics().rejected_busy
        hold_a_slot(first, "holder-1")
        got: list[list[int]] = []
        async with trio.open_nursery() as nursery:

            async def waiting() -> None:
                got.append(await generate(mesh.addr, 8))

            nursery.start_soon(waiting)
            await until_(
                lambda: gateway.statistics().rejected_busy > busy_before, 60, "a busy reply"
            )
            first.close("holder-1")
        assert got == [expected]

        # a mesh that stays full past the admission wait: Rejected (SDK) and 429 (HTTP);
        # the gateway reads its timeouts per request, so a short wait applies from here
        gateway.timeouts = dataclasses.replace(gateway.timeouts, admission_s=REJECT_S)
        await until_idle(first)
        hold_a_slot(first, "holder-2")
        outcome: dict[str, Any] = {}

        async def sdk() -> None:
            with pytest.raises(Rejected, match="busy"):
                await generate(mesh.addr, 8)
            outcome["sdk"] = "rejected"

        async def http() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                outcome["http"] = await client.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": tiny_model_dir.name, "prompt": "Hi", "max_tokens": 4},
                )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sdk)
            nursery.start_soon(http)
        assert outcome["sdk"] == "rejected"
        reply = outcome["http"]
        assert reply.status_code == 429, reply.text
        assert reply.json()["error"]["type"] == "rate_limit_error"
        first.close("holder-2")
        gateway.timeouts = dataclasses.replace(gateway.timeouts, admission_s=ADMIT_S)
        assert await generate(mesh.addr, 8) == expected  # and it serves again


async def tokens_per_s(addr: str, tokens: int) -> float:
    """Decode tokens a second of one greedy stream through the node at ``addr``, from
    its first token to its last."""
    from hetmesh.client.mesh import TokenEvent, open_mesh_client

    stamps: list[float] = []
    async with open_mesh_client(addr, mesh_secret=SECRET) as client:
        async for event in client.stream(prompt_ids=list(PROMPT_IDS), max_new_tokens=tokens):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                stamps.append(trio.current_time())
    assert len(stamps) == tokens, stamps
    return (tokens - 1) / (stamps[-1] - stamps[0])


async def test_idle_sessions_expire_but_a_generating_one_never_does(
    tmp_path: Path, default_model_dir: Path
) -> None:
    idle_s = 2.0  # above the stalls a loaded machine shows, short enough to wait for
    serving = ServingConfig(
        max_sessions=2,
        max_context_tokens=512,
        block_step_s=0.002,
        idle_session_s=idle_s,
        weights="float32",  # two 500 MiB nodes must split it (int4 fits one)
        speculative_k=0,  # one token a step: the pace below holds for the whole stream
    )
    async with open_mesh(tmp_path, serving, 2) as mesh:
        first, *rest = stage_servers(mesh.nodes)
        hold_a_slot(first, "forgotten")  # opened, then never used
        await until_(lambda: "forgotten" not in first.kv, 30, "the idle session to expire")
        assert first.statistics().kv.expired == 1

        # the generation must outlive the idle limit twice over on any machine: a short
        # stream measures this mesh's pace between tokens (a client's connection and the
        # prompt left out), which sets the long one's length with 1.5x to spare
        pace = await tokens_per_s(mesh.addr, 24)
        tokens = max(120, min(480, int(pace * 3 * idle_s)))
        started = trio.current_time()
        got = await generate(mesh.addr, tokens)
        took = trio.current_time() - started
        assert got == reference_ids(default_model_dir, PROMPT_IDS, tokens, "float32")
        # it was seen as in use, never expired (and never recovered from an expiry)
        assert took > 2 * idle_s, f"{tokens} tokens took {took:.1f} s: too short to test"
        assert [s.statistics().kv.expired for s in rest] == [0]
        assert first.statistics().kv.expired == 1
        assert mesh.nodes[0].serving.gateway.statistics().recoveries == 0


async def test_a_small_kv_pool_preempts_and_resumes_with_reference_output(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Each stage has 96 tokens of KV (6 blocks); four generations of 7 + 40 tokens
    (3 blocks each) are admitted by their prompts and outgrow the pool together: the
    newest are preempted and resumed by replay, and every stream still equals the
    reference. A request larger than the pool gets a 400 naming the KV limit, and
    afterwards every stage's pool is whole."""
    tokens = 40
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, tokens)
    port = free_port()
    serving = ServingConfig(
        max_sessions=4,
        max_context_tokens=512,
        kv_pool_tokens=96,
        block_step_s=0.002,
        timeouts=GatewayTimeouts(admission_s=300.0),
    )
    async with open_mesh(
        tmp_path, serving, 2, first={"api_port": port}, model=tiny_model_dir
    ) as mesh:
        gateway = mesh.nodes[0].serving.gateway
        servers = stage_servers(mesh.nodes)
        results: list[list[int]] = []

        async def one() -> None:
            results.append(await generate(mesh.addr, tokens))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        assert results == [expected] * 4
        assert gateway.statistics().preemptions >= 1
        assert sum(s.statistics().kv.preempted for s in servers) >= 1

        async with httpx.AsyncClient(timeout=120) as client:
            reply = await client.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": tiny_model_dir.name, "prompt": "Hi", "max_tokens": 200},
            )
        assert reply.status_code == 400, reply.text
        assert "whole KV pool of 96 tokens" in reply.json()["error"]["message"]

        def whole() -> bool:
            stats = [s.statistics().kv for s in servers]
            return all(k.sessions == 0 and k.blocks_free == k.blocks_total for k in stats)

        await until_(whole, 30, "every stage's KV pool to be whole again")
