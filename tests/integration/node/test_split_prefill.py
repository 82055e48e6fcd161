"""A long prompt's prefill split between two stage servers holding the whole model.

Two real stage servers of the default model ("a" serves the route, "b" helps)
and a real gateway in one trio run, wired by plain calls as in
``test_stage_feeds_itself``, each frame carrying its real sender: the helper
runs the first half of each prompt chunk's layers, the route's stage the rest,
the helper's KV follows, and the tokens must equal the single-process
reference. A helper whose KV never comes, or comes wrong, or a stranger's KV,
must not cost the stream: the gateway replays it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from hetmesh.errors import InvalidRequest, MeshError
from hetmesh.node.control import CloseSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, GatewayTimeouts, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.split import split_unit
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.prefill import PREFILL_CHUNK_TOKENS, prefill_chunks
from hetmesh.partition.prefix import block_hashes, scoped
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Activations, Error, Frame, KVBlock, Tokens
from tests.integration.node.wired import generate_all

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

GATEWAY = "gw"
UNITS = 32  # the default model's: embedding, 30 layers, head
CONTEXT = 384
TOKENS = 12
# two long prompts (two chunks of 96 and more each: split) and a short one (whole)
LONG = [
    [(7 * i + 3) % 40000 + 100 for i in range(300)],
    [(11 * i) % 30000 + 50 for i in range(260)],
]
SHORT = [1, 504, 3458, 282]


class Wiring:
    """Two stage servers holding the whole model and a gateway that splits with "b"."""

    def __init__(
        self, model_dir: Path, *, split: bool = True, timeouts: GatewayTimeouts | None = None
    ) -> None:
        self.servers: dict[str, StageServer] = {}
        self.spans: dict[str, list[Any]] = {"a": [], "b": []}  # what each forward ran
        for name in ("a", "b"):
            stage = load_stage(model_dir, 0, UNITS)
            budget = 4 * CONTEXT * stage.kv_bytes_per_token()
            limits = KVLimits(max_sessions=4, max_tokens_per_session=CONTEXT, budget_bytes=budget)
            self.servers[name] = StageServer(
                stage, limits=limits, send=self._sender(name), send_now=self._sender_now(name)
            )
            self._count_spans(name, stage)
        self.kv_filter: Callable[[KVBlock], KVBlock | None] = lambda frame: frame
        self.gateway = Gateway(
            peer_id=GATEWAY,
            control=self.control,
            send=self._sender(GATEWAY),
            choose=self.choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=CONTEXT,
            helper=self.helper,
            split_prefill=split,
            timeouts=timeouts,
        )

    def _count_spans(self, name: str, stage: Any) -> None:
        forward = stage.forward_batch

        def counted(items, *, last_only=False, heads=None, spans=None):
            self.spans[name].extend(spans or [None] * len(items))
            return forward(items, last_only=last_only, heads=heads, spans=spans)

        stage.forward_batch = counted

    def deliver(self, sender: str, peer: str, frame: Frame) -> None:
        if peer == GATEWAY:
            assert isinstance(frame, Tokens | Error)
            self.gateway.on_frame(frame, sender)
            return
        server = self.servers[peer]
        try:
            if isinstance(frame, KVBlock):
                kept = self.kv_filter(frame)
                if kept is not None:
                    server.receive_kv(kept, release=lambda: None, sender=sender)
                return
            assert isinstance(frame, Activations)
            server.submit(frame, release=lambda: None, sender=sender)
        except MeshError as exc:
            error = Error(code=1, message=str(exc), session_id=frame.session_id)  # type: ignore[attr-defined]
            self.gateway.on_frame(error, peer)

    def _sender(self, name: str) -> Any:
        async def send(peer: str, frame: Frame) -> None:
            self.deliver(name, peer, frame)

        return send

    def _sender_now(self, name: str) -> Any:
        def send_now(peer: str, frame: Frame) -> bool:
            trio.from_thread.run_sync(self.deliver, name, peer, frame)
            return True

        return send_now

    async def control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        return self.servers[peer].handle(request, GATEWAY)

    async def choose(self, session_id: str, avoid: frozenset[str], hashes: object = ()):
        return (Hop("a", 0, UNITS),)

    def helper(self, hops: Any, avoid: frozenset[str], hashes: object = ()):
        return None if "b" in avoid else (Hop("b", 0, UNITS), split_unit(0, UNITS), 0)

    async def ping(self, peer: str) -> bool:
        return True


async def run(wiring: Wiring, prompts: list[list[int]]) -> list[list[int]]:
    return await generate_all(wiring.servers.values(), wiring.gateway, prompts, TOKENS)


_REFERENCE: dict[str, LocalPipeline] = {}


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    torch.set_num_threads(1)
    if "p" not in _REFERENCE:
        _REFERENCE["p"] = LocalPipeline.load(model_dir, 1)
    params = SamplingParams(max_new_tokens=TOKENS)
    return [list(_REFERENCE["p"].generate_ids(p, params, eos_ids=set())) for p in prompts]


def sessions(wiring: Wiring, name: str) -> int:
    return int(wiring.servers[name].kv.statistics().sessions)


async def test_long_prompts_split_with_a_helper_equal_the_reference(
    default_model_dir: Path,
) -> None:
    wiring = Wiring(default_model_dir)
    prompts = [*LONG, SHORT]
    got = await run(wiring, prompts)
    assert got == reference(default_model_dir, prompts)
    stats = wiring.gateway.statistics()
    assert stats.split_prefills == len(LONG)
    assert stats.recoveries == 0
    assert wiring.servers["b"].statistics().helped == len(LONG)
    half = split_unit(0, UNITS)
    # the helper ran only the first half of the long prompts' chunks (3 and 2 of at least
    # 96 tokens), the route's stage the second half of them, then every step whole
    chunks = [len(prefill_chunks(len(p), PREFILL_CHUNK_TOKENS)) for p in LONG]
    assert chunks == [3, 2]
    assert wiring.spans["b"] == [(0, half)] * 5
    assert wiring.spans["a"].count((half, UNITS)) == 5
    assert None in wiring.spans["a"]
    assert sessions(wiring, "a") == sessions(wiring, "b") == 0
    # the prompts' blocks join the prefix cache where every layer's KV is: not the helper's
    for prompt in LONG:
        hashes = set(scoped(block_hashes(prompt), wiring.gateway.peer_id))
        assert hashes <= set(wiring.servers["a"].pool.prefix.recent_hashes(64))
        assert not hashes & set(wiring.servers["b"].pool.prefix.recent_hashes(64))


async def test_split_off_runs_every_prompt_on_its_route(default_model_dir: Path) -> None:
    wiring = Wiring(default_model_dir, split=False)
    got = await run(wiring, LONG[:1])
    assert got == reference(default_model_dir, LONG[:1])
    assert wiring.gateway.statistics().split_prefills == 0
    assert wiring.spans["b"] == []


@pytest.mark.parametrize("fault", ["lost", "misshapen"])
async def test_a_helper_whose_kv_fails_costs_a_replay_not_the_stream(
    default_model_dir: Path, fault: str
) -> None:
    """The route's stage samples the first token, then waits for the helper's KV: lost,
    the step times out; misshapen, the stage refuses it. Either way the gateway replays
    the prompt whole (no second split) and the tokens still equal the reference."""
    # a lost KV stalls the second token: fail that step after 2 s (a step here takes
    # ~50 ms; the prefill keeps its own floor)
    timeouts = GatewayTimeouts(step_floor_s=2.0, max_extensions=0, replan_pause_s=0.01)
    wiring = Wiring(default_model_dir, timeouts=timeouts)

    def broken(frame: KVBlock) -> KVBlock | None:
        if fault == "lost":
            return None
        keys, values = frame.tensors
        return KVBlock(
            session_id=frame.session_id,
            first_layer=0,
            start=frame.start,
            tensors=(keys[:1], values[:1]),  # one layer of fifteen
        )

    wiring.kv_filter = broken
    got = await run(wiring, LONG[:1])
    assert got == reference(default_model_dir, LONG[:1])
    stats = wiring.gateway.statistics()
    assert stats.split_prefills == 1
    assert stats.recoveries == 1
    assert stats.sessions_failed == 0
    assert sessions(wiring, "a") == sessions(wiring, "b") == 0


async def test_only_the_helper_may_send_a_sessions_kv(default_model_dir: Path) -> None:
    """A stranger's KV (or the helper's before it is due) is refused; the session runs on."""
    wiring = Wiring(default_model_dir)
    refused: list[str] = []

    def check(frame: KVBlock) -> KVBlock:
        server = wiring.servers["a"]
        with pytest.raises(InvalidRequest, match="takes its KV from b only") as caught:
            server.receive_kv(frame, release=lambda: None, sender="c")
        refused.append(str(caught.value))
        return frame

    wiring.kv_filter = check
    got = await run(wiring, LONG[:1])
    assert got == reference(default_model_dir, LONG[:1])
    assert len(refused) == 1
    assert wiring.gateway.statistics().recoveries == 0
