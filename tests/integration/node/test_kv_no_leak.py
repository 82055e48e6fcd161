"""No KV block leaks over 200 mixed sessions on the in-process tiny mesh.

Finished, cancelled, preempted and prefix-sharing sessions run through three
real stage servers whose pools are small (10 blocks each), and every stream
still equals the single-process reference; afterwards every pool is back to
its initial free count (cached blocks no session holds count as free).
"""

from __future__ import annotations

import random
from contextlib import aclosing

import trio

from hetmesh.node.gateway import Hop
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from tests.integration.node.test_serving_inprocess import (  # the tiny mesh and its model
    Mesh,
    collect,
    make_gateway,
    tiny_model,
)

__all__ = ["tiny_model"]  # a fixture, used by name

SYSTEM = [7, 3, 11, 5] * 5  # 20 tokens: a full block shared by every prompt below
PROMPTS = [SYSTEM + tail for tail in ([40], [41, 42], [43] * 12, [44, 45, 46])] + [
    [9, 8, 7],
    SYSTEM[:16] + [50] * 20,
]


async def test_no_block_leaks_after_two_hundred_mixed_sessions(tiny_model):
    mesh = Mesh(tiny_model, {"a": (0, 2), "b": (2, 4), "c": (4, 6)}, pool_tokens=160)
    hops = (Hop("a", 0, 2), Hop("b", 2, 4), Hop("c", 4, 6))
    gateway = make_gateway(mesh, [hops], admission_s=120.0)
    initial = {peer: s.pool.free_blocks for peer, s in mesh.servers.items()}
    local = LocalPipeline.load(tiny_model, 1)
    expected = {
        i: list(local.generate_ids(p, SamplingParams(max_new_tokens=24), eos_ids=set()))
        for i, p in enumerate(PROMPTS)
    }
    rng = random.Random(5)
    jobs = [
        (rng.randrange(len(PROMPTS)), rng.randint(1, 24), rng.random() < 0.2) for _ in range(200)
    ]
    wrong: list[tuple[int, int]] = []
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)

        async def run(job: int) -> None:
            which, tokens, cancel = jobs[job]
            params = SamplingParams(max_new_tokens=tokens)
            if cancel:  # the client goes away after its first token
                async with aclosing(gateway.generate(PROMPTS[which], params)) as stream:
                    async for _ in stream:
                        break
                return
            if await collect(gateway, PROMPTS[which], params) != expected[which][:tokens]:
                wrong.append((job, which))

        for wave in range(0, len(jobs), 8):  # eight at a time: they outgrow the pools
            async with trio.open_nursery() as clients:
                for job in range(wave, wave + 8):
                    clients.start_soon(run, job)
        nursery.cancel_scope.cancel()
    assert wrong == []
    stats = {peer: s.statistics().kv for peer, s in mesh.servers.items()}
    assert sum(k.preempted for k in stats.values()) >= 1  # the mix did preempt
    assert all(k.prefix_hit_tokens > 0 for k in stats.values())  # and shared prefixes
    assert gateway.statistics().prefix_tokens_skipped > 0
    for peer, kv in stats.items():
        assert kv.sessions == 0, peer
        assert kv.blocks_free == initial[peer] == kv.blocks_total, peer
        assert kv.blocks_in_use == 0, peer
