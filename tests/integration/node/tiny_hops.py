"""Real stages of a seeded tiny Llama and a real gateway, wired by direct calls that
name each frame's sender (as the node's dispatcher does for a link), for the
session-ownership and recovery tests. A peer may be frozen (what is sent to it
is swallowed, its control calls never return) or stuck (a send to it never
returns, as to a frozen process whose socket is full)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from hetmesh.errors import InvalidRequest, PeerUnreachable
from hetmesh.node.control import CloseSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, GatewayTimeouts, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.grammar import Grammars
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Activations, Error, Frame, Tokens

GATEWAY = "gw"
INTRUDER = "intruder"
PROMPT = [5, 17, 33, 2, 9, 41, 7]


def save_tiny_model(folder: Path, initializer_range: float = 0.02) -> Path:
    """A seeded two-layer Llama (units: embed, 2 blocks, head) saved in ``folder``;
    ``initializer_range``: the spread of its random weights (transformers' default)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
    )
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def reference(model_dir: Path, n: int, prompt: list[int] = PROMPT) -> list[int]:
    pipeline = LocalPipeline.load(model_dir, 1)
    return list(pipeline.generate_ids(prompt, SamplingParams(max_new_tokens=n), eos_ids=set()))


class Hops:
    """Stage servers by peer id and one gateway; ``pipelines`` are tried in order,
    skipping any that uses an avoided peer."""

    def __init__(
        self,
        model_dir: Path,
        layout: dict[str, tuple[int, int]],
        pipelines: list[tuple[Hop, ...]],
        timeouts: GatewayTimeouts | None = None,
        *,
        grammars: Grammars | None = None,
        max_tokens: int = 64,
    ) -> None:
        """``grammars``: the model's grammar engine (a model with a tokenizer);
        ``max_tokens``: each session's and the gateway's context."""
        self.servers: dict[str, StageServer] = {}
        for peer, (a, b) in layout.items():
            stage = load_stage(model_dir, a, b)
            self.servers[peer] = StageServer(
                stage,
                limits=KVLimits(
                    max_sessions=4,
                    max_tokens_per_session=max_tokens,
                    budget_bytes=4 * max_tokens * stage.kv_bytes_per_token(),
                ),
                send=self._sender(peer),
                grammars=grammars,
            )
        self.pipelines = pipelines
        self.frozen: set[str] = set()
        self.stuck: set[str] = set()
        self.gateway = Gateway(
            peer_id=GATEWAY,
            control=self.control,
            send=self._sender(GATEWAY),
            choose=self.choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=max_tokens,
            timeouts=timeouts or GatewayTimeouts(),
        )
        self.refused: list[str] = []  # errors told to the intruder

    async def serve(self, nursery: trio.Nursery) -> None:
        for server in self.servers.values():
            await nursery.start(server.serve)

    def _sender(self, me: str):
        async def send(peer: str, frame: Frame) -> None:
            await self.deliver(me, peer, frame)

        return send

    async def deliver(self, sender: str, peer: str, frame: Frame) -> None:
        if peer in self.stuck:
            await trio.sleep_forever()
        if peer in self.frozen:
            return  # swallowed: a frozen peer reads nothing
        if peer == INTRUDER:
            assert isinstance(frame, Error)
            self.refused.append(frame.message)
        elif peer == GATEWAY:
            assert isinstance(frame, Tokens | Error)
            self.gateway.on_frame(frame, sender)
        else:
            assert isinstance(frame, Activations)
            try:
                self.servers[peer].submit(frame, release=lambda: None, sender=sender)
            except InvalidRequest as exc:  # as the node's dispatcher answers the sender
                await self.deliver(peer, sender, Error(code=1, message=str(exc)))

    async def control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        if peer in self.frozen | self.stuck:
            await trio.sleep_forever()
        return self.servers[peer].handle(request, GATEWAY)

    async def choose(
        self, session_id: str, avoid: frozenset[str], hashes: Sequence[int] = ()
    ) -> tuple[Hop, ...]:
        for hops in self.pipelines:
            if not {h.peer_id for h in hops} & avoid:
                return hops
        return ()

    async def ping(self, peer: str) -> bool:
        if peer in self.frozen | self.stuck:
            await trio.sleep_forever()
        if peer not in self.servers:
            raise PeerUnreachable(peer)
        return True
