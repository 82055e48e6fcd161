"""Stage servers and a gateway wired together in one process, over in-memory hops.

Real stages of a seeded tiny Llama; the network is replaced by direct calls so
that batching, session control and recovery logic are exercised on their own.
The multi-process tests cover the real data plane.
"""

from __future__ import annotations

from contextlib import aclosing

import pytest
import torch
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from hetmesh.errors import InvalidRequest, MeshError, PeerUnreachable
from hetmesh.node.control import CloseSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, GatewayTimeouts, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Activations, Error, Frame, Tokens

GATEWAY = "gw"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    return folder


class Mesh:
    """Stage servers keyed by peer id, reached through plain function calls."""

    def __init__(
        self, model_dir, layout: dict[str, tuple[int, int]], *, pool_tokens: int | None = None
    ) -> None:
        self.servers = {}
        for peer, (a, b) in layout.items():
            stage = load_stage(model_dir, a, b)
            budget = (pool_tokens or 8 * 200) * stage.kv_bytes_per_token()  # 8 full sessions
            self.servers[peer] = StageServer(
                stage,
                limits=KVLimits(max_sessions=8, max_tokens_per_session=200, budget_bytes=budget),
                send=self.send,
            )
        self.dead: set[str] = set()
        self.frozen: set[str] = set()
        self.gateway: Gateway | None = None

    async def send(self, peer: str, frame: Frame) -> None:
        if peer in self.dead:
            raise PeerUnreachable(peer)
        if peer == GATEWAY:
            assert isinstance(frame, Tokens | Error)
            assert self.gateway is not None
            self.gateway.on_frame(frame)
            return
        if peer in self.frozen:
            return  # swallowed: a stalled peer
        assert isinstance(frame, Activations)
        try:
            self.servers[peer].submit(frame, release=lambda: None)
        except MeshError as exc:
            assert self.gateway is not None
            self.gateway.on_frame(Error(code=1, message=str(exc), session_id=frame.session_id))

    async def control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        if peer in self.dead:
            raise PeerUnreachable(peer)
        if peer in self.frozen:
            await trio.sleep_forever()
        return self.servers[peer].handle(request)

    async def ping(self, peer: str) -> bool:
        if peer in self.dead:
            raise PeerUnreachable(peer)
        if peer in self.frozen:
            await trio.sleep_forever()
        return True


def chooser(pipelines):
    async def choose(session_id, avoid, hashes=()):
        for hops in pipelines:
            if not {h.peer_id for h in hops} & avoid:
                return hops
        return ()

    return choose


def make_gateway(mesh: Mesh, pipelines, **timeouts) -> Gateway:
    gateway = Gateway(
        peer_id=GATEWAY,
        control=mesh.control,
        send=mesh.send,
        choose=chooser(pipelines),
        ping=mesh.ping,
        eos_token_ids=frozenset(),
        max_context=256,
        timeouts=GatewayTimeouts(**timeouts),
    )
    mesh.gateway = gateway
    return gateway


async def collect(gateway, prompt, params, *, on_token=None):
    out = []
    async with aclosing(gateway.generate(prompt, params)) as tokens:
        async for token in tokens:
            out.append(token)
            if on_token is not None:
                on_token(len(out))
    return out


def reference(model_dir, prompt, n):
    pipeline = LocalPipeline.load(model_dir, 1)
    return list(pipeline.generate_ids(prompt, SamplingParams(max_new_tokens=n), eos_ids=set()))


PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [1, 2, 3], list(range(10, 50))]


async def test_gateway_streams_reference_tokens_through_three_stages(tiny_model):
    mesh = Mesh(tiny_model, {"a": (0, 2), "b": (2, 4), "c": (4, 6)})
    hops = (Hop("a", 0, 2), Hop("b", 2, 4), Hop("c", 4, 6))
    gateway = make_gateway(mesh, [hops])
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        results: dict[int, list[int]] = {}

        async def run(i):
            results[i] = await collect(gateway, PROMPTS[i], SamplingParams(max_new_tokens=12))

        async with trio.open_nursery() as clients:  # concurrent sessions share batches
            for i in range(len(PROMPTS)):
                clients.start_soon(run, i)
        nursery.cancel_scope.cancel()
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == reference(tiny_model, prompt, 12)
    assert max(s.statistics().items / s.statistics().rounds for s in mesh.servers.values()) > 1
    for server in mesh.servers.values():  # closing frees every cache at once
        assert server.statistics().kv.sessions == 0


@pytest.mark.parametrize("fault", ["dead", "frozen"], ids=["killed", "stalled"])
async def test_gateway_recovers_from_a_failed_replica(tiny_model, fault):
    mesh = Mesh(tiny_model, {"a": (0, 2), "b1": (2, 4), "b2": (2, 4), "c": (4, 6)})
    first = (Hop("a", 0, 2), Hop("b1", 2, 4), Hop("c", 4, 6))
    second = (Hop("a", 0, 2), Hop("b2", 2, 4), Hop("c", 4, 6))
    gateway = make_gateway(mesh, [first, second], step_floor_s=0.5, ping_s=0.3)

    def fail_halfway(n):
        if n == 8:
            getattr(mesh, fault).add("b1")  # a dead peer refuses; a frozen one is silent

    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        out = await collect(
            gateway, PROMPTS[0], SamplingParams(max_new_tokens=16), on_token=fail_halfway
        )
        nursery.cancel_scope.cancel()
    assert out == reference(tiny_model, PROMPTS[0], 16)
    # one fault, but a CPU stall on a loaded machine can time a healthy step out too
    assert gateway.statistics().recoveries >= 1


async def test_gateway_seeded_sampling_survives_recovery(tiny_model):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=20, seed=1234)
    pipelines = [
        (Hop("a", 0, 2), Hop("b1", 2, 4), Hop("c", 4, 6)),
        (Hop("a", 0, 2), Hop("b2", 2, 4), Hop("c", 4, 6)),
    ]
    layout = {"a": (0, 2), "b1": (2, 4), "b2": (2, 4), "c": (4, 6)}
    runs = []
    for kill in (False, True):
        mesh = Mesh(tiny_model, layout)
        gateway = make_gateway(mesh, pipelines, step_floor_s=0.5, ping_s=0.3)

        def maybe_kill(n, mesh=mesh, kill=kill):
            if kill and n == 5:
                mesh.dead.add("b1")

        async with trio.open_nursery() as nursery:
            for server in mesh.servers.values():
                await nursery.start(server.serve)
            runs.append(await collect(gateway, PROMPTS[1], params, on_token=maybe_kill))
            nursery.cancel_scope.cancel()
    assert runs[0] == runs[1]
    assert len(runs[0]) == 16


async def test_bad_input_fails_alone(tiny_model):
    mesh = Mesh(tiny_model, {"a": (0, 3), "c": (3, 6)})
    hops = (Hop("a", 0, 3), Hop("c", 3, 6))
    gateway = make_gateway(mesh, [hops])
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        good: list[int] = []
        good_done = trio.Event()

        async def run_good():
            good.extend(await collect(gateway, PROMPTS[0], SamplingParams(max_new_tokens=10)))
            good_done.set()

        nursery.start_soon(run_good)
        with pytest.raises(InvalidRequest, match="empty"):
            await collect(gateway, [], SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidRequest, match="context"):
            await collect(gateway, list(range(90)) * 3, SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await collect(gateway, [5, 500], SamplingParams(max_new_tokens=4))
        # hidden states of the wrong width straight into the second stage
        server_c = mesh.servers["c"]
        reply = server_c.handle(
            OpenSession(
                session_id="rogue",
                start=3,
                end=6,
                next_peer=GATEWAY,
                gateway=GATEWAY,
                max_tokens=10,
                sampling=gateway_sampling(),
            )
        )
        assert reply.ok
        server_c.submit(
            Activations(session_id="rogue", step=0, positions=(0,), tensors=(torch.zeros(1, 7),)),
            release=lambda: None,
        )
        with pytest.raises(InvalidRequest, match="unknown session"):
            server_c.submit(
                Activations(
                    session_id="nope", step=0, positions=(0,), tensors=(torch.zeros(1, 64),)
                ),
                release=lambda: None,
            )
        await good_done.wait()
        nursery.cancel_scope.cancel()
    assert good == reference(tiny_model, PROMPTS[0], 10)
    assert server_c.statistics().errors >= 1


def gateway_sampling():
    return SamplingParams()


async def test_a_failed_draw_fails_its_session_alone(tiny_model):
    """A session whose sampling overflows (values a peer skipping the checks could send)
    fails with InvalidRequest; sessions batched with it on the last stage go on."""
    mesh = Mesh(tiny_model, {"a": (0, 3), "c": (3, 6)})
    hops = (Hop("a", 0, 3), Hop("c", 3, 6))
    bad = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    control = mesh.control

    async def unchecked_control(peer, request):
        # the last stage gets the bad sessions' temperature past the record's own check
        if isinstance(request, OpenSession) and request.sampling.max_new_tokens == 8:
            object.__setattr__(request.sampling, "temperature", 1e-45)
        return await control(peer, request)

    mesh.control = unchecked_control  # type: ignore[method-assign]
    gateway = make_gateway(mesh, [hops])
    results: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)

        async def run(name, prompt, params):
            try:
                results[name] = await collect(gateway, prompt, params)
            except MeshError as exc:
                results[name] = exc

        async with trio.open_nursery() as requests:
            requests.start_soon(run, "good", PROMPTS[0], SamplingParams(max_new_tokens=10))
            for i in range(3):
                requests.start_soon(run, f"bad{i}", PROMPTS[i], bad)
            requests.start_soon(run, "good2", PROMPTS[1], SamplingParams(max_new_tokens=10))
        nursery.cancel_scope.cancel()
    assert results["good"] == reference(tiny_model, PROMPTS[0], 10)
    assert results["good2"] == reference(tiny_model, PROMPTS[1], 10)
    for i in range(3):
        assert isinstance(results[f"bad{i}"], InvalidRequest), results[f"bad{i}"]
    assert mesh.servers["c"].statistics().errors >= 3, results


async def test_a_full_kv_pool_preempts_and_resumes_sessions_without_leaking(tiny_model):
    """Stages with 96 tokens of KV (6 blocks) admit five sessions of one-block prompts
    at once (plus a one-block reserve); each grows to 4-5 blocks over 60 tokens, so
    together they must outgrow the pool: the newest are preempted and resumed by
    replay. Every stream equals the reference; a cancelled one and the rest leave
    every pool whole."""
    mesh = Mesh(tiny_model, {"a": (0, 2), "b": (2, 4), "c": (4, 6)}, pool_tokens=96)
    hops = (Hop("a", 0, 2), Hop("b", 2, 4), Hop("c", 4, 6))
    gateway = make_gateway(mesh, [hops], admission_s=120.0)
    prompts = [PROMPTS[0], PROMPTS[1], [8, 6, 4, 2] * 3, list(range(60, 70)), [9] * 16]
    initial = {peer: s.pool.free_blocks for peer, s in mesh.servers.items()}
    results: dict[int, list[int]] = {}
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)

        async def run(i):
            results[i] = await collect(gateway, prompts[i], SamplingParams(max_new_tokens=60))

        async def cancelled():
            async with aclosing(
                gateway.generate(PROMPTS[2], SamplingParams(max_new_tokens=30))
            ) as it:
                async for n, _ in aioenumerate(it):
                    if n == 4:
                        break  # the client goes away mid-stream

        async with trio.open_nursery() as clients:
            for i in range(len(prompts)):
                clients.start_soon(run, i)
            clients.start_soon(cancelled)

        # one request larger than the whole pool: refused at once, naming the KV limit
        with pytest.raises(InvalidRequest, match="whole KV pool"):
            await collect(gateway, list(range(1, 91)), SamplingParams(max_new_tokens=10))
        nursery.cancel_scope.cancel()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(tiny_model, prompt, 60), i
    assert gateway.statistics().preemptions >= 1
    assert sum(s.statistics().kv.preempted for s in mesh.servers.values()) >= 1
    for peer, server in mesh.servers.items():
        stats = server.statistics().kv
        assert (stats.sessions, stats.blocks_free) == (0, initial[peer]), peer
        assert stats.blocks_free == stats.blocks_total


async def aioenumerate(iterator):
    n = 0
    async for item in iterator:
        yield n, item
        n += 1
