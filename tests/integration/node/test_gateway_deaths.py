"""A stage of a session's route declared dead: the gateway recovers at once, not
after its step timeout, and the stream still equals the reference.

Real stages of a seeded tiny Llama and a real gateway (``tiny_hops``); stage
``b`` freezes mid-generation (it swallows what it is sent) and ``b2`` is its
replica. The step timeout is ten minutes: only the death notice can end the
wait in time. The same path on node processes (a SIGKILLed stage, discovery
declaring it dead) is what ``test_mesh_faults.py`` exercises.
"""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio

from hetmesh.node.gateway import GatewayTimeouts, Hop
from hetmesh.partition.sampling import SamplingParams
from tests.integration.node.tiny_hops import PROMPT, Hops, reference, save_tiny_model

STEP_TIMEOUT_S = 600.0
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-deaths"))


async def test_a_dead_stage_recovers_its_sessions_at_once(tiny_model):
    primary = (Hop("a", 0, 2), Hop("b", 2, 4))
    replica = (Hop("a", 0, 2), Hop("b2", 2, 4))
    timeouts = GatewayTimeouts(step_floor_s=STEP_TIMEOUT_S, prefill_floor_s=STEP_TIMEOUT_S)
    hops = Hops(tiny_model, {"a": (0, 2), "b": (2, 4), "b2": (2, 4)}, [primary, replica], timeouts)
    out: list[int] = []
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        with trio.fail_after(120):  # far below the step timeout
            async with aclosing(
                hops.gateway.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
            ) as tokens:
                async for token in tokens:
                    out.append(token)
                    if len(out) == NEW_TOKENS // 2:
                        hops.frozen.add("b")  # its next step never comes back ...

                        async def declare_dead() -> None:
                            await trio.sleep(0.2)  # ... while the gateway waits for it
                            hops.gateway.peer_gone("b")

                        nursery.start_soon(declare_dead)
        nursery.cancel_scope.cancel()
    assert out == reference(tiny_model, NEW_TOKENS)
    stats = hops.gateway.statistics()
    assert stats.recoveries == 1
    assert stats.early_recoveries == 1
    # it did not wait out the step timeout: almost all of it was left
    assert stats.early_recovery_s > STEP_TIMEOUT_S - 120
    assert hops.servers["b2"].statistics().items >= NEW_TOKENS // 2


async def test_a_death_off_the_route_or_of_a_stage_that_answers_changes_nothing(tiny_model):
    """A death elsewhere is none of the session's business; a stage of its route
    declared dead (a loaded discovery can be wrong) that answers a ping is kept."""
    hops = Hops(tiny_model, {"a": (0, 2), "b": (2, 4)}, [(Hop("a", 0, 2), Hop("b", 2, 4))])
    out: list[int] = []
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        async with aclosing(
            hops.gateway.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
        ) as tokens:
            async for token in tokens:
                out.append(token)
                hops.gateway.peer_gone("elsewhere")
                hops.gateway.peer_gone("b")  # alive: it answers pings
        nursery.cancel_scope.cancel()
    assert out == reference(tiny_model, NEW_TOKENS)
    assert hops.gateway.statistics().recoveries == 0
