"""No token twice: a token frame names its sequence position, the gateway drops any
position it already delivered, and a stage frozen mid-step, thawed after its session
was replayed elsewhere, cannot put its late token into the stream (issue 44).

Real stages of a seeded tiny Llama and a real gateway (``tiny_hops``); what a peer
sends to the gateway can be held (a frozen process's socket) and let go later.
"""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio

from hetmesh.node.gateway import Hop
from hetmesh.partition.sampling import SamplingParams
from hetmesh.transport.frames import Frame, Tokens
from tests.integration.node.tiny_hops import GATEWAY, PROMPT, Hops, reference, save_tiny_model

NEW_TOKENS = 12
PRIMARY = (Hop("a", 0, 2), Hop("b", 2, 4))
REPLICA = (Hop("a", 0, 2), Hop("b2", 2, 4))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-twice"))


class HeldHops(Hops):
    """``held`` peers compute on, but what they send the gateway waits (in order)
    until :meth:`thaw`, and they answer no ping: a frozen process."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, list[Frame]] = {}
        self.caught = trio.Event()  # a held peer sent the gateway a frame

    def hold(self, peer: str) -> None:
        self.held[peer] = []
        self.caught = trio.Event()

    async def deliver(self, sender: str, peer: str, frame: Frame) -> None:
        if peer == GATEWAY and sender in self.held:
            self.held[sender].append(frame)
            self.caught.set()
            return
        await super().deliver(sender, peer, frame)

    async def ping(self, peer: str) -> bool:
        if peer in self.held:
            await trio.sleep_forever()
        return await super().ping(peer)

    def thaw(self, peer: str) -> int:
        frames = self.held.pop(peer)
        for frame in frames:
            self.gateway.on_frame(frame, peer)  # type: ignore[arg-type]
        return len(frames)


async def test_a_position_already_delivered_is_dropped(tiny_model):
    """A token frame of the awaited step from the route's last stage, but at a position
    the stream already holds (what a stage that resumed stale work would send), is
    dropped: only the awaited position is delivered."""
    hops = HeldHops(tiny_model, {"a": (0, 2), "b": (2, 4)}, [PRIMARY])
    out: list[int] = []
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        async with aclosing(
            hops.gateway.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
        ) as tokens:
            async for token in tokens:
                out.append(token)
                if len(out) == 4:
                    hops.hold("b")  # b's real token for step 4 waits behind the forgery
                    (session_id,) = hops.gateway.session_ids()
                    stale = Tokens(
                        session_id=session_id,
                        step=len(out),  # the step the gateway awaits ...
                        token_ids=((out[-1] + 1) % 96,),  # ... not the reference's token
                        position=len(PROMPT) + len(out) - 1,  # ... at a delivered position
                    )
                    hops.gateway.on_frame(stale, "b")
                    hops.gateway.on_frame(stale, "b")
                    nursery.start_soon(_thaw_when_computed, hops, "b")
        nursery.cancel_scope.cancel()
    assert out == reference(tiny_model, NEW_TOKENS)
    assert hops.gateway.statistics().stale_frames == 2
    assert hops.gateway.statistics().recoveries == 0


async def _thaw_when_computed(hops: HeldHops, peer: str) -> None:
    await hops.caught.wait()  # its token for the awaited step is in
    hops.thaw(peer)


async def test_a_stage_thawed_after_its_session_moved_on_injects_nothing(tiny_model):
    """``b`` freezes holding step 6's token; the gateway replays the session on ``b2``
    and finishes it; then ``b`` thaws and sends what it computed: all dropped."""
    hops = HeldHops(tiny_model, {"a": (0, 2), "b": (2, 4), "b2": (2, 4)}, [PRIMARY, REPLICA])
    out: list[int] = []
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        with trio.fail_after(120):
            async with aclosing(
                hops.gateway.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
            ) as tokens:
                async for token in tokens:
                    out.append(token)
                    if len(out) == NEW_TOKENS // 2:
                        hops.hold("b")
                        nursery.start_soon(_declare_dead_when_computed, hops, "b")
        before = hops.gateway.statistics().stale_frames
        thawed = hops.thaw("b")
        nursery.cancel_scope.cancel()
    assert thawed >= 1  # it did compute the step it was frozen in
    assert out == reference(tiny_model, NEW_TOKENS)
    stats = hops.gateway.statistics()
    assert stats.recoveries == 1
    assert stats.stale_frames == before + thawed
    assert stats.tokens_out == NEW_TOKENS


async def _declare_dead_when_computed(hops: HeldHops, peer: str) -> None:
    await hops.caught.wait()
    hops.gateway.peer_gone(peer)
