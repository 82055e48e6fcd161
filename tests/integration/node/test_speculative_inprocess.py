"""Speculative decoding through a real three-stage cut of the tiny model, in process
(issue 48): prompt-lookup drafts verified by the last stage, with the gateway and
stage servers of a node and hops as function calls (``test_kv_migration``'s mesh).

Greedy output with drafts, some kept and some rejected, equals the single-process
reference; every stage drops a rejected step's tail and the next step starts right
after the kept tokens; a stage killed mid-stream is replayed on another route and
the drafts go on; a move carries the KV and the drafts go on; seeded sampling
draws the same tokens with and without drafts.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch
import trio
import trio.testing
from rich.console import Console

from hetmesh.cli.status_view import load_table, summarize
from hetmesh.errors import InvalidRequest
from hetmesh.node.api_metrics import ApiMetrics, MeshGauges
from hetmesh.node.control import OpenSession
from hetmesh.node.gateway import Gateway, GatewayTimeouts, Speculation
from hetmesh.node.stage_host import as_dict
from hetmesh.partition.sampling import SamplingParams
from hetmesh.speculative.lookup import PromptLookup, speculation
from hetmesh.transport.frames import Activations, Frame, Tokens
from tests.integration.node.test_kv_migration import FIRST, GATEWAY, SECOND, MovingMesh
from tests.integration.node.test_serving_inprocess import collect, reference, tiny_model

__all__ = ["tiny_model"]  # a fixture, used by name

# copy-heavy: "41 7 7" recurs, and what followed it ("7 50 …") is right once, then wrong
PROMPT = [5, 17, 33, 2, 9, 41, 7, 7, 7, 50, 51, 52, 5, 17, 33, 2, 9, 41, 7]
TOKENS = 40


class WatchedMesh(MovingMesh):
    """The mesh, recording each stage's forwards ``(KV length before, rows)`` and the
    token frames the gateway receives."""

    def __init__(self, model_dir) -> None:
        super().__init__(model_dir)
        self.forwards: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.tokens: list[Tokens] = []
        for peer, server in self.servers.items():
            stage = server.stage
            plain = stage.forward_batch

            def watched(items, *, _peer=peer, _plain=plain, **kwargs):
                for inputs, kv in items:
                    self.forwards[_peer].append((kv.length, int(inputs.shape[0])))
                return _plain(items, **kwargs)

            stage.forward_batch = watched  # type: ignore[method-assign]

    async def send(self, sender: str, peer: str, frame: Frame) -> None:
        if peer == GATEWAY and isinstance(frame, Tokens):
            self.tokens.append(frame)
            if self.gateway is not None and sender not in self.dead:
                self.gateway.lane.offer(sender, frame)  # as a link's reader thread does
        await super().send(sender, peer, frame)

    def _send_now(self, peer: str, frame: Frame) -> bool:
        """The lane's write to the first stage: taken at once."""
        assert isinstance(frame, Activations)
        self.servers[peer].submit(frame, lambda: None, GATEWAY)
        return True

    def gateway_with(
        self, k: int, make: Speculation | None = None, *, lane: bool = False, **timeouts
    ) -> Gateway:
        """A gateway drafting ``k`` tokens a step by prompt lookup (or as ``make`` says)."""

        async def choose(session_id, avoid, hashes=()):
            return next((h for h in (FIRST, SECOND) if not {x.peer_id for x in h} & avoid), ())

        async def send(peer: str, frame: Frame) -> None:
            await self.send(GATEWAY, peer, frame)

        self.gateway = Gateway(
            peer_id=GATEWAY,
            control=self.control,
            send=send,
            choose=choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=256,
            timeouts=GatewayTimeouts(**timeouts),
            speculation=make or speculation(k),
            send_now=self._send_now if lane else None,
        )
        return self.gateway

    def verify_steps(self, peer: str) -> list[tuple[int, int, int]]:
        """``(start, rows, next start)`` of each verify step ``peer`` ran that another
        step followed (a verify step's tokens frame sits right after its first input)."""
        verified = {t.position for t in self.tokens}
        calls = self.forwards[peer]
        return [
            (start, rows, calls[i + 1][0])
            for i, (start, rows) in enumerate(calls[:-1])
            if rows > 1 and start + 1 in verified
        ]


async def _run(mesh: WatchedMesh, gateway: Gateway, params: SamplingParams, on_token=None):
    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        out = await collect(gateway, PROMPT, params, on_token=on_token)
        nursery.cancel_scope.cancel()
    return out


def _kept_after(tokens: Sequence[Tokens], position: int) -> int:
    """Tokens the frame at ``position`` brought (the kept drafts and the target's own)."""
    return next(len(t.token_ids) for t in tokens if t.position == position)


async def test_greedy_with_drafts_equals_the_reference_and_every_stage_rolls_back(tiny_model):
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4)
    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS))
    assert out == reference(tiny_model, PROMPT, TOKENS)
    g = gateway.statistics()
    assert g.verify_steps > 0
    assert 0 < g.accepted < g.drafted  # drafts kept and drafts rejected
    assert g.verified_tokens == g.verify_steps + g.accepted
    assert g.tokens_out == TOKENS
    c = mesh.servers["c"].statistics()
    assert (c.verify_steps, c.drafted, c.accepted) == (g.verify_steps, g.drafted, g.accepted)
    rejected = 0
    for peer in ("a", "b1", "c"):
        steps = mesh.verify_steps(peer)
        assert steps, peer
        for start, rows, next_start in steps:
            # the next step starts right after the kept tokens: the rest of the KV dropped
            assert next_start == start + _kept_after(mesh.tokens, start + 1), (peer, start)
            rejected += next_start < start + rows
    assert rejected >= 3  # at least one rejected step on each stage
    assert mesh.forwards["a"] == mesh.forwards["b1"] == mesh.forwards["c"]
    for server in mesh.servers.values():
        assert server.statistics().kv.sessions == 0  # closed: every block back


async def test_plain_decoding_sends_no_drafts(tiny_model):
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(0)
    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=12))
    assert out == reference(tiny_model, PROMPT, 12)
    assert gateway.statistics().verify_steps == 0
    assert [rows for _, rows in mesh.forwards["a"][1:]] == [1] * 11  # one token a step


async def test_a_stage_killed_mid_stream_is_replayed_and_drafts_go_on(tiny_model):
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4, step_floor_s=1.0, ping_s=0.5)

    def kill(n: int) -> None:
        if n == 12:
            mesh.dead.add("b1")

    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS), on_token=kill)
    assert out == reference(tiny_model, PROMPT, TOKENS)
    assert gateway.statistics().recoveries == 1
    replay, *after = mesh.forwards["b2"]
    assert replay[0] == 0  # the history replayed from the start
    assert any(rows > 1 for _, rows in after)  # then verify steps on the new route


async def test_a_moved_stage_keeps_its_kv_and_drafts_go_on(tiny_model):
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4)

    def move(n: int) -> None:
        if n == 12:
            assert gateway.move_off("b1") == 1

    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS), on_token=move)
    assert out == reference(tiny_model, PROMPT, TOKENS)
    g = gateway.statistics()
    assert (g.migrations, g.recoveries, g.migration_fallbacks) == (1, 0, 0)
    assert mesh.forwards["b2"][0][0] > len(PROMPT)  # no replay: it started from the KV
    assert any(rows > 1 for _, rows in mesh.forwards["b2"])


async def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(tiny_model):
    # peaked enough that the output repeats (drafts go), loose enough to leave greedy
    params = SamplingParams(max_new_tokens=TOKENS, temperature=0.1, seed=11)
    plain_mesh = WatchedMesh(tiny_model)
    plain = await _run(plain_mesh, plain_mesh.gateway_with(0), params)
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4)
    drafted = await _run(mesh, gateway, params)
    assert drafted == plain
    assert plain != reference(tiny_model, PROMPT, TOKENS)  # sampled, not greedy
    assert gateway.statistics().accepted > 0


class _Gauges:
    def __init__(self, gauges: MeshGauges) -> None:
        self._gauges = gauges

    def gauges(self) -> MeshGauges:
        return self._gauges


async def test_counters_reach_status_and_metrics(tiny_model):
    """The gateway's counters, as its node announces them (``extra["gateway"]``) and
    exports them, show drafts sent and kept and tokens per step."""
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4)
    await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS))
    g = gateway.statistics()
    view = {
        "peers": [
            {
                "peer_id": "12D3KooWgate",
                "health": "self",
                "record": {"extra": {"gateway": as_dict(g)}},
            }
        ]
    }
    (peer,) = summarize(view)["load"]["peers"]
    per_step = g.verified_tokens / g.verify_steps
    assert peer["speculation"] == {
        "drafted": g.drafted,
        "accepted": g.accepted,
        "tokens_per_step": per_step,
    }
    assert per_step > 1  # more than a token a trip
    console = Console(width=250, record=True)
    console.print(load_table(summarize(view)))
    assert f"{g.accepted}/{g.drafted}, {per_step:.2f} tok/step" in console.export_text()
    gauges = MeshGauges(
        verify_steps=g.verify_steps,
        drafted=g.drafted,
        accepted=g.accepted,
        verified_tokens=g.verified_tokens,
    )
    text = ApiMetrics(_Gauges(gauges)).render().decode()
    assert f"hetmesh_speculative_drafted_total {float(g.drafted)}" in text
    assert f"hetmesh_speculative_accepted_total {float(g.accepted)}" in text
    assert f"hetmesh_speculative_steps_total {float(g.verify_steps)}" in text


async def test_a_move_right_after_a_rejected_step_carries_the_kv(tiny_model):
    """The moved stage's KV still holds the rejected drafts' tail when it leaves: the
    new stage takes it and drops the tail, no replay."""
    probe = WatchedMesh(tiny_model)
    await _run(probe, probe.gateway_with(4), SamplingParams(max_new_tokens=TOKENS))
    start = next(s for s, rows, after in probe.verify_steps("b1") if after < s + rows)
    # the token fed at ``start`` is the one handed on right after its step left: asked
    # to move then, the session moves once that (rejecting) step is back
    move_at = start - len(PROMPT) + 1
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4)

    def move(n: int) -> None:
        if n == move_at:
            assert gateway.move_off("b1") == 1

    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS), on_token=move)
    assert out == reference(tiny_model, PROMPT, TOKENS)
    g = gateway.statistics()
    assert (g.migrations, g.recoveries, g.migration_fallbacks) == (1, 0, 0)
    b1_start, b1_rows = mesh.forwards["b1"][-1]  # its last step: the rejected one
    assert b1_start == start
    b2_first = mesh.forwards["b2"][0][0]
    assert b1_start < b2_first < b1_start + b1_rows  # b2 started inside b1's tail


async def test_a_request_for_logprobs_decodes_plainly(tiny_model):
    """A token frame carries one token's log-probabilities: no drafts for such a request."""
    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(4)
    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=12, logprobs=2))
    assert out == reference(tiny_model, PROMPT, 12)
    assert gateway.statistics().verify_steps == 0
    assert all(len(t.token_ids) == 1 and t.logprobs for t in mesh.tokens)


async def test_a_stage_refuses_drafts_that_do_not_fit_the_step(tiny_model):
    """Drafts must be the step's inputs after its first: anything else is the
    sender's ``InvalidRequest`` and the session is untouched."""
    mesh = WatchedMesh(tiny_model)
    server = mesh.servers["a"]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        opening = OpenSession(
            session_id="s",
            start=0,
            end=2,
            next_peer="b1",
            gateway=GATEWAY,
            max_tokens=64,
            prompt_tokens=2,
            sampling=SamplingParams(),
        )
        assert server.handle(opening, GATEWAY).ok
        bad = Activations(
            session_id="s",
            step=0,
            positions=(0, 1),
            tensors=(torch.tensor([5, 6]),),
            drafts=(6, 7),
        )
        with pytest.raises(InvalidRequest, match="2 drafts for a step of 2 positions"):
            server.submit(bad, lambda: None, GATEWAY)
        assert server.statistics().queue_depth == 0
        assert server.kv.get("s").length == 0  # untouched
        nursery.cancel_scope.cancel()


class _Recording:
    """A budget that asks for ``k`` drafts and records what it is asked and told."""

    def __init__(self, k: int = 2) -> None:
        self.records: list[tuple[int, int, float]] = []
        self._k = k
        self.asked = 0

    def k(self) -> int:
        self.asked += 1
        return self._k

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        self.records.append((drafted, accepted, seconds))


async def test_the_budget_hears_every_decode_step(tiny_model):
    """Verify steps with their drafts and kept drafts, plain decode steps (no draft to
    propose) as 0 drafts: what a measured budget compares."""
    mesh = WatchedMesh(tiny_model)
    budget = _Recording()
    gateway = mesh.gateway_with(0, make=lambda: (PromptLookup(), budget))
    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS))
    assert out == reference(tiny_model, PROMPT, TOKENS)
    g = gateway.statistics()
    verify = [r for r in budget.records if r[0]]
    plain = [r for r in budget.records if not r[0]]
    assert len(verify) == g.verify_steps > 0
    assert sum(r[1] for r in verify) == g.accepted
    assert plain  # the first decode step finds no repeated n-gram yet
    assert all(r[2] > 0 for r in budget.records)
    # every token after the prompt's came from one recorded step
    assert len(plain) + g.verified_tokens == TOKENS - 1


async def test_a_budget_at_zero_keeps_the_lane_and_is_asked_once_a_step(tiny_model):
    """A session whose budget says 0 sends plain steps through the gateway's lane as a
    session without speculation does; with k > 0 the lane is not armed; either way the
    budget is asked once for each decode step sent and told each one's outcome."""
    sent_by_lane = {}
    for name, make in (
        ("off", None),
        ("zero", _Recording(0)),
        ("four", _Recording(4)),
    ):
        mesh = WatchedMesh(tiny_model)
        factory = None if make is None else (lambda b=make: (PromptLookup(), b))
        gateway = mesh.gateway_with(0, factory, lane=True)
        out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS))
        assert out == reference(tiny_model, PROMPT, TOKENS), name
        sent_by_lane[name] = gateway.lane.sent
        steps = len(mesh.forwards["a"]) - 1  # after the prompt's one chunk
        if make is not None:
            assert make.asked == steps == len(make.records), name
    assert sent_by_lane["off"] == sent_by_lane["zero"] == TOKENS - 1  # every decode step
    assert sent_by_lane["four"] < sent_by_lane["zero"]


async def test_a_draft_model_with_the_measured_budget_gives_the_reference(tiny_model):
    """``--speculative --draft FORMAT``: a copy of the model at the gateway drafts (its
    own greedy text, so nearly all kept), the measured budget goes to many drafts a
    step, the output is the reference's, and each request's drafter lets its KV go."""
    from hetmesh.speculative.budget import SpeculationBudget
    from hetmesh.speculative.choose import gateway_speculation
    from hetmesh.speculative.draft_model import DraftModel

    model = DraftModel.load(tiny_model, weights="float32")
    make = gateway_speculation(8, measured=True, model=model)
    assert make is not None
    budgets: list[SpeculationBudget] = []

    def watched():
        drafter, budget = make()
        budgets.append(budget)
        return drafter, budget

    mesh = WatchedMesh(tiny_model)
    gateway = mesh.gateway_with(0, watched, lane=True)
    out = await _run(mesh, gateway, SamplingParams(max_new_tokens=TOKENS))
    assert out == reference(tiny_model, PROMPT, TOKENS)
    g = gateway.statistics()
    assert g.verify_steps > 0
    assert g.accepted >= 0.9 * g.drafted  # the same weights: its drafts hold
    assert g.verified_tokens / g.verify_steps > 2
    assert budgets
    assert budgets[0].acceptance > 0.8
    assert model.resident_bytes() == model.weight_bytes()  # the drafter was closed
    for server in mesh.servers.values():
        assert server.statistics().kv.sessions == 0


class _GatedDrafter:
    """A draft model's drafter whose first ``propose`` (where ``hold``) holds its
    worker thread until the test opens ``gate`` (a blocking drafter, called off the
    event loop)."""

    blocking = True

    def __init__(self, inner, *, hold: bool) -> None:
        self.inner = inner
        self.hold = hold
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.thread_ids: set[int] = set()

    @property
    def last_s(self) -> float:
        return self.inner.last_s

    def propose(self, history, k):
        self.thread_ids.add(threading.get_ident())
        if self.hold and not self.entered.is_set():
            self.entered.set()
            # the test opens the gate from the event loop: a propose on that loop's
            # thread would never see it (the bound only turns a hang into a failure)
            assert self.gate.wait(timeout=60), "the event loop never ran during a propose"
        return self.inner.propose(history, k)

    def close(self) -> None:
        self.thread_ids.add(threading.get_ident())
        self.inner.close()


async def test_a_draft_models_propose_runs_off_the_event_loop(tiny_model):
    """``--draft FORMAT``: a draft model's ``propose`` (``k`` forwards) runs on a worker
    thread, so while one session's propose is held the node goes on serving: another
    request's prompt goes through every stage and its token frame reaches the gateway.
    Two concurrent requests both equal the reference, and each closed session's KV
    leaves the draft model."""
    from hetmesh.speculative.budget import SpeculationBudget
    from hetmesh.speculative.draft_model import DraftModel

    model = DraftModel.load(tiny_model, weights="int4")
    drafters: list[_GatedDrafter] = []

    def make():
        drafter = _GatedDrafter(model.drafter(), hold=not drafters)  # a's
        drafters.append(drafter)
        return drafter, SpeculationBudget(max_k=8, overhead_s=lambda: drafter.last_s)

    other = [1, 2, 3, 4, 5, 6, 7, 8]
    frames_while_held: list[Tokens] = []
    b_answered = trio.Event()

    class HeldMesh(WatchedMesh):
        async def send(self, sender: str, peer: str, frame: Frame) -> None:
            held = drafters[0] if drafters else None
            while_held = held is not None and held.entered.is_set() and not held.gate.is_set()
            if peer == GATEWAY and isinstance(frame, Tokens) and while_held:
                frames_while_held.append(frame)
                b_answered.set()
            await super().send(sender, peer, frame)

    mesh = HeldMesh(tiny_model)
    gateway = mesh.gateway_with(0, make, lane=True)
    params = SamplingParams(max_new_tokens=TOKENS)
    outs: dict[str, list[int]] = {}

    async def run(name, prompt):
        outs[name] = await collect(gateway, prompt, params)

    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        async with trio.open_nursery() as requests:
            requests.start_soon(run, "a", PROMPT)
            await trio.testing.wait_all_tasks_blocked()
            held = drafters[0]
            await trio.to_thread.run_sync(held.entered.wait)  # a's propose is held
            requests.start_soon(run, "b", other)
            await b_answered.wait()  # b's prefill came back while a's propose was held
            held.gate.set()
        nursery.cancel_scope.cancel()
    assert frames_while_held
    assert outs["a"] == reference(tiny_model, PROMPT, TOKENS)
    assert outs["b"] == reference(tiny_model, other, TOKENS)
    assert gateway.statistics().verify_steps > 0
    main = threading.get_ident()
    assert len(drafters) == 2
    assert all(d.thread_ids and main not in d.thread_ids for d in drafters)
    assert model.resident_bytes() == model.weight_bytes()  # both drafters closed
