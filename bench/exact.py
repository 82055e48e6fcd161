"""Exactness benchmark (issue 44): a busy mesh's greedy streams equal one process's.

    python bench/exact.py --json               # the issue's run: >= 200 streams
    python bench/exact.py --quick --json       # fewer streams, formats and freezes

For each weight format (``--formats``: int4, int8, bfloat16, float32) it starts
two loopback meshes of node processes (``hetmesh.testbed.local_mesh``) serving the
default model in that format:

* ``replicas``: three nodes, each able to hold the whole model;
* ``cut``: three nodes whose ``--max-memory`` is too small for the whole model
  (the planner cuts it into stages; the layout served is reported).

Each mesh's KV pool is small (``--pool-tokens`` per stage), so sessions are
preempted and resumed by replaying their history. ``--clients`` concurrent
clients run a seeded mix of greedy streams: prompts of 8 to 1,000 random token
ids, 16 to 200 new tokens. Every finished stream is compared, token for token,
with one process (``LocalPipeline``, one stage) holding the model in the same
format. ``<format>_identical_ratio`` is the share of that format's streams equal
to it; ``streams_checked`` counts them all.

``freeze_runs_identical``: on the int4 replicas mesh, ``--freeze-runs`` times, a
stream of 120 tokens after a chat-sized prompt runs; once it has 20 tokens, the
replica serving it gets SIGSTOP and, once the stream has moved on (a replay on
another replica) or 20 s passed, SIGCONT. 1 when every such stream equals the
reference.

``--speed`` instead measures what exact attention costs, in one process: the
default model in ``--speed-format`` loaded twice (exact attention, and torch's
kernel: ``attn_implementation="sdpa"``), measured in alternation in the same
run, CPU time of one thread (steadier than wall time on a shared machine): a
decode step of one session, a decode round of 8 sessions, a 291-token prefill.

Figures are ratios of equal streams: a loaded machine makes the run slower,
never different. Failed streams (refused, timed out) are counted, not compared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from hetmesh.errors import MeshError

FORMATS = ("int4", "int8", "bfloat16", "float32")
CONTEXT = 1536
# what one node may offer for the whole model with its pool (replicas), and a cap
# under the whole model's need in each format (weights + KV budget + workspace: ~315
# MiB in int4, ~345 in int8, ~470 in bf16) that makes the planner cut it
WHOLE_MEMORY = "2GiB"
CUT_MEMORY = {"int4": "240MiB", "int8": "260MiB", "bfloat16": "340MiB", "float32": "520MiB"}


def stream_mix(seed: int, count: int, quick: bool) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per stream: prompts 8-1,000 tokens, outputs 16-200."""
    rng = random.Random(seed)
    longest, most = (300, 32) if quick else (1000, 200)
    return [
        (
            [rng.randrange(200, 20000) for _ in range(rng.randint(8, longest))],
            rng.randint(16, most),
        )
        for _ in range(count)
    ]


async def _collect(client: Any, prompt: list[int], tokens: int) -> list[int]:
    from hetmesh.client.mesh import TokenEvent

    got: list[int] = []
    events = client.stream(prompt_ids=prompt, max_new_tokens=tokens)
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                got.append(event.token_id)
    return got


def mesh_streams(
    fmt: str,
    memory: str,
    mix: Sequence[tuple[list[int], int]],
    clients: int,
    pool_tokens: int,
    pipelines: int = 1,
) -> dict[str, Any]:
    """Run ``mix`` through a fresh 3-node mesh in ``fmt``; its finished streams."""
    import trio

    from hetmesh.client.mesh import open_mesh_client
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    args = [
        *("--weights", fmt, "--max-memory", memory, "--max-context", str(CONTEXT)),
        *("--kv-pool-tokens", str(pool_tokens)),
    ]
    done: list[tuple[list[int], int, list[int]]] = []
    failed = 0
    with local_mesh(3, node_args=args) as mesh:
        view = wait_serving(mesh, pipelines=pipelines, timeout_s=600)
        # the units each node holds: whole-model replicas, or a cut
        layout = sorted(
            [(s["start"], s["end"]) for s in p["record"]["stages"]] for p in view["peers"]
        )

        async def run() -> None:
            nonlocal failed
            async with open_mesh_client(mesh.addr, mesh_secret=mesh.secret, timeout_s=1800) as c:
                turn = iter(mix)

                async def client() -> None:
                    nonlocal failed
                    for prompt, tokens in turn:
                        try:
                            done.append((prompt, tokens, await _collect(c, prompt, tokens)))
                        except MeshError as exc:
                            failed += 1
                            print(f"{fmt}: stream failed: {exc!r}", file=sys.stderr)

                async with trio.open_nursery() as nursery:
                    for _ in range(clients):
                        nursery.start_soon(client)

        trio.run(run)
    return {"done": done, "failed": failed, "layout": layout}


def freeze_stream(
    prompt: list[int], tokens: int, runs: int, pool_tokens: int
) -> list[tuple[list[int], bool]]:
    """``runs`` int4 streams, each with the replica serving it frozen then thawed; each
    stream's tokens and whether a replica was frozen under it."""
    import trio

    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    args = [
        *("--weights", "int4", "--max-memory", WHOLE_MEMORY, "--max-context", str(CONTEXT)),
        *("--kv-pool-tokens", str(pool_tokens)),
    ]
    outputs: list[tuple[list[int], bool]] = []
    with local_mesh(3, node_args=args) as mesh:
        wait_serving(mesh, pipelines=2, timeout_s=600)  # a replica to move to
        gateway = mesh.nodes[0]
        replicas = {n.peer_id: n for n in mesh.nodes[1:]}

        async def serving(client: Any) -> str | None:
            """The replica holding the session, once its announced load says so."""
            for _ in range(40):  # records are announced every few seconds
                view = await client.status()
                for entry in view["peers"]:
                    load = entry["record"]["load"]
                    if entry["peer_id"] in replicas and load["active_sessions"]:
                        return str(entry["peer_id"])
                await trio.sleep(0.25)
            return None

        async def one(client: Any) -> tuple[list[int], bool]:
            got: list[int] = []
            frozen: str | None = None
            thawed = trio.Event()
            moved_on = trio.Event()  # tokens came after the freeze: replayed elsewhere

            async def thaw_later(peer: str) -> None:
                with trio.move_on_after(20):
                    await moved_on.wait()
                os.kill(replicas[peer].proc.pid, signal.SIGCONT)
                thawed.set()

            async with trio.open_nursery() as nursery:
                events = client.stream(prompt_ids=prompt, max_new_tokens=tokens)
                async with contextlib.aclosing(events) as stream:
                    async for event in stream:
                        if not (isinstance(event, TokenEvent) and event.token_id >= 0):
                            continue
                        got.append(event.token_id)
                        if frozen is not None and len(got) > 22:
                            moved_on.set()
                        if len(got) == 20 and frozen is None:
                            peer = await serving(client)
                            if peer is not None and peer != gateway.peer_id:
                                frozen = peer
                                os.kill(replicas[peer].proc.pid, signal.SIGSTOP)
                                nursery.start_soon(thaw_later, peer)
                if frozen is not None:
                    await thawed.wait()
            return got, frozen is not None

        async def run() -> None:
            async with open_mesh_client(gateway.addr, mesh_secret=mesh.secret, timeout_s=900) as c:
                for _ in range(runs):
                    outputs.append(await one(c))

        trio.run(run)
    return outputs


def reference(fmt: str, streams: Sequence[tuple[list[int], int, list[int]]]) -> int:
    """How many of ``streams`` equal one process holding the model in ``fmt``."""
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import eos_token_ids, load_tokenizer

    model_dir = resolve_model()
    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(model_dir, 1, weights=fmt)
    eos = eos_token_ids(model_dir, load_tokenizer(model_dir))
    equal = 0
    for prompt, tokens, got in streams:
        params = SamplingParams(max_new_tokens=tokens)
        want = list(pipeline.generate_ids(prompt, params, eos_ids=eos))
        equal += want == got
        if want != got:
            first = next(
                (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None
            )
            print(f"{fmt}: a {len(prompt)}-token prompt differs at {first}", file=sys.stderr)
    return equal


def speed(fmt: str, context: int = 200, repeats: int = 3) -> dict[str, Any]:
    """Exact attention against torch's kernel, in one process (see the docstring)."""
    from hetmesh.partition.stage import StageModule, load_stage
    from hetmesh.partition.store import resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model()
    end = 32  # the default model's units: embedding, 30 layers, head
    stages = {
        i: load_stage(model_dir, 0, end, weights=fmt, attn_implementation=i)
        for i in ("exact", "sdpa")
    }
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (context + 13 * i,), generator=gen) for i in range(8)]
    token = torch.tensor([7])

    def single(stage: StageModule, steps: int = 16) -> float:
        kv = stage.new_kv()
        stage.forward(prompts[0], kv, last_only=True)
        began = time.thread_time()
        for _ in range(steps):
            stage.forward(token, kv, last_only=True)
        kv.free()
        return (time.thread_time() - began) / steps

    def batched(stage: StageModule, steps: int = 8) -> float:
        pool = stage.new_pool(8 * ((context + 13 * 8 + steps) // 16 + 2))
        kvs = [stage.new_kv(pool) for _ in prompts]
        for prompt, kv in zip(prompts, kvs, strict=True):
            stage.forward(prompt, kv, last_only=True)
        began = time.thread_time()
        for _ in range(steps):
            stage.forward_batch([(token, kv) for kv in kvs], last_only=True)
        for kv in kvs:
            kv.free()
        return (time.thread_time() - began) / steps

    def prefill(stage: StageModule) -> float:
        kv = stage.new_kv()
        began = time.thread_time()
        stage.forward(prompts[-1], kv, last_only=True)
        kv.free()
        return time.thread_time() - began

    best: dict[str, dict[str, float]] = {i: {} for i in stages}
    for rep in range(repeats):
        order = list(stages) if rep % 2 == 0 else list(stages)[::-1]
        for name in order:
            for what, fn in (("decode", single), ("round8", batched), ("prefill", prefill)):
                t = fn(stages[name])
                best[name][what] = min(best[name].get(what, t), t)
    out: dict[str, Any] = {"speed_format": fmt, "speed_prefill_tokens": len(prompts[-1])}
    for what in ("decode", "round8", "prefill"):
        out[f"speed_{what}_ms_exact"] = round(1e3 * best["exact"][what], 2)
        out[f"speed_{what}_ms_sdpa"] = round(1e3 * best["sdpa"][what], 2)
        out[f"speed_{what}_ratio"] = round(best["exact"][what] / best["sdpa"][what], 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_format = max(1, args.streams // (2 * len(args.formats)))
    result: dict[str, Any] = {"streams_checked": 0, "streams_failed": 0}
    began = time.perf_counter()
    for i, fmt in enumerate(args.formats if args.streams else ()):
        streams: list[tuple[list[int], int, list[int]]] = []
        for topology, memory, pipelines in (
            ("replicas", WHOLE_MEMORY, 2),
            ("cut", CUT_MEMORY[fmt], 1),
        ):
            mix = stream_mix(100 * i + len(topology), per_format, args.quick)
            got = mesh_streams(fmt, memory, mix, args.clients, args.pool_tokens, pipelines)
            print(
                f"{fmt} {topology}: {len(got['done'])} streams, {got['failed']} failed, "
                f"layout {got['layout']}",
                file=sys.stderr,
                flush=True,
            )
            streams.extend(got["done"])
            result["streams_failed"] += got["failed"]
            result[f"{fmt}_{topology}_layout"] = got["layout"]
        equal = reference(fmt, streams)
        result["streams_checked"] += len(streams)
        key = "bf16" if fmt == "bfloat16" else fmt
        result[f"{key}_identical_ratio"] = round(equal / len(streams), 4) if streams else 0.0
        result[f"{key}_streams"] = len(streams)
    if args.freeze_runs:
        prompt = stream_mix(7, 1, True)[0][0][:60]
        outputs = freeze_stream(prompt, 120, args.freeze_runs, args.pool_tokens)
        equal = reference("int4", [(prompt, 120, got) for got, _ in outputs])
        result["freeze_runs"] = len(outputs)
        result["freeze_runs_frozen"] = sum(frozen for _, frozen in outputs)
        result["freeze_runs_identical"] = int(bool(outputs) and equal == len(outputs))
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="few, short streams; one freeze")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=None)
    parser.add_argument(
        "--streams", type=int, default=None, help="streams in all (>= 200; 0: freezes only)"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=None, help="KV tokens per stage")
    parser.add_argument("--freeze-runs", type=int, default=None)
    parser.add_argument("--speed", action="store_true", help="what exact attention costs")
    parser.add_argument("--speed-format", choices=FORMATS, default="int4")
    args = parser.parse_args()
    if args.speed:
        print(json.dumps(speed(args.speed_format), sort_keys=True))
        return
    args.formats = args.formats or list(FORMATS)
    quick = args.quick
    if args.streams is None:
        args.streams = 4 * len(args.formats) if quick else 208
    args.pool_tokens = args.pool_tokens or (1024 if quick else 4096)
    args.freeze_runs = (1 if quick else 20) if args.freeze_runs is None else args.freeze_runs
    result = run(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return
    for key, value in sorted(result.items()):
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
