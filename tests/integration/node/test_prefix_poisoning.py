"""A hostile gateway cannot poison the shared prefix cache (issue 45, item 2).

Real stages of a seeded tiny Llama (``tiny_hops``) and two real gateways: the
honest one and a member acting as gateway whose sessions name their blocks
with another prompt's hashes (its own text, the victim prompt's names), on
open and on close, as a hostile gateway may. The honest user's output still
equals the single-process reference, and its own repeated prompt still
skips its cached prefix (sharing within one gateway is kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

import pytest
import trio

from hetmesh.node.control import CloseSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, Hop
from hetmesh.partition import prefix
from hetmesh.partition.sampling import SamplingParams
from hetmesh.transport.frames import Frame
from tests.integration.node.tiny_hops import GATEWAY, Hops, reference, save_tiny_model

EVIL = "evil-gateway"
NEW_TOKENS = 8
# two full blocks and a tail each; the attack's text differs from the victim's
VICTIM = [(7 * i + 3) % 90 + 4 for i in range(33)]
ATTACK = [(11 * i + 5) % 90 + 4 for i in range(33)]
PIPELINE = (Hop("a", 0, 2), Hop("b", 2, 4))
_real_hashes = prefix.block_hashes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """``tiny_hops``' Llama with larger weights: its greedy output follows its context
    (the default init's repeats one token whatever the prompt)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-poison"), initializer_range=0.3)


def forged(history: Sequence[int], block_tokens: int = 16) -> list[int]:
    """The victim's hashes for the attack's text (its own tail hashed on top)."""
    if list(history[: len(ATTACK)]) == ATTACK:
        history = [*VICTIM, *history[len(ATTACK) :]]
    return _real_hashes(history, block_tokens)


class TwoGateways(Hops):
    """``Hops`` plus a second gateway, the hostile member's."""

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir, {"a": (0, 2), "b": (2, 4)}, [PIPELINE])
        self.evil = Gateway(
            peer_id=EVIL,
            control=self._evil_control,
            send=self._sender(EVIL),
            choose=self.choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=64,
        )

    async def _evil_control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        return self.servers[peer].handle(request, EVIL)

    async def deliver(self, sender: str, peer: str, frame: Frame) -> None:
        if peer == EVIL:
            self.evil.on_frame(frame, sender)  # type: ignore[arg-type]
            return
        await super().deliver(sender, peer, frame)


async def run(gateway: Gateway, prompt: list[int]) -> list[int]:
    out: list[int] = []
    async with aclosing(
        gateway.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
    ) as tokens:
        async for token in tokens:
            out.append(token)
    return out


async def test_a_hostile_gateways_named_blocks_do_not_change_an_honest_users_output(
    tiny_model, monkeypatch
):
    hops = TwoGateways(tiny_model)
    expected = reference(tiny_model, NEW_TOKENS, VICTIM)
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        with trio.fail_after(120):
            # the hostile gateway's sessions name its text's blocks by the victim's hashes
            monkeypatch.setattr("hetmesh.node.gateway.block_hashes", forged)
            await run(hops.evil, ATTACK)
            monkeypatch.setattr("hetmesh.node.gateway.block_hashes", _real_hashes)
            # its blocks are cached (the stages named them, under its own name)
            assert all(s.pool.cached_blocks >= 2 for s in hops.servers.values())
            first = await run(hops.gateway, VICTIM)
            skipped_first = hops.gateway.statistics().prefix_tokens_skipped
            second = await run(hops.gateway, VICTIM)  # its own blocks are shared with it
            skipped_second = hops.gateway.statistics().prefix_tokens_skipped - skipped_first
        nursery.cancel_scope.cancel()
    assert first == expected  # before the fix: the attack's KV was attended to
    assert second == expected
    assert (skipped_first, skipped_second) == (0, 32)
    assert GATEWAY != EVIL
