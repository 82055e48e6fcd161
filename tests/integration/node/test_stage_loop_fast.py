"""The stage loop's fast path and micro-batches, on three real stages of the tiny model.

Stage servers and a gateway in one trio run, wired by plain calls (no
network: the data plane's ``send_nowait`` has its own tests): outputs leave
from the device thread through ``send_now``, and concurrent sessions are
split into micro-batches so the stages can work on different ones at once.
Outputs must equal the single-process reference either way.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio

from hetmesh.errors import MeshError
from hetmesh.node.control import CloseSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.prefill import PREFILL_CHUNK_TOKENS
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Activations, Error, Frame, Tokens
from tests.integration.node.wired import generate_all

pytestmark = [pytest.mark.slow, pytest.mark.model]

GATEWAY = "gw"
LAYOUT = {"a": (0, 11), "b": (11, 21), "c": (21, 32)}
PROMPTS = [[1, 504, 3458, 282], [1029, 314, 253], [77, 78, 79, 80, 81], [900, 901]]
TOKENS = 6


class Wiring:
    """Three stage servers and a gateway; counts the frames each path carried."""

    def __init__(self, model_dir: Path, *, fast: bool, context: int = 64, chunk_costs=None) -> None:
        self.servers: dict[str, StageServer] = {}
        self.batches: list[int] = []  # items of each forward, every stage
        self.rows: dict[str, list[list[int]]] = {}  # each forward's items' rows, per stage
        for peer, (start, end) in LAYOUT.items():
            stage = load_stage(model_dir, start, end)
            budget = 8 * context * stage.kv_bytes_per_token()
            limits = KVLimits(max_sessions=8, max_tokens_per_session=context, budget_bytes=budget)
            self.servers[peer] = StageServer(
                stage,
                limits=limits,
                send=self.send,
                send_now=self.send_now if fast else None,
                lane=False,  # frames come by plain calls: no reader thread offers them
            )
            forward = stage.forward_batch
            rows = self.rows[peer] = []

            def counted(
                items, *, last_only=False, heads=None, spans=None, forward=forward, rows=rows
            ):
                self.batches.append(len(items))
                rows.append([int(x.shape[0]) for x, _ in items])
                return forward(items, last_only=last_only, heads=heads, spans=spans)

            stage.forward_batch = counted
        self.via_trio = self.via_thread = 0
        self.gateway = Gateway(
            peer_id=GATEWAY,
            control=self.control,
            send=self.send,
            choose=self.choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=context,
            chunk_costs=chunk_costs,
        )

    def deliver(self, peer: str, frame: Frame) -> None:
        if peer == GATEWAY:
            assert isinstance(frame, Tokens | Error)
            self.gateway.on_frame(frame)
            return
        assert isinstance(frame, Activations)
        try:
            self.servers[peer].submit(frame, release=lambda: None)
        except MeshError as exc:
            self.gateway.on_frame(Error(code=1, message=str(exc), session_id=frame.session_id))

    async def send(self, peer: str, frame: Frame) -> None:
        if isinstance(frame, Tokens) or peer in ("b", "c"):  # a stage's output
            self.via_trio += 1
        self.deliver(peer, frame)

    def send_now(self, peer: str, frame: Frame) -> bool:
        """Called on a stage's device thread: the frame is handed over right there."""
        self.via_thread += 1
        trio.from_thread.run_sync(self.deliver, peer, frame)
        return True

    async def control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        return self.servers[peer].handle(request)

    async def choose(self, session_id: str, avoid: frozenset[str], hashes: object = ()):
        return tuple(Hop(peer, *units) for peer, units in LAYOUT.items())

    async def ping(self, peer: str) -> bool:
        return True


async def run_sessions(wiring: Wiring, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return await generate_all(wiring.servers.values(), wiring.gateway, prompts, TOKENS)


@functools.cache
def reference(
    model_dir: Path, prompts: tuple[tuple[int, ...], ...] | None = None
) -> list[list[int]]:
    pipeline = LocalPipeline.load(model_dir, 1)
    params = SamplingParams(max_new_tokens=TOKENS)
    chosen = PROMPTS if prompts is None else [list(p) for p in prompts]
    return [list(pipeline.generate_ids(p, params, eos_ids=set())) for p in chosen]


async def test_stage_outputs_leave_from_the_device_thread_and_match_the_reference(
    tiny_model_dir: Path,
) -> None:
    wiring = Wiring(tiny_model_dir, fast=True)
    with trio.fail_after(120):
        results = await run_sessions(wiring)
    assert results == reference(tiny_model_dir)
    # every stage output (activations to b and c, tokens to the gateway) took the
    # device thread's path: one per session and step on each of the three stages
    assert wiring.via_thread == 3 * len(PROMPTS) * TOKENS
    assert wiring.via_trio == 0
    for server in wiring.servers.values():
        assert server.statistics().kv.sessions == 0
        # without the lane no device thread parks: each step comes back through trio
        assert server._lane.parks == 0


async def test_concurrent_sessions_run_as_micro_batches_of_half_the_sessions(
    tiny_model_dir: Path,
) -> None:
    wiring = Wiring(tiny_model_dir, fast=False)
    with trio.fail_after(120):
        results = await run_sessions(wiring)
    assert results == reference(tiny_model_dir)
    assert wiring.via_thread == 0  # without send_now, everything goes through trio
    # four sessions open: no forward takes more than two, and some take two
    assert max(wiring.batches) == 2
    assert wiring.batches.count(2) > 0


# one prompt of 400 tokens beside two short ones: four chunks of at least 96, tapered on
# this route of two stages (hetmesh.partition.prefill.prefill_schedule: the ends half the
# middle)
LONG = [(7 * i + 11) % 49_000 + 20 for i in range(400)]
TAPERED = [67, 133, 133, 67]


@pytest.mark.parametrize("fast", [True, False], ids=["send_now", "trio"])
async def test_a_long_prompt_leaves_in_chunks_and_matches_the_reference(
    tiny_model_dir: Path, fast: bool
) -> None:
    prompts = [LONG, PROMPTS[0], PROMPTS[1]]
    wiring = Wiring(tiny_model_dir, fast=fast, context=512)
    assert wiring.gateway.prefill_chunk_tokens == PREFILL_CHUNK_TOKENS == 96
    with trio.fail_after(120):
        results = await run_sessions(wiring, prompts)
    assert results == reference(tiny_model_dir, tuple(tuple(p) for p in prompts))
    if fast:  # the chunks kept the device thread's path: nothing waited in an outbox
        assert wiring.via_trio == 0
    # every stage computed the long prompt as its four chunks, in four rounds
    for peer, rounds in wiring.rows.items():
        chunks = [n for items in rounds for n in items if n > len(PROMPTS[0])]
        assert chunks == TAPERED, (peer, rounds)
    # the last stage sampled once a step: no token for the first two chunks
    statistics = wiring.gateway.statistics()
    assert statistics.stale_frames == 0
    assert statistics.tokens_out == TOKENS * len(prompts)
    for server in wiring.servers.values():
        assert server.statistics().kv.sessions == 0


async def test_more_chunks_than_four_where_the_cap_says_so(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HETMESH_PREFILL_MAX_CHUNKS=8``: the prompt leaves as 8 chunks, every stage
    queues and computes them all, and the tokens stay the reference's."""
    monkeypatch.setenv("HETMESH_PREFILL_MAX_CHUNKS", "8")
    monkeypatch.setenv("HETMESH_PREFILL_TAPER", "0")  # even chunks: 8 of the size asked
    prompts = [LONG, PROMPTS[0]]
    wiring = Wiring(tiny_model_dir, fast=True, context=512)
    wiring.gateway.prefill_chunk_tokens = 50
    with trio.fail_after(120):
        results = await run_sessions(wiring, prompts)
    assert results == reference(tiny_model_dir, tuple(tuple(p) for p in prompts))
    for peer, rounds in wiring.rows.items():
        chunks = [n for items in rounds for n in items if n > len(PROMPTS[0])]
        assert chunks == [50] * 8, (peer, rounds)
    assert wiring.gateway.statistics().stale_frames == 0


async def test_with_chunking_off_a_prompt_leaves_whole(tiny_model_dir: Path) -> None:
    wiring = Wiring(tiny_model_dir, fast=True, context=512)
    wiring.gateway.prefill_chunk_tokens = 0
    with trio.fail_after(120):
        results = await run_sessions(wiring, [LONG])
    assert results == reference(tiny_model_dir, (tuple(LONG),))
    for rounds in wiring.rows.values():
        assert [n for items in rounds for n in items if n > 1] == [400]


@pytest.mark.parametrize(
    ("costs", "sizes"),
    [({"b": 1.74}, [400]), ({"a": 1.1, "b": 1.0}, TAPERED)],
    ids=["one-stage-costly", "cheap-or-unknown"],
)
async def test_a_route_prefills_whole_where_a_stage_measured_chunks_costly(
    tiny_model_dir: Path, costs: dict[str, float], sizes: list[int]
) -> None:
    asked: list[tuple[str, ...]] = []

    def chunk_costs(hops: tuple[Hop, ...]) -> list[float | None]:
        asked.append(tuple(h.peer_id for h in hops))
        return [costs.get(h.peer_id) for h in hops]

    wiring = Wiring(tiny_model_dir, fast=True, context=512, chunk_costs=chunk_costs)
    with trio.fail_after(120):
        results = await run_sessions(wiring, [LONG])
    assert results == reference(tiny_model_dir, (tuple(LONG),))
    for rounds in wiring.rows.values():
        assert [n for items in rounds for n in items if n > 1] == sizes
    assert asked == [tuple(LAYOUT)]  # asked for the prefill only, not for each decode step
