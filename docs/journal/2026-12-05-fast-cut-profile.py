"""Where one decode token's time goes on a 3-stage cut (docs/journal/2026-12-05-fast-cut.md).

Three StageServers and a Gateway in one trio run, wired by plain calls as in
tests/integration/node/test_stage_loop_fast.py (fast path: outputs leave from the
device thread), default model int4, cut [0,11) [11,21) [21,32). One clock for
every stage, so each hop's gap is measured directly. No data plane: its cost
per hop comes from bench/transport.py. Run from the worktree root:
    .venv/bin/python docs/journal/2026-12-05-fast-cut-profile.py [tokens]
"""

from __future__ import annotations

import statistics as st
import sys
import threading
import time
from contextlib import aclosing

import torch
import trio

from hetmesh.node.control import CloseSession, OpenSession, Reply
from hetmesh.node.gateway import Gateway, Hop
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.stage_server import StageServer
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import resolve_model
from hetmesh.transport.frames import Frame

LAYOUT = {"a": (0, 11), "b": (11, 21), "c": (21, 32)}
PROMPT = [1, 504, 3458, 282, 1029, 314, 253]
TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 48
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
events: list[tuple[float, str, str]] = []  # (time, where, what)


def note(where: str, what: str) -> None:
    events.append((time.perf_counter(), where, what))


class Wiring:
    def __init__(self, model_dir, context=256) -> None:
        self.servers: dict[str, StageServer] = {}
        for peer, (start, end) in LAYOUT.items():
            stage = load_stage(model_dir, start, end)
            limits = KVLimits(
                max_sessions=8,
                max_tokens_per_session=context,
                budget_bytes=8 * context * stage.kv_bytes_per_token(),
            )
            self.servers[peer] = StageServer(
                stage, limits=limits, send=self.send, send_now=self.send_now
            )
            forward = stage.forward_batch

            def timed(items, *, forward=forward, peer=peer, **kw):
                note(peer, "fwd0")
                out = forward(items, **kw)
                note(peer, "fwd1")
                return out

            stage.forward_batch = timed
        self.gateway = Gateway(
            peer_id="gw",
            control=self.control,
            send=self.send,
            choose=self.choose,
            ping=self.ping,
            eos_token_ids=frozenset(),
            max_context=context,
        )

    def deliver(self, peer: str, frame: Frame) -> None:
        note(peer, "recv")
        if peer == "gw":
            self.gateway.on_frame(frame)
        else:
            self.servers[peer].submit(frame, release=lambda: None)

    async def send(self, peer: str, frame: Frame) -> None:
        note(peer, "sent_trio")
        self.deliver(peer, frame)

    def send_now(self, peer: str, frame: Frame) -> bool:
        note(peer, "sent_thread")
        trio.from_thread.run_sync(self.deliver, peer, frame)
        return True

    async def control(self, peer: str, request: OpenSession | CloseSession) -> Reply:
        return self.servers[peer].handle(request)

    async def choose(self, session_id, avoid, hashes=()):
        return tuple(Hop(peer, *units) for peer, units in LAYOUT.items())

    async def ping(self, peer: str) -> bool:
        return True


async def run(wiring: Wiring) -> list[int]:
    out: list[int] = []
    async with trio.open_nursery() as nursery:
        for server in wiring.servers.values():
            await nursery.start(server.serve)
        params = SamplingParams(max_new_tokens=TOKENS)
        async with aclosing(wiring.gateway.generate(PROMPT, params)) as stream:
            async for token in stream:
                note("client", "token")
                out.append(token)
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    torch.set_num_threads(1)  # the nodes' default, both sides
    model = resolve_model()
    whole = LocalPipeline.load(model, 1)
    params = SamplingParams(max_new_tokens=TOKENS)
    list(whole.generate_ids([1, 2, 3], SamplingParams(max_new_tokens=4), eos_ids=set()))
    three = LocalPipeline.load(model, 3)  # the same cut, chained in one thread: no hops
    three.stages = [load_stage(model, s, e) for s, e in LAYOUT.values()]

    def tpot(pipeline: LocalPipeline) -> tuple[float, list[int]]:
        stamps, ids = [], []
        for token in pipeline.generate_ids(PROMPT, params, eos_ids=set()):
            stamps.append(time.perf_counter())
            ids.append(token)
        return st.median([b - a for a, b in zip(stamps[1:], stamps[2:])]), ids

    wiring = Wiring(model)
    ones, chained, cuts = [], [], []
    for _ in range(ROUNDS):  # A/B/C alternating: the machine's load moves under us
        one, ref = tpot(whole)
        ones.append(one)
        chained.append(tpot(three)[0])
        events.clear()
        got = trio.run(run, wiring)
        assert got == ref, (got, ref)
        stamps = [t for t, w, x in events if w == "client"]
        cuts.append(st.median([b - a for a, b in zip(stamps[1:], stamps[2:])]))
    for name, values in (("one process", ones), ("3 stages chained", chained), ("cut", cuts)):
        print(f"{name:20s} ms/token per round: {[round(v * 1e3, 1) for v in values]}")
    print(f"ratios one/cut per round: {[round(a / b, 3) for a, b in zip(ones, cuts)]}")
    print(f"ratios one/chained per round: {[round(a / b, 3) for a, b in zip(ones, chained)]}")
    # per decode token: one cycle from the gateway receiving token k to token k+1
    recv = [t for t, w, x in events if (w, x) == ("gw", "recv")]
    spans: dict[str, list[float]] = {}
    for t0, t1 in zip(recv[2:], recv[3:]):
        marks: dict[tuple[str, str], float] = {}
        for t, w, x in events:
            if t0 <= t <= t1 and (w, x) != ("gw", "recv"):
                marks.setdefault((w, x), t)
        marks[("gw", "recv")] = t1
        order = [
            ("gateway: recv -> send to a", ("a", "sent_trio")),
            ("a: submit -> forward start", ("a", "fwd0")),
            ("stage a forward", ("a", "fwd1")),
            ("a: forward end -> send_now", ("b", "sent_thread")),
            ("a->b: device thread -> trio", ("b", "recv")),
            ("b: submit -> forward start", ("b", "fwd0")),
            ("stage b forward", ("b", "fwd1")),
            ("b: forward end -> send_now", ("c", "sent_thread")),
            ("b->c: device thread -> trio", ("c", "recv")),
            ("c: submit -> forward start", ("c", "fwd0")),
            ("stage c forward (head, sample)", ("c", "fwd1")),
            ("c: forward end -> send_now", ("gw", "sent_thread")),
            ("c->gw: device thread -> trio", ("gw", "recv")),
        ]
        last = t0
        for name, key in order:
            t = marks[key]
            spans.setdefault(name, []).append(t - last)
            last = t
        spans.setdefault("total per token", []).append(t1 - t0)
    print(f"threads={threading.active_count()} tokens={TOKENS} outputs identical: True")
    for name, values in spans.items():
        print(f"{name:34s} {st.median(values) * 1e3:7.3f} ms  mean {st.mean(values) * 1e3:7.3f}")
    print("(the breakdown is the last round's)")


if __name__ == "__main__":
    main()
