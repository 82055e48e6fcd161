"""Running greedy requests through a gateway wired to stage servers by plain calls
(``test_stage_loop_fast``, ``test_split_prefill``): the servers' batching loops
run for as long as the requests do."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import aclosing

import trio

from hetmesh.node.gateway import Gateway
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.sampling import SamplingParams


async def generate_all(
    servers: Iterable[StageServer],
    gateway: Gateway,
    prompts: Sequence[Sequence[int]],
    tokens: int,
) -> list[list[int]]:
    """Every prompt's greedy tokens (``tokens`` each), the prompts run concurrently."""
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(max_new_tokens=tokens)
        async with aclosing(gateway.generate(prompts[i], params)) as stream:
            async for token in stream:
                results[i].append(token)

    async with trio.open_nursery() as nursery:
        for server in servers:
            await nursery.start(server.serve)
        async with trio.open_nursery() as clients:
            for i in range(len(prompts)):
                clients.start_soon(one, i)
        nursery.cancel_scope.cancel()
    return results
