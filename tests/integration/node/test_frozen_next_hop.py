"""A frozen next hop holds up only the sessions routed through it.

Stage ``a`` feeds two replicas of the next stage: one session goes through
``b``, another through ``b2``. ``b`` gets stuck mid-generation (a send to it
never returns, as to a SIGSTOPped process whose socket is full): the session
through ``b2`` still runs to the end, and once ``b`` is declared dead the
first session recovers on ``b2``; both equal the reference. Real stages of a
seeded tiny Llama and a real gateway (``tiny_hops``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing

import pytest
import trio

from hetmesh.node.gateway import GatewayTimeouts, Hop
from hetmesh.partition.sampling import SamplingParams
from tests.integration.node.tiny_hops import PROMPT, Hops, reference, save_tiny_model

NEW_TOKENS = 10
PRIMARY = (Hop("a", 0, 2), Hop("b", 2, 4))
REPLICA = (Hop("a", 0, 2), Hop("b2", 2, 4))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-frozen"))


class TwoRoutes(Hops):
    """The first session is routed through ``b``, the others through ``b2``."""

    def __init__(self, model_dir) -> None:
        timeouts = GatewayTimeouts(step_floor_s=600.0, prefill_floor_s=600.0)
        layout = {"a": (0, 2), "b": (2, 4), "b2": (2, 4)}
        super().__init__(model_dir, layout, [PRIMARY, REPLICA], timeouts)
        self.first = ""

    async def choose(
        self, session_id: str, avoid: frozenset[str], hashes: Sequence[int] = ()
    ) -> tuple[Hop, ...]:
        self.first = self.first or session_id
        return PRIMARY if session_id == self.first and "b" not in avoid else REPLICA


async def test_a_stuck_next_hop_stalls_only_its_own_sessions(tiny_model):
    hops = TwoRoutes(tiny_model)
    got: dict[str, list[int]] = {"through b": [], "through b2": []}
    stuck, first_done = trio.Event(), trio.Event()

    async def run(name: str) -> None:
        async with aclosing(
            hops.gateway.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
        ) as tokens:
            async for token in tokens:
                got[name].append(token)
                if name == "through b" and len(got[name]) == 2:
                    hops.stuck.add("b")  # stage a's next send to b never returns
                    stuck.set()
        if name == "through b":
            first_done.set()

    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        nursery.start_soon(run, "through b")
        await stuck.wait()
        with trio.fail_after(120):  # before the fix: stage a waits on b for ever
            await run("through b2")
        assert got["through b"] == reference(tiny_model, NEW_TOKENS)[:2]  # held up meanwhile
        hops.gateway.peer_gone("b")
        with trio.fail_after(120):
            await first_done.wait()
        nursery.cancel_scope.cancel()
    expected = reference(tiny_model, NEW_TOKENS)
    assert got["through b2"] == expected
    assert got["through b"] == expected
