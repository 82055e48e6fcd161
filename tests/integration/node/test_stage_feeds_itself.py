"""A stage holding the whole model feeds a session itself (``OpenSession.feed_steps``).

One real stage server of the tiny model and a real gateway in one trio run,
wired by plain calls as in ``test_stage_loop_fast``: from each step its gateway
sends, the stage generates up to ``feed_steps`` tokens, each sampled token the
input of its next step, running on in the device thread while nothing new waits.
The tokens must equal the single-process reference however the sessions come
and go, with a step from the gateway once a feed instead of once a token.
"""

from __future__ import annotations

import math
import time
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from hetmesh.errors import InvalidRequest, MeshError
from hetmesh.node.control import MAX_FEED_STEPS, CloseSession, OpenSession, Reply, parse_request
from hetmesh.node.gateway import Gateway, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Activations, Error, Frame, Tokens

pytestmark = [pytest.mark.slow, pytest.mark.model]

GATEWAY = "gw"
PROMPTS = [[1, 504, 3458, 282], [1029, 314, 253], [77, 78, 79, 80, 81], [900, 901]]
TOKENS = 20
CONTEXT = 64


class Wiring:
    """One stage server holding the whole model and a gateway; counts what travels."""

    def __init__(
        self, model_dir: Path, *, feed_steps: int, eos: frozenset[int] = frozenset()
    ) -> None:
        stage = load_stage(model_dir, 0, 32)
        assert stage.has_embed
        assert stage.has_head
        budget = 8 * CONTEXT * stage.kv_bytes_per_token()
        limits = KVLimits(max_sessions=8, max_tokens_per_session=CONTEXT, budget_bytes=budget)
        self.server = StageServer(stage, limits=limits, send=self.send, send_now=self.send_now)
        self.forwards: dict[str, int] = {}  # session id -> the forwards it took part in
        forward = stage.forward_batch

        def counted(items, *, last_only=False, heads=None, spans=None):
            for _, kv in items:
                sid = next(s for s, v in self.server._sessions.items() if v.kv is kv)
                self.forwards[sid] = self.forwards.get(sid, 0) + 1
            return forward(items, last_only=last_only, heads=heads, spans=spans)

        stage.forward_batch = counted
        self.steps_sent = 0  # activation frames from the gateway
        self.tokens_seen: dict[str, int] = {}  # session id -> its token frames
        self.gateway = Gateway(
            peer_id=GATEWAY,
            control=self.control,
            send=self.send,
            choose=self.choose,
            ping=self.ping,
            eos_token_ids=eos,
            max_context=CONTEXT,
            feed_steps=feed_steps,
        )

    def deliver(self, peer: str, frame: Frame) -> None:
        if peer == GATEWAY:
            assert isinstance(frame, Tokens | Error)
            if isinstance(frame, Tokens):
                seen = self.tokens_seen.get(frame.session_id, 0)
                self.tokens_seen[frame.session_id] = seen + 1
            self.gateway.on_frame(frame)
            return
        assert isinstance(frame, Activations)
        self.steps_sent += 1
        try:
            self.server.submit(frame, release=lambda: None)
        except MeshError as exc:
            self.gateway.on_frame(Error(code=1, message=str(exc), session_id=frame.session_id))

    async def send(self, peer: str, frame: Frame) -> None:
        self.deliver(peer, frame)

    def send_now(self, peer: str, frame: Frame) -> bool:
        """On the stage's device thread: handed over right there."""
        trio.from_thread.run_sync(self.deliver, peer, frame)
        return True

    async def control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        return self.server.handle(request)

    async def choose(self, session_id: str, avoid: frozenset[str], hashes: object = ()):
        return (Hop("a", 0, 32),)

    async def ping(self, peer: str) -> bool:
        return True


async def run_sessions(
    wiring: Wiring, prompts: list[list[int]] = PROMPTS, *, staggered: bool = False
) -> list[list[int]]:
    """Every prompt's greedy tokens; ``staggered``: the others start once the first
    has its third token (they join a session running on in the device thread)."""
    results: list[list[int]] = [[] for _ in prompts]
    third = trio.Event()

    async def one(i: int) -> None:
        if staggered and i > 0:
            await third.wait()
        params = SamplingParams(max_new_tokens=TOKENS)
        async with aclosing(wiring.gateway.generate(prompts[i], params)) as tokens:
            async for token in tokens:
                results[i].append(token)
                if len(results[i]) == 3:
                    third.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(wiring.server.serve)
        async with trio.open_nursery() as clients:
            for i in range(len(prompts)):
                clients.start_soon(one, i)
        nursery.cancel_scope.cancel()
    return results


def reference(model_dir: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    pipeline = LocalPipeline.load(model_dir, 1)
    params = SamplingParams(max_new_tokens=TOKENS)
    return [list(pipeline.generate_ids(p, params, eos_ids=set())) for p in prompts]


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "staggered"])
async def test_a_fed_stage_generates_the_reference_with_a_step_per_feed(
    tiny_model_dir: Path, staggered: bool
) -> None:
    wiring = Wiring(tiny_model_dir, feed_steps=8)
    with trio.fail_after(120):
        results = await run_sessions(wiring, staggered=staggered)
    assert results == reference(tiny_model_dir)
    # the prompt and then one step every 8 tokens: 3 steps for 20 tokens, not 20
    assert wiring.steps_sent == len(PROMPTS) * math.ceil(TOKENS / 8)
    # every token computed once (none past the last) and sent once
    assert sum(wiring.forwards.values()) == len(PROMPTS) * TOKENS
    assert all(n == TOKENS for n in wiring.tokens_seen.values())
    stats = wiring.gateway.statistics()
    assert stats.stale_frames == 0
    assert stats.tokens_out == len(PROMPTS) * TOKENS
    assert wiring.server.statistics().kv.sessions == 0
    # most rounds the stage fed itself ran on in the device thread, with no trio hop
    stats = wiring.server.statistics()
    assert stats.device_rounds > stats.rounds / 2


async def test_a_feed_runs_on_across_the_end_of_a_kv_block(tiny_model_dir: Path) -> None:
    """A 4-token prompt and 20 tokens in feeds of 16 fill its first 16-token block
    mid-feed: the feed's blocks were taken with its step, so the device thread runs
    on past the block's end and every batch starts from a step of the gateway."""
    wiring = Wiring(tiny_model_dir, feed_steps=16)
    with trio.fail_after(120):
        results = await run_sessions(wiring, PROMPTS[:1])
    assert results == reference(tiny_model_dir, PROMPTS[:1])
    assert wiring.steps_sent == 2  # the prompt, then one more feed
    stats = wiring.server.statistics()
    assert stats.rounds == TOKENS
    assert stats.rounds - stats.device_rounds == wiring.steps_sent  # one batch per step


async def test_one_token_a_step_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    wiring = Wiring(tiny_model_dir, feed_steps=1)
    with trio.fail_after(120):
        results = await run_sessions(wiring)
    assert results == reference(tiny_model_dir)
    assert wiring.steps_sent == len(PROMPTS) * TOKENS
    assert wiring.server.statistics().device_rounds == 0


async def test_a_fed_stage_stops_at_an_end_of_sequence_id(tiny_model_dir: Path) -> None:
    expected = reference(tiny_model_dir)[0]
    stop = expected[5]
    cut = expected.index(stop)  # the first time it comes
    wiring = Wiring(tiny_model_dir, feed_steps=16, eos=frozenset({stop}))
    with trio.fail_after(120):
        (result,) = await run_sessions(wiring, [PROMPTS[0]])
    assert result == expected[:cut]
    # the stage sampled the stop id and fed itself no further: nothing to drop
    assert sum(wiring.forwards.values()) == cut + 1
    assert sum(wiring.tokens_seen.values()) == cut + 1
    assert wiring.gateway.statistics().stale_frames == 0


def test_feed_steps_are_bounded_on_the_wire() -> None:
    base = OpenSession(
        session_id="s",
        start=0,
        end=32,
        next_peer=GATEWAY,
        gateway=GATEWAY,
        max_tokens=8,
        sampling=SamplingParams(),
    ).to_wire()
    assert parse_request({**base, "feed_steps": 8, "stop_ids": [2]}).feed_steps == 8
    for bad in ({"feed_steps": 0}, {"feed_steps": MAX_FEED_STEPS + 1}, {"stop_ids": [1] * 17}):
        with pytest.raises(MeshError, match="malformed session request"):
            parse_request({**base, **bad})


def test_only_a_stage_holding_the_whole_model_feeds_itself(tiny_model_dir: Path) -> None:
    stage = load_stage(tiny_model_dir, 0, 11)
    budget = 2 * CONTEXT * stage.kv_bytes_per_token()
    limits = KVLimits(max_sessions=2, max_tokens_per_session=CONTEXT, budget_bytes=budget)

    async def send(peer: str, frame: Frame) -> None:
        raise AssertionError("nothing is sent")

    server = StageServer(stage, limits=limits, send=send)
    request = OpenSession(
        session_id="s",
        start=0,
        end=11,
        next_peer="b",
        gateway=GATEWAY,
        max_tokens=8,
        sampling=SamplingParams(),
        feed_steps=4,
    )
    reply = server.handle(request, GATEWAY)
    assert not reply.ok
    assert isinstance(reply.error(), InvalidRequest)
    assert "whole model" in reply.message
    assert server.statistics().kv.sessions == 0


async def test_the_gateway_knows_which_of_its_sessions_a_load_counted(
    tiny_model_dir: Path,
) -> None:
    """``Gateway.sessions_during``: the router subtracts ours from a peer's announced load by
    when that load was sampled, so streams that have ended do not linger as load."""
    wiring = Wiring(tiny_model_dir, feed_steps=8)
    gateway = wiring.gateway
    mid_stream: list[dict[str, int]] = []

    async def one() -> None:  # while it streams, it counts as running on "a" now
        async with aclosing(gateway.generate(PROMPTS[0], SamplingParams(max_new_tokens=4))) as t:
            async for _ in t:
                now = time.time()
                mid_stream.append(gateway.sessions_during({"a": (now, now), "b": (now, now)}))

    before = time.time()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(wiring.server.serve)
            await one()
            nursery.cancel_scope.cancel()
        assert mid_stream == [{"a": 1, "b": 0}] * 4
        await run_sessions(wiring)
    after = time.time()
    assert gateway.routes() == []
    during = gateway.sessions_during(
        {
            "a": (before, after),  # each ran on "a"
            "b": (before, after),  # a peer none ran on
        }
    )
    assert during == {"a": len(PROMPTS) + 1, "b": 0}
    assert gateway.sessions_during({"a": (after + 1, after + 2)}) == {"a": 0}  # all ended
    assert gateway.sessions_during({"a": (before - 2, before - 1)}) == {"a": 0}  # not begun
