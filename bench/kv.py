"""Paged-KV benchmark: how attention reads a session's blocks, on this CPU.

    python bench/kv.py                  # table
    python bench/kv.py --json           # one JSON object
    python bench/kv.py --contexts 128 1024 --repeats 200

One decode step of one attention layer of the default model's shape (9
query heads, 3 KV heads of 64 dims, fp32, one thread) reading a session of
``T`` tokens from a paged pool (``hetmesh.partition.kv``), two ways:

* ``view``: the session's blocks form one run, so its keys and values are a
  slice of the pool (what the allocator gives whenever it can);
* ``gather``: the blocks are interleaved with another session's, so the read
  is an ``index_select`` of the session's slots (what a fragmented pool costs).

Both include writing the new token's key and value into the pool. Each
figure is the median of ``repeats`` steps in µs; ``gather_over_view_T`` is
their ratio, measured in the same run. Compare rows, not absolutes, on a
shared machine (``../shared/KV.md``).

``sim_admitted_ratio`` is an admission *simulation* (no model, no mesh):
the stage's real ``KVManager`` over a real pool of ``--budget-tokens``
serves a queue of the issue's mix (prompts 20–600 tokens, outputs 16–256,
half the requests without ``max_tokens``, i.e. reserving up to the context
of 2,048 under the old policy), one token per session per tick, preempted
sessions requeued first with their history as the new prompt. It reports
the mean sessions running at once while the queue is non-empty, paged ÷ the
old ``reserve_whole`` policy, and what preemption cost (replayed tokens).
The session-count cap is set out of the way: in a node it is
``--max-sessions``, which bounds both policies alike.

With ``--mesh`` it also starts three node processes on loopback serving the
default model (``hetmesh.testbed.local_mesh``; the third started with
``--no-prefix-cache``, so requests entering there always prefill their whole
prompt) and measures, through the SDK:

* ``prefix_ttft_ratio``: TTFT of a request sharing a 1,000-token prefix with a
  finished one ÷ TTFT of that first one (median over ``--mesh-repeats`` fresh
  prefixes; both enter at the first node). Target ≤ 0.25.
* ``shared_prompt_throughput_ratio``: tokens/s of 16 concurrent streaming
  clients whose prompts share a 500-token system prompt, entering at the first
  node ÷ the same entering at the third (no prefix cache). One request
  warms each gateway first. Target ≥ 1.5.
* ``outputs_identical``: every stream of both equals the single-process
  reference (greedy).

With ``--migration`` it measures ``migration_pause_ratio`` on two 4-node
loopback meshes (node processes; 500 MiB each, so three split the model and
the fourth backs one stage up as a standby): a greedy stream with a
1,000-token prompt enters at a node outside the replicated stage; after a few
tokens the replica serving it gets SIGTERM, which drains it: its stages
retire and the gateway moves the session to the other replica between two
steps. The pause is the longest gap between two tokens from the signal on.
In the first mesh the gateway migrates the KV; in the second
(``--no-migrate``) it replays the history through the new route. Ratio:
migrated pause ÷ replayed pause, target ≤ 0.3; both streams must equal the
single-process reference, and the counters say which path each took.

With ``--admitted`` it measures ``admitted_ratio`` on two 3-node loopback meshes
started one after the other in the same run, alike but for admission: paged
(the default) and the old reservation path (``--kv-reserve-whole``), each stage's
pool ``--admitted-pool-tokens`` tokens. ``--admitted-clients`` clients each send
the issue's mix back to back for ``--admitted-seconds`` (seeded; prompts of
20–600 random in-vocabulary ids, outputs of 16–256 tokens, half the requests
without ``max_tokens``: they ask for up to the context, 1,536, and the client
stops reading at its drawn length, as at an end of sequence). Every 0.5 s after
the first ``--admitted-warmup-s`` it reads the sessions each stage holds (the
nodes' announced load) and reports their mean: paged ÷ reserve-whole. The first
``--admitted-check`` streams of each mesh (finished ones, then the tokens that
streams cut off by the window's end had received) are compared with the
single-process reference (``outputs_identical``). Target ≥ 3.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from hetmesh.errors import MeshError, Rejected
from hetmesh.node.kvcache import KVLimits, KVManager
from hetmesh.partition.kv import KVPool, SessionKV

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _session(pool: KVPool, tokens: int, *, fragmented: bool) -> SessionKV:
    kv = SessionKV(owner=0, pool=pool, max_length=1 << 20)
    other = SessionKV(owner=0, pool=pool, max_length=1 << 20)
    step = pool.block_tokens
    for held in range(step, tokens + 2 * step, step):  # grow block by block
        kv.reserve(held)
        if fragmented:
            other.reserve(held)  # takes the next block: the tables interleave
    with torch.inference_mode():
        pool.keys.normal_()
        pool.values.normal_()
    kv._length = tokens  # the prefill's keys are the random pool contents
    return kv


def measure(tokens: int, repeats: int, *, fragmented: bool) -> float:
    """Median µs of one decode step's KV write + read + attention at ``tokens`` of context."""
    blocks = 2 * (tokens // 16 + 2) + 2
    pool = KVPool(
        num_blocks=blocks,
        num_layers=1,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv = _session(pool, tokens, fragmented=fragmented)
    assert kv.contiguous is not fragmented, "the layout under test was not built"
    query = torch.randn(1, Q_HEADS, 1, HEAD_DIM)
    key = torch.randn(KV_HEADS, 1, HEAD_DIM)
    times: list[float] = []
    with torch.inference_mode():
        for _ in range(repeats + 10):
            started = time.perf_counter()
            keys, values = kv._write(0, key, key)
            F.scaled_dot_product_attention(
                query, keys.unsqueeze(0), values.unsqueeze(0), enable_gqa=True
            )
            times.append(time.perf_counter() - started)
    return statistics.median(times[10:]) * 1e6


def simulate(
    budget_tokens: int, *, whole: bool, requests: int = 300, seed: int = 0
) -> dict[str, float]:
    """Mean sessions running at once (and preemption costs) under one admission policy."""
    context = 2048
    rng = random.Random(seed)
    queue: deque[tuple[int, int, int]] = deque()  # (id, tokens to prefill, tokens still to make)
    limits: dict[int, int] = {}
    for rid in range(requests):
        prompt, output = rng.randint(20, 600), rng.randint(16, 256)
        limits[rid] = prompt + output if rng.random() < 0.5 else context
        queue.append((rid, prompt, output))
    pool = KVPool(
        num_blocks=budget_tokens // 16,
        num_layers=1,
        kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    manager: KVManager[SessionKV] = KVManager(
        # the loop below admits strictly in arrival order itself (preempted ones first)
        KVLimits(10_000, context, budget_tokens, reserve_whole=whole, fcfs=False),
        pool=pool,
        factory=lambda: SessionKV(owner=0, pool=pool, max_length=context),
    )
    running: dict[str, tuple[int, int]] = {}  # sid -> (id, tokens still to make)
    held: dict[str, int] = {}  # sid -> tokens held
    samples: list[int] = []
    replayed = preempted = attempt = 0
    while queue or running:
        while queue:  # admit in order until the stage says busy
            rid, prefill, left = queue[0]
            sid = f"{rid}.{attempt}"
            try:
                manager.open(sid, limits[rid], prefill)
            except Rejected:
                break
            queue.popleft()
            attempt += 1
            running[sid], held[sid] = (rid, left), prefill
        if queue:
            samples.append(len(running))
        for sid in list(running):  # one decode step each, oldest first
            if sid not in running:
                continue  # preempted earlier in this tick
            for gone in manager.grow(sid, held[sid] + 1):
                rid, left = running.pop(gone)
                preempted += 1
                replayed += held[gone]
                queue.appendleft((rid, held.pop(gone), left))  # resumes first
            if sid not in running:
                continue
            held[sid] += 1
            rid, left = running[sid]
            if left == 1:
                manager.close(sid)
                del running[sid], held[sid]
            else:
                running[sid] = (rid, left - 1)
    assert pool.free_blocks == pool.num_blocks, "blocks leaked"
    return {
        "running": statistics.fmean(samples) if samples else 0.0,
        "preemptions": preempted,
        "replayed_tokens": replayed,
    }


def run(contexts: list[int], repeats: int, budget_tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = {"threads": 1, "repeats": repeats, "budget_tokens": budget_tokens}
    paged = simulate(budget_tokens, whole=False)
    old = simulate(budget_tokens, whole=True)
    result["sim_running_paged"] = round(paged["running"], 2)
    result["sim_running_reserve_whole"] = round(old["running"], 2)
    result["sim_admitted_ratio"] = round(paged["running"] / old["running"], 2)
    result["sim_preemptions"] = paged["preemptions"]
    result["sim_replayed_tokens"] = paged["replayed_tokens"]
    for t in contexts:
        view = measure(t, repeats, fragmented=False)
        gather = measure(t, repeats, fragmented=True)
        result[f"view_us_{t}"] = round(view, 1)
        result[f"gather_us_{t}"] = round(gather, 1)
        result[f"gather_over_view_{t}"] = round(gather / view, 2)
    return result


# a pool of 32k tokens per stage (committed only as used): sixteen 500-token prompts
# fit without the cache even when a loaded machine is slow to close earlier sessions
MESH_ARGS = ["--max-memory", "500MiB", "--max-context", "1536", "--kv-pool-tokens", "32768"]
QUESTIONS = (
    "Why is the sky blue?",
    "What is a lighthouse for?",
    "How do birds fly?",
    "Why does ice float?",
    "What makes thunder?",
    "How do plants drink?",
    "Why do cats purr?",
    "What is a comet?",
    "How do bees make honey?",
    "Why is the sea salty?",
    "What is an echo?",
    "How does a compass work?",
    "Why do leaves fall?",
    "What is a rainbow?",
    "How do fish breathe?",
    "Why do we dream?",
)


async def _stream(client: Any, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """TTFT and the token ids of one greedy stream."""
    from hetmesh.client.mesh import TokenEvent

    began = time.perf_counter()
    first = 0.0
    ids: list[int] = []
    async for event in client.stream(prompt_ids=prompt_ids, max_new_tokens=tokens):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            first = first or time.perf_counter() - began
            ids.append(event.token_id)
    return first, ids


def mesh_run(repeats: int, tokens: int, clients: int) -> dict[str, Any]:
    """The mesh figures (see the module docstring)."""
    import trio

    from hetmesh.client.mesh import open_mesh_client
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, eos_token_ids, load_tokenizer
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    model_dir = resolve_model()
    tokenizer = load_tokenizer(model_dir)

    def ids(text: str) -> list[int]:
        return list(encode_prompt(tokenizer, text))

    filler = ids("The sea is wide, the night is long, and the keeper climbs the stair. " * 120)
    prefixes = [(ids(f"Logbook {r} of the lighthouse.") + filler)[:1000] for r in range(repeats)]
    ttft_prompts = [(p + ids(" First entry:"), p + ids(" Last entry:")) for p in prefixes]
    system = ids("A guide for children who ask about the world. " * 60)[:500]
    shared = [system + ids(f" Question: {q} Answer:") for q in QUESTIONS[:clients]]
    out: dict[str, Any] = {}
    with local_mesh(3, node_args=MESH_ARGS, per_node_args=[(), (), ("--no-prefix-cache",)]) as mesh:
        wait_serving(mesh)

        async def measure() -> None:
            cached_addr, plain_addr = mesh.nodes[0].addr, mesh.nodes[2].addr
            async with (
                # sixteen prompts prefilled at once can take minutes on a loaded machine
                open_mesh_client(cached_addr, mesh_secret=mesh.secret, timeout_s=900) as cached,
                open_mesh_client(plain_addr, mesh_secret=mesh.secret, timeout_s=900) as plain,
            ):
                await _stream(cached, ids("Hello there."), 2)  # warm up links and forwards
                await _stream(plain, ids("Hello there."), 2)
                firsts, seconds = [], []
                for first, second in ttft_prompts:
                    t1, a = await _stream(cached, first, tokens)
                    t2, b = await _stream(cached, second, tokens)
                    firsts.append(t1)
                    seconds.append(t2)
                    out.setdefault("ttft_outputs", []).extend([(first, a), (second, b)])
                out["ttft_first_s"] = statistics.median(firsts)
                out["ttft_shared_s"] = statistics.median(seconds)
                print(f"TTFT first {firsts}, shared {seconds}", file=sys.stderr, flush=True)

                async def wave(client: Any, key: str) -> None:
                    await _stream(client, shared[0], 1)  # the system prompt seen once
                    got: dict[int, list[int]] = {}

                    async def one(i: int) -> None:
                        for attempt in range(5):  # a loaded machine can stall a stage's pings
                            try:
                                got[i] = (await _stream(client, shared[i], tokens))[1]
                                return
                            except MeshError as exc:
                                print(f"{key} client {i}: {exc!r}", file=sys.stderr)
                                out[f"{key}_retries"] = out.get(f"{key}_retries", 0) + 1
                                await trio.sleep(2.0 * (attempt + 1))
                        raise SystemExit(f"{key} client {i} failed five times")

                    began = time.perf_counter()
                    async with trio.open_nursery() as nursery:
                        for i in range(len(shared)):
                            nursery.start_soon(one, i)
                    elapsed = time.perf_counter() - began
                    out[f"{key}_tokens_per_s"] = sum(len(v) for v in got.values()) / elapsed
                    print(f"{key}: {out[f'{key}_tokens_per_s']:.2f} tokens/s", file=sys.stderr)
                    out[f"{key}_outputs"] = [(shared[i], got[i]) for i in sorted(got)]

                await wave(plain, "plain")
                await wave(cached, "cached")

        trio.run(measure)
    # the reference runs after the mesh is gone, on the same cores
    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(model_dir, 1)
    params = SamplingParams(max_new_tokens=tokens)
    streams = out.pop("ttft_outputs") + out.pop("plain_outputs") + out.pop("cached_outputs")
    eos = eos_token_ids(model_dir, tokenizer)  # the mesh stops there too
    identical = all(
        list(pipeline.generate_ids(p, params, eos_ids=eos)) == got for p, got in streams
    )
    return {
        "prefix_ttft_first_s": round(out["ttft_first_s"], 3),
        "prefix_ttft_shared_s": round(out["ttft_shared_s"], 3),
        "prefix_ttft_ratio": round(out["ttft_shared_s"] / out["ttft_first_s"], 3),
        "shared_prompt_tokens_per_s_cached": round(out["cached_tokens_per_s"], 2),
        "shared_prompt_tokens_per_s_plain": round(out["plain_tokens_per_s"], 2),
        "shared_prompt_throughput_ratio": round(
            out["cached_tokens_per_s"] / out["plain_tokens_per_s"], 2
        ),
        "shared_prompt_retries_cached": out.get("cached_retries", 0),
        "shared_prompt_retries_plain": out.get("plain_retries", 0),
        "mesh_clients": len(shared),
        "mesh_tokens": tokens,
        "mesh_repeats": repeats,
        "outputs_identical": bool(identical),
    }


# each node's --max-memory is added by bench/cut.py: three nodes must cut the model,
# and the fourth backs one of the three stages up
MIGRATION_STAGES = 3
MIGRATION_ARGS = [
    "--max-sessions",
    "4",
    "--max-context",
    "1536",
    "--block-step-ms",
    "3",
]


def _find(record: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a nested status record (None: absent)."""
    if isinstance(record, dict):
        if key in record:
            return record[key]
        values: Any = record.values()
    elif isinstance(record, list | tuple):
        values = record
    else:
        return None
    for value in values:
        found = _find(value, key)
        if found is not None:
            return found
    return None


def _moved_stream(
    migrate: bool, prompt_ids: list[int], tokens: int, move_after: int
) -> dict[str, Any]:
    """One stream whose serving replica is stopped (SIGTERM) after ``move_after`` tokens."""
    import signal

    import cut  # bench/cut.py, beside this file
    import trio

    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.discovery.status import fetch_status
    from hetmesh.partition.store import resolve_model
    from hetmesh.scheduler.replan import newest_in_view
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    args = cut.node_args_for(resolve_model(), MIGRATION_STAGES, MIGRATION_ARGS)
    args += [] if migrate else ["--no-migrate"]
    with local_mesh(4, node_args=args) as mesh:
        plan = newest_in_view(wait_serving(mesh, pipelines=2, timeout_s=900))
        names = cut.node_names(n.peer_id for n in mesh.nodes)

        def one_standby(p: Any) -> bool:  # a 3-stage cut, one stage backed up by the 4th
            if len(p.pipelines) != 2 or not cut.every_pipeline_has(MIGRATION_STAGES)(p):
                return False
            a, b = p.pipelines
            return sum(x.peer_id != y.peer_id for x, y in zip(a.stages, b.stages, strict=True)) == 1

        cut.require_plan(plan, "a 3-stage cut with one standby stage", one_standby, names)
        print(f"plan: {cut.describe(plan, names)}", file=sys.stderr, flush=True)
        primary, replica = plan.pipelines[0], plan.pipelines[1]
        (pair,) = [
            (a.peer_id, b.peer_id)
            for a, b in zip(primary.stages, replica.stages, strict=True)
            if a.peer_id != b.peer_id
        ]
        gateway = next(n for n in mesh.nodes if n.peer_id not in pair)
        by_peer = {n.peer_id: n for n in mesh.nodes}
        out: dict[str, Any] = {"ids": [], "gaps": [], "plan": cut.describe(plan, names)}

        async def sessions_on(peer: str) -> int:
            view = await fetch_status(gateway.addr, mesh_secret=mesh.secret)
            for entry in view["peers"]:
                if entry["peer_id"] == peer:
                    return int(entry["record"]["load"]["active_sessions"])
            return 0

        async def run() -> None:
            ids: list[int] = out["ids"]
            last = 0.0
            signalled = False
            async with open_mesh_client(gateway.addr, mesh_secret=mesh.secret, timeout_s=900) as c:
                async for event in c.stream(prompt_ids=prompt_ids, max_new_tokens=tokens):
                    if not isinstance(event, TokenEvent) or event.token_id < 0:
                        continue
                    now = time.perf_counter()
                    if signalled:
                        out["gaps"].append(now - last)
                    last = now
                    ids.append(event.token_id)
                    if len(ids) == move_after:
                        loads = {p: await sessions_on(p) for p in pair}
                        victim = max(pair, key=lambda p: loads[p])
                        by_peer[victim].proc.send_signal(signal.SIGTERM)
                        out["victim"] = victim
                        signalled = True
                        last = time.perf_counter()  # the status call is not the stream's pause
            await trio.sleep(1.5)  # the gateway's next announcement carries its counters
            view = await fetch_status(gateway.addr, mesh_secret=mesh.secret)
            mine = next(e for e in view["peers"] if e["peer_id"] == gateway.peer_id)
            for key in ("migrations", "migration_fallbacks", "move_replays", "recoveries"):
                out[key] = int(_find(mine["record"], key) or 0)
            migrated = [
                int(_find(e["record"], "kv_migrated_bytes") or 0)
                for e in view["peers"]
                if e["peer_id"] in pair
            ]
            out["kv_migrated_bytes"] = sum(migrated)

        trio.run(run)
    return out


def migration_run(context: int, tokens: int, move_after: int) -> dict[str, Any]:
    """``migration_pause_ratio`` (see the module docstring)."""
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, eos_token_ids, load_tokenizer

    model_dir = resolve_model()
    tokenizer = load_tokenizer(model_dir)
    text = "The keeper wrote the weather in the log each night, and the lamp burned on. " * 80
    prompt = list(encode_prompt(tokenizer, text))[:context]
    moved = _moved_stream(True, prompt, tokens, move_after)
    print(f"migrated: {moved}", file=sys.stderr, flush=True)
    replayed = _moved_stream(False, prompt, tokens, move_after)
    print(f"replayed: {replayed}", file=sys.stderr, flush=True)
    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(model_dir, 1)
    eos = eos_token_ids(model_dir, tokenizer)
    expected = list(
        pipeline.generate_ids(prompt, SamplingParams(max_new_tokens=tokens), eos_ids=eos)
    )
    pause_moved = max(moved["gaps"], default=0.0)
    pause_replayed = max(replayed["gaps"], default=0.0)
    steady = statistics.median(moved["gaps"]) if moved["gaps"] else 0.0
    return {
        "migration_context_tokens": len(prompt) + move_after,
        "migration_pause_s": round(pause_moved, 3),
        "migration_replay_pause_s": round(pause_replayed, 3),
        "migration_step_s_median": round(steady, 3),
        "migration_pause_ratio": round(pause_moved / pause_replayed, 3) if pause_replayed else None,
        "migration_migrations": moved["migrations"],
        "migration_kv_bytes": moved["kv_migrated_bytes"],
        "migration_replay_runs_migrations": replayed["migrations"],
        "migration_replay_runs_move_replays": replayed["move_replays"],
        "migration_recoveries": moved["recoveries"] + moved["migration_fallbacks"],
        "migration_outputs_identical": moved["ids"] == expected == replayed["ids"],
        "migration_plan": moved["plan"],
    }


ADMIT_CONTEXT = 1536  # MESH_ARGS' context: half the requests may run up to it


def admit_mix(seed: int, count: int) -> list[tuple[list[int], int, int]]:
    """The issue's mix: (prompt ids, max_new_tokens asked, tokens the client reads)."""
    rng = random.Random(seed)
    mix = []
    for _ in range(count):
        prompt = [rng.randrange(200, 20000) for _ in range(rng.randint(20, 600))]
        output = rng.randint(16, 256)
        asked = output if rng.random() < 0.5 else ADMIT_CONTEXT - len(prompt)
        mix.append((prompt, asked, output))
    return mix


def admitted_mesh(
    whole: bool, pool_tokens: int, clients: int, seconds: float, warmup_s: float, seed: int
) -> dict[str, Any]:
    """Mean sessions held per stage under the mix, on a fresh 3-node mesh; its streams."""
    import contextlib

    import trio

    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    args = [*MESH_ARGS[:4], "--kv-pool-tokens", str(pool_tokens)]
    if whole:
        args.append("--kv-reserve-whole")
    mix = admit_mix(seed, 4000)
    samples: list[float] = []
    done: list[tuple[list[int], int, list[int]]] = []
    partial: list[tuple[list[int], list[int]]] = []  # streams cut off by the window's end
    counts = {"streams": 0, "rejected": 0}
    with local_mesh(3, node_args=args) as mesh:
        wait_serving(mesh, timeout_s=300)

        async def measure() -> None:
            async with open_mesh_client(mesh.addr, mesh_secret=mesh.secret, timeout_s=900) as c:
                await _stream(c, [1, 504, 3458, 282], 2)  # warm up links and forwards
                turn = iter(mix)

                async def client() -> None:
                    for prompt, asked, output in turn:
                        for _attempt in range(1000):  # the same request again, as a queue would
                            if await one(prompt, asked, output):
                                break
                            await trio.sleep(1.0)

                async def one(prompt: list[int], asked: int, output: int) -> bool:
                    """One stream; False when refused (busy past the admission wait, or a stage
                    too slow to answer pings on a loaded box)."""
                    got: list[int] = []
                    partial.append((prompt, got))  # what arrived when the window closes
                    try:
                        events = c.stream(prompt_ids=prompt, max_new_tokens=asked)
                        async with contextlib.aclosing(events) as stream:
                            async for event in stream:
                                if isinstance(event, TokenEvent) and event.token_id >= 0:
                                    got.append(event.token_id)
                                    if len(got) >= output:
                                        break  # an end of sequence, as far as we care
                    except MeshError as exc:
                        counts["rejected"] += 1
                        print(f"stream: {exc!r}", file=sys.stderr)
                        partial.remove((prompt, got))
                        if got:  # failed mid-stream: what arrived still counts
                            done.append((prompt, len(got), got))
                        return False
                    counts["streams"] += 1
                    partial.remove((prompt, got))
                    done.append((prompt, output, got))
                    return True

                async def sample() -> None:
                    await trio.sleep(warmup_s)
                    while True:
                        with contextlib.suppress(MeshError):
                            view = await c.status()
                            held = [p["record"]["load"]["active_sessions"] for p in view["peers"]]
                            samples.append(statistics.fmean(held))
                        await trio.sleep(0.5)

                with trio.move_on_after(warmup_s + seconds):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(sample)
                        for _ in range(clients):
                            nursery.start_soon(client)

        trio.run(measure)
    running = statistics.fmean(samples) if samples else 0.0
    print(f"{'reserve-whole' if whole else 'paged'}: {running:.2f} sessions", file=sys.stderr)
    cut = [(p, len(got), got) for p, got in partial if got]  # their tokens so far count too
    return {"running": running, "samples": len(samples), "done": done + cut, **counts}


def admitted_run(
    pool_tokens: int, clients: int, seconds: float, warmup_s: float, check: int
) -> dict[str, Any]:
    """``admitted_ratio`` on the mesh (see the module docstring)."""
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import eos_token_ids, load_tokenizer

    paged = admitted_mesh(False, pool_tokens, clients, seconds, warmup_s, seed=1)
    old = admitted_mesh(True, pool_tokens, clients, seconds, warmup_s, seed=1)
    model_dir = resolve_model()
    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(model_dir, 1)
    eos = eos_token_ids(model_dir, load_tokenizer(model_dir))
    checked = paged["done"][:check] + old["done"][:check]
    # nothing finished (a saturated machine): nothing shown identical either
    identical = bool(checked) and all(
        list(pipeline.generate_ids(p, SamplingParams(max_new_tokens=n), eos_ids=eos)) == got
        for p, n, got in checked
    )
    return {
        "admitted_running_paged": round(paged["running"], 2),
        "admitted_running_reserve_whole": round(old["running"], 2),
        "admitted_ratio": round(paged["running"] / old["running"], 2) if old["running"] else 0.0,
        "admitted_streams_paged": paged["streams"],
        "admitted_streams_reserve_whole": old["streams"],
        "admitted_rejected_paged": paged["rejected"],
        "admitted_rejected_reserve_whole": old["rejected"],
        "admitted_samples": min(paged["samples"], old["samples"]),
        "admitted_pool_tokens": pool_tokens,
        "admitted_checked_streams": len(checked),
        "admitted_outputs_identical": bool(identical),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--budget-tokens", type=int, default=8192, help="one stage's KV pool")
    parser.add_argument("--mesh", action="store_true", help="add the 3-node mesh figures")
    parser.add_argument("--mesh-repeats", type=int, default=3)
    parser.add_argument("--mesh-tokens", type=int, default=16, help="tokens per stream")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument(
        "--migration", action="store_true", help="add migration_pause_ratio (two 4-node meshes)"
    )
    parser.add_argument("--migration-context", type=int, default=1000)
    parser.add_argument("--migration-tokens", type=int, default=40)
    parser.add_argument("--admitted", action="store_true", help="add the mesh admitted_ratio")
    parser.add_argument("--admitted-pool-tokens", type=int, default=6144)
    parser.add_argument("--admitted-clients", type=int, default=24)
    parser.add_argument("--admitted-seconds", type=float, default=60.0)
    parser.add_argument("--admitted-warmup-s", type=float, default=20.0)
    parser.add_argument("--admitted-check", type=int, default=4, help="streams checked per mesh")
    args = parser.parse_args()
    result = run(args.contexts, args.repeats, args.budget_tokens)
    if args.mesh:
        result.update(mesh_run(args.mesh_repeats, args.mesh_tokens, args.clients))
    if args.migration:
        result.update(migration_run(args.migration_context, args.migration_tokens, 4))
    if args.admitted:
        result.update(
            admitted_run(
                args.admitted_pool_tokens,
                args.admitted_clients,
                args.admitted_seconds,
                args.admitted_warmup_s,
                args.admitted_check,
            )
        )
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return
    if args.migration:
        print(
            f"stage moved at {result['migration_context_tokens']} tokens of context: pause "
            f"{result['migration_pause_s']} s migrated vs {result['migration_replay_pause_s']} s "
            f"replayed: ratio {result['migration_pause_ratio']} (target <= 0.3); outputs "
            f"identical: {result['migration_outputs_identical']}"
        )
    print(f"{'context':>8} {'view µs':>10} {'gather µs':>10} {'ratio':>6}")
    for t in args.contexts:
        print(
            f"{t:>8} {result[f'view_us_{t}']:>10} {result[f'gather_us_{t}']:>10} "
            f"{result[f'gather_over_view_{t}']:>6}"
        )
    print(
        f"admission simulation, {args.budget_tokens} tokens of KV: "
        f"{result['sim_running_paged']} sessions running (paged) vs "
        f"{result['sim_running_reserve_whole']} (reserve whole): "
        f"ratio {result['sim_admitted_ratio']}; {result['sim_preemptions']} preemptions "
        f"replaying {result['sim_replayed_tokens']} tokens"
    )
    if args.admitted:
        print(
            f"sessions held per stage on the mesh, {args.admitted_pool_tokens} tokens of KV: "
            f"{result['admitted_running_paged']} (paged) vs "
            f"{result['admitted_running_reserve_whole']} (reserve whole): ratio "
            f"{result['admitted_ratio']} (target >= 3); outputs identical: "
            f"{result['admitted_outputs_identical']}"
        )
    if args.mesh:
        print(
            f"TTFT with a cached 1,000-token prefix: {result['prefix_ttft_shared_s']} s vs "
            f"{result['prefix_ttft_first_s']} s: ratio {result['prefix_ttft_ratio']} "
            "(target <= 0.25)"
        )
        print(
            f"{result['mesh_clients']} clients sharing a 500-token system prompt: "
            f"{result['shared_prompt_tokens_per_s_cached']} vs "
            f"{result['shared_prompt_tokens_per_s_plain']} tokens/s: ratio "
            f"{result['shared_prompt_throughput_ratio']} (target >= 1.5); outputs identical: "
            f"{result['outputs_identical']}"
        )


if __name__ == "__main__":
    main()
