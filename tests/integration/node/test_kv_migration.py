"""KV migration on the in-process tiny mesh: real stage servers, hops as function calls.

A stream whose middle stage is moved mid-generation (``Gateway.move_off``, as
the plan loop does for a stage leaving alive) carries on from the moved KV:
its output equals the single-process reference and the new stage computes
only the steps after the move (no replay). A move whose target or source
dies falls back to replay, with the same output. The stage checks what it
receives. The same path over real libp2p and the data plane is in
``test_kv_migration_mesh.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import trio
import trio.testing

from hetmesh.error_codec import error_code
from hetmesh.errors import InvalidRequest, MeshError, PeerUnreachable, Rejected
from hetmesh.node.control import CloseSession, MoveSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, GatewayTimeouts, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.migration import kv_frame
from hetmesh.node.outcomes import MID_STEP
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Error, Frame, KVBlock
from tests.integration.node.test_serving_inprocess import (  # the tiny model and helpers
    PROMPTS,
    collect,
    reference,
    tiny_model,
)

__all__ = ["tiny_model"]  # a fixture, used by name

GATEWAY = "gw"
LAYOUT = {"a": (0, 2), "b1": (2, 4), "b2": (2, 4), "c": (4, 6)}
FIRST = (Hop("a", 0, 2), Hop("b1", 2, 4), Hop("c", 4, 6))
SECOND = (Hop("a", 0, 2), Hop("b2", 2, 4), Hop("c", 4, 6))


class MovingMesh:
    """Stage servers keyed by peer id; every frame and request carries its sender."""

    def __init__(self, model_dir, pool_tokens: int = 8 * 200) -> None:
        self.servers: dict[str, StageServer] = {}
        for peer, (a, b) in LAYOUT.items():
            stage = load_stage(model_dir, a, b)
            budget = pool_tokens * stage.kv_bytes_per_token()
            self.servers[peer] = StageServer(
                stage,
                limits=KVLimits(max_sessions=8, max_tokens_per_session=200, budget_bytes=budget),
                send=functools.partial(self.send, peer),
            )
        self.dead: set[str] = set()
        self.gateway: Gateway | None = None
        self.kill_on_kv = ""  # a peer that dies as the KV is sent to it
        self.kill_on_move = ""  # a peer that dies as it is asked to send its KV
        self.exit_after_kv = ""  # a peer that exits once its KV is on the wire (a drain)
        self.kv_delay_s = 0.0  # how long a KV frame takes to arrive
        self.lose_kv = 0  # KV frames lost on the way (a link closed under them)
        self.slow_opens = ("", 0)  # a peer whose opens miss the deadline, how many
        self.mid_step_moves = ("", 0)  # a peer still finishing the step as a move comes

    async def send(self, sender: str, peer: str, frame: Frame) -> None:
        if peer in self.dead or sender in self.dead:
            raise PeerUnreachable(peer)
        if isinstance(frame, KVBlock):
            if sender == self.exit_after_kv:
                self.dead.add(sender)  # gone, while its KV still travels
            await trio.sleep(self.kv_delay_s)
            if self.lose_kv:
                self.lose_kv -= 1
                return
        assert self.gateway is not None
        if peer == GATEWAY:
            self.gateway.on_frame(frame, sender)  # type: ignore[arg-type]
            return
        if isinstance(frame, KVBlock) and peer == self.kill_on_kv:
            self.dead.add(peer)
            raise PeerUnreachable(peer)
        server = self.servers[peer]
        try:
            if isinstance(frame, KVBlock):
                server.receive_kv(frame, lambda: None, sender)
            elif server.handed_to(frame.session_id) is not None:  # as StageHost.deliver
                server.tell_moved(frame.session_id)
            else:
                server.submit(frame, lambda: None, sender)  # type: ignore[arg-type]
        except MeshError as exc:  # the daemon tells the sender; here the gateway hears it
            if isinstance(frame, KVBlock):
                return  # a stage sent it: its own node's gateway runs no such session
            error = Error(code=error_code(exc), message=str(exc), session_id=frame.session_id)
            self.gateway.on_frame(error, peer)

    async def control(self, peer: str, request: OpenSession | CloseSession | MoveSession) -> Reply:
        if peer in self.dead:
            raise PeerUnreachable(peer)
        slow, count = self.slow_opens
        if isinstance(request, OpenSession) and peer == slow and count:
            self.slow_opens = (slow, count - 1)
            await trio.sleep(math.inf)  # past the gateway's deadline (it answers pings)
        if isinstance(request, MoveSession) and request.kv_to and peer == self.kill_on_move:
            self.dead.add(peer)
            raise PeerUnreachable(peer)
        busy, count = self.mid_step_moves
        if isinstance(request, MoveSession) and request.kv_to and peer == busy and count:
            # as a stage answers while its device thread finishes the step whose token
            # is back at the gateway already (the thread sends the token first)
            self.mid_step_moves = (busy, count - 1)
            return Reply.failed(Rejected(f"{MID_STEP}session {request.session_id}"))
        return self.servers[peer].handle(request, GATEWAY)

    async def ping(self, peer: str) -> bool:
        if peer in self.dead:
            raise PeerUnreachable(peer)
        return True

    def make_gateway(self, *, migrate: bool = True, **timeouts) -> Gateway:
        async def choose(session_id, avoid, hashes=()):
            return next((h for h in (FIRST, SECOND) if not {x.peer_id for x in h} & avoid), ())

        self.gateway = Gateway(
            peer_id=GATEWAY,
            control=self.control,
            send=functools.partial(self.send, GATEWAY),
            choose=choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=256,
            timeouts=GatewayTimeouts(**timeouts),
            migrate=migrate,
        )
        return self.gateway


async def run_moved(mesh: MovingMesh, gateway: Gateway, move_at: int, tokens: int) -> list[int]:
    """One stream of ``tokens`` greedy tokens, asked to move off b1 after ``move_at``."""

    def move(n: int) -> None:
        if n == move_at:
            assert gateway.move_off("b1") == 1

    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        out = await collect(
            gateway, PROMPTS[0], SamplingParams(max_new_tokens=tokens), on_token=move
        )
        nursery.cancel_scope.cancel()
    return out


async def test_a_moved_stage_continues_from_its_kv_without_replay(tiny_model):
    mesh = MovingMesh(tiny_model)
    gateway = mesh.make_gateway()
    initial = {peer: s.pool.free_blocks for peer, s in mesh.servers.items()}
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.migration_fallbacks, g.recoveries, g.preemptions) == (1, 0, 0, 0)
    stats = {peer: s.statistics() for peer, s in mesh.servers.items()}
    # the sixth token's consumer asked for the move while the seventh step was already
    # on its way (a step leaves before its token is handed on): the move comes after it,
    # with the prompt and six fed tokens held; the seventh token is not fed yet
    held = len(PROMPTS[0]) + 6
    per_token = mesh.servers["b2"].stage.kv_bytes_per_token()
    assert stats["b2"].kv.migrations == 1
    assert stats["b2"].kv.migrated_bytes == held * per_token
    assert stats["b1"].kv.migrations_out == 1
    # no replay: b2 computed the nine steps after the move only, the first stage every
    # token once (the prompt, then one per step)
    assert stats["b2"].tokens == 9
    assert stats["b1"].tokens == held
    assert stats["a"].tokens == len(PROMPTS[0]) + 15
    for peer, s in stats.items():
        assert s.kv.sessions == 0, peer
        assert s.kv.blocks_free == initial[peer], peer


async def test_without_migration_a_move_replays_the_history(tiny_model):
    mesh = MovingMesh(tiny_model)
    gateway = mesh.make_gateway(migrate=False)  # what --no-migrate does (for comparisons)
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.move_replays, g.recoveries) == (0, 1, 0)
    b2 = mesh.servers["b2"].statistics()
    assert b2.kv.migrations == 0
    assert b2.tokens == len(PROMPTS[0]) + 5 + 10  # the history replayed, then ten steps


async def test_a_source_still_finishing_its_step_is_asked_again_not_replayed(tiny_model):
    """Seen in CI (a SIGTERM drain): the source refused the move as mid-step because its
    device thread had sent the token but not yet parked. Asked again, it moves."""
    mesh = MovingMesh(tiny_model)
    mesh.mid_step_moves = ("b1", 3)
    gateway = mesh.make_gateway()
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.migration_fallbacks, g.recoveries, g.move_replays) == (1, 0, 0, 0)
    assert mesh.mid_step_moves == ("b1", 0)  # every refusal was asked past
    assert mesh.servers["b2"].statistics().tokens == 9  # no replay through it


async def test_a_move_whose_target_dies_falls_back_to_replay(tiny_model):
    mesh = MovingMesh(tiny_model)
    mesh.kill_on_kv = "b2"
    gateway = mesh.make_gateway(step_floor_s=0.5, ping_s=0.3)
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert g.migration_fallbacks == 1
    assert g.recoveries >= 1
    assert mesh.servers["b2"].statistics().kv.migrations == 0  # its KV never arrived


async def test_a_move_whose_source_dies_falls_back_to_replay(tiny_model):
    mesh = MovingMesh(tiny_model)
    mesh.kill_on_move = "b1"
    gateway = mesh.make_gateway(step_floor_s=0.5, ping_s=0.3)
    initial = mesh.servers["b2"].pool.free_blocks
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.migration_fallbacks) == (0, 1)
    b2 = mesh.servers["b2"].statistics()
    assert b2.kv.migrations == 0
    assert b2.tokens > 10  # the history was replayed through it
    assert (b2.kv.sessions, b2.kv.blocks_free) == (0, initial)  # its half-open move was closed


async def test_a_source_that_exits_with_its_kv_on_the_way_is_no_reason_to_replay(tiny_model):
    """A drained source exits once its KV is sent; the KV arrives after the step's
    timeout. The source no longer answering pings must not fail the step (it did,
    and the session replayed, in a loaded CI run): the stream finishes on the moved KV."""
    mesh = MovingMesh(tiny_model)
    mesh.exit_after_kv = "b1"
    mesh.kv_delay_s = 0.8  # past the first timeout (0.5 s), within the extensions
    gateway = mesh.make_gateway(step_floor_s=0.5, ping_s=0.3)
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.migration_fallbacks, g.recoveries) == (1, 0, 0)
    assert g.slow_steps >= 1  # the step did wait past its timeout
    assert mesh.servers["b2"].statistics().kv.migrations == 1
    assert mesh.servers["b2"].statistics().tokens == 9  # no replay through it


async def test_a_moved_kv_lost_on_the_way_costs_a_timeout_not_a_replay(tiny_model):
    """A suspect for the CI flake (a 'stalled although every stage answers pings'
    recovery after a drained replica's move), in a fixed order: the KV frame is lost on
    its way (a drained node's link closing under it) while the step waits for it at the
    new stage. The source kept the KV until the gateway confirms the move; the gateway,
    its first step timing out with every stage answering, asks for it once more, and
    the stream finishes on the moved KV, with no replay and no recovery."""
    mesh = MovingMesh(tiny_model)
    mesh.lose_kv = 1
    gateway = mesh.make_gateway(step_floor_s=0.5, ping_s=0.3)
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.migration_fallbacks, g.recoveries, g.move_replays) == (1, 0, 0, 0)
    assert g.slow_steps == 1  # one timeout, then the KV once more
    b1, b2 = mesh.servers["b1"], mesh.servers["b2"]
    assert b2.statistics().kv.migrations == 1
    assert b2.statistics().tokens == 9  # the nine steps after the move: no replay
    assert b1.statistics().kv.migrations_out == 1
    assert not b1.handing()  # the move was confirmed: b1 let its copy of the KV go


async def test_a_stage_slow_to_open_but_answering_pings_is_asked_again_not_avoided(tiny_model):
    """Seen in a loaded run of the mesh test: an open's control call missed its deadline
    on a node that was merely loaded, and the gateway recovered avoiding it. A stage
    that answers a ping is opened again (a new try, nobody avoided), not recovered from."""
    mesh = MovingMesh(tiny_model)
    mesh.slow_opens = ("b1", 1)
    gateway = mesh.make_gateway(step_floor_s=0.5, ping_s=0.3)
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        out = await collect(gateway, PROMPTS[0], SamplingParams(max_new_tokens=8))
        nursery.cancel_scope.cancel()
    assert out == reference(tiny_model, PROMPTS[0], 8)
    g = gateway.statistics()
    assert (g.recoveries, g.sessions_failed, g.slow_steps) == (0, 0, 1)
    assert mesh.servers["b1"].statistics().tokens > 0  # b1 served it: not avoided
    for peer, server in mesh.servers.items():
        assert server.statistics().kv.sessions == 0, peer


async def test_a_drained_source_keeps_its_kv_until_the_move_is_confirmed(tiny_model):
    """The source of a move keeps the KV frame it sent (a draining node stays while it
    does) until the gateway confirms; then, or after HANDED_S, it lets it go; only the
    session's gateway may ask for it again, and only to the same peer."""
    mesh = MovingMesh(tiny_model)
    mesh.make_gateway()
    b1 = mesh.servers["b1"]
    async with trio.open_nursery() as nursery:
        await nursery.start(b1.serve)
        opening = dataclasses.replace(migrating_open("s", 0), migrate_from="", prompt_tokens=1)
        assert b1.handle(opening, GATEWAY).ok
        move = MoveSession(session_id="s", kv_to="b2", next_peer="c", previous_peer="a")
        assert b1.handle(move, GATEWAY).ok
        assert b1.handing()
        assert b1.handed_to("s") == (GATEWAY, "b2")
        assert not b1.handle(move, "c").ok  # not its gateway
        assert not b1.handle(dataclasses.replace(move, kv_to="x"), GATEWAY).ok  # elsewhere
        assert b1.handle(move, GATEWAY).ok  # again: the same frame once more
        assert b1.handle(CloseSession(session_id="s"), "c").ok  # anyone's close is moot
        assert b1.handing()
        b1.tell_moved("s")  # a step that still reached b1: its gateway hears "moved"
        await trio.testing.wait_all_tasks_blocked()
        assert mesh.gateway is not None
        assert mesh.gateway.statistics().stale_frames == 1  # (it runs no such session)
        assert b1.handle(CloseSession(session_id="s"), GATEWAY).ok  # its gateway confirms
        assert not b1.handing()
        assert b1.handed_to("s") is None
        assert not b1.handle(move, GATEWAY).ok  # confirmed: nothing to send again
        nursery.cancel_scope.cancel()


async def test_a_move_that_does_not_fit_the_target_is_refused_and_replayed(tiny_model):
    mesh = MovingMesh(tiny_model, pool_tokens=400)  # 25 blocks, one kept in reserve
    gateway = mesh.make_gateway(step_floor_s=0.5, ping_s=0.3)
    b2 = mesh.servers["b2"]
    for i, tokens in enumerate((200, 160, 16)):  # 24 of b2's blocks held by others
        assert b2.handle(migrating_open(f"filler{i}", tokens, source="x"), GATEWAY).ok
    assert b2.pool.free_blocks == 1  # the move's block and the reserve do not fit
    out = await run_moved(mesh, gateway, move_at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert (g.migrations, g.migration_fallbacks) == (0, 1)


def migrating_open(session_id: str, tokens: int, source: str = "b1") -> OpenSession:
    return OpenSession(
        session_id=session_id,
        start=2,
        end=4,
        next_peer="c",
        gateway=GATEWAY,
        previous_peer="a",
        max_tokens=max(64, tokens),
        prompt_tokens=tokens,
        sampling=SamplingParams(),
        migrate_from=source,
    )


async def test_the_new_stage_takes_the_kv_from_the_previous_owner_only(tiny_model):
    mesh = MovingMesh(tiny_model)
    mesh.make_gateway()
    b2 = mesh.servers["b2"]
    pool = b2.pool
    initial = pool.free_blocks
    assert b2.handle(migrating_open("s", 20), GATEWAY).ok
    assert pool.free_blocks == initial - 2  # admitted through the pool like any session
    shape = (pool.num_layers, pool.kv_heads, 20, pool.head_dim)
    good = kv_frame("s", torch.ones(shape), torch.ones(shape))
    with pytest.raises(InvalidRequest, match="from b1 only"):
        b2.receive_kv(good, lambda: None, "c")  # a member that does not own the session
    with pytest.raises(InvalidRequest, match="expected here"):
        b2.receive_kv(kv_frame("other", *good.tensors), lambda: None, "b1")
    assert b2.statistics().kv.sessions == 1  # untouched by either
    released: list[int] = []
    b2.receive_kv(good, lambda: released.append(1), "b1")
    assert released == [1]
    kv = b2.statistics().kv
    assert (kv.migrations, kv.migrated_bytes) == (1, 2 * torch.ones(shape).nbytes)
    with pytest.raises(InvalidRequest, match="expected here"):  # once only
        b2.receive_kv(good, lambda: None, "b1")
    # only the gateway may move a session
    assert not b2.handle(MoveSession(session_id="s", kv_to="b1"), "c").ok


async def test_a_bad_kv_from_the_owner_fails_the_session_and_frees_its_blocks(tiny_model):
    mesh = MovingMesh(tiny_model)
    gateway = mesh.make_gateway()
    b2 = mesh.servers["b2"]
    initial = b2.pool.free_blocks
    pool = b2.pool
    async with trio.open_nursery() as nursery:
        await nursery.start(b2.serve)
        assert b2.handle(migrating_open("s", 20), GATEWAY).ok
        wrong = (pool.num_layers, pool.kv_heads, 19, pool.head_dim)
        with pytest.raises(InvalidRequest, match="shape"):
            b2.receive_kv(kv_frame("s", torch.ones(wrong), torch.ones(wrong)), lambda: None, "b1")
        half = torch.ones((pool.num_layers, pool.kv_heads, 20, pool.head_dim), dtype=torch.half)
        assert b2.handle(migrating_open("t", 20), GATEWAY).ok
        with pytest.raises(InvalidRequest, match="float16"):
            b2.receive_kv(kv_frame("t", half, half), lambda: None, "b1")
        # each failure is reported to the session's gateway (which runs no such session)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    kv = b2.statistics().kv
    assert (kv.sessions, kv.blocks_free, kv.migrations) == (0, initial, 0)
    assert gateway.statistics().stale_frames == 2


async def test_no_block_leaks_after_mixed_sessions_with_migrations(tiny_model):
    """Finished, cancelled, preempted and migrated sessions (both ways between b1 and b2)
    on small pools: every stream equals the reference and every pool ends where it began."""
    from contextlib import aclosing
    from random import Random

    mesh = MovingMesh(tiny_model, pool_tokens=160)  # 10 blocks a stage: they preempt
    gateway = mesh.make_gateway(admission_s=120.0)
    initial = {peer: s.pool.free_blocks for peer, s in mesh.servers.items()}
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:3] + [60] * 20]
    expected = [reference(tiny_model, p, 24) for p in prompts]
    rng = Random(7)
    # (prompt, tokens, cancel after the first token, move after this many tokens or 0)
    jobs = [
        (rng.randrange(len(prompts)), rng.randint(2, 24), rng.random() < 0.15, rng.randint(0, 12))
        for _ in range(64)
    ]
    wrong: list[int] = []
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)

        async def run(job: int) -> None:
            which, tokens, cancel, move_at = jobs[job]
            params = SamplingParams(max_new_tokens=tokens)
            out: list[int] = []
            async with aclosing(gateway.generate(prompts[which], params)) as stream:
                async for token in stream:
                    out.append(token)
                    if cancel:
                        return
                    if len(out) == move_at:  # off whichever replica it runs on now
                        gateway.move_off("b1" if job % 2 else "b2")
            if out != expected[which][:tokens]:
                wrong.append(job)

        for wave in range(0, len(jobs), 8):
            async with trio.open_nursery() as clients:
                for job in range(wave, wave + 8):
                    clients.start_soon(run, job)
        # the waves above preempt now and then (how often depends on timing: never, in
        # one run on a loaded machine); this wave must. Five prompts of 17 tokens that
        # share no block: four are admitted at once (2 blocks each, and the reserve's one
        # of the 10), and growing to 76 tokens (5 blocks each) any three of them at once
        # need more than the first stage's 10 (sessions are seen to drift up to ~8 steps
        # apart, so 24 tokens were not enough: 3 blocks each)
        forced = [[70 + i] * 17 for i in range(5)]
        forced_expected = [reference(tiny_model, p, 60) for p in forced]

        async def run_forced(index: int) -> None:
            params = SamplingParams(max_new_tokens=60)
            if await collect(gateway, forced[index], params) != forced_expected[index]:
                wrong.append(len(jobs) + index)

        before = mesh.servers["a"].statistics().kv.preempted
        async with trio.open_nursery() as clients:
            for index in range(len(forced)):
                clients.start_soon(run_forced, index)
        forced_preemptions = mesh.servers["a"].statistics().kv.preempted - before
        nursery.cancel_scope.cancel()
    assert wrong == []
    assert forced_preemptions >= 1
    stats = {peer: s.statistics().kv for peer, s in mesh.servers.items()}
    assert stats["b1"].migrations + stats["b2"].migrations >= 1
    assert gateway.statistics().migrations >= 1
    for peer, kv in stats.items():
        assert kv.sessions == 0, peer
        assert kv.blocks_free == initial[peer] == kv.blocks_total, peer
