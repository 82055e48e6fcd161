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

Not here yet (issue 14): the 3-node mesh figures (``admitted_ratio`` on a
mesh, ``prefix_ttft_ratio``, ``shared_prompt_throughput_ratio``,
``migration_pause_ratio``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from hetmesh.errors import Rejected
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
        KVLimits(10_000, context, budget_tokens, reserve_whole=whole),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--budget-tokens", type=int, default=8192, help="one stage's KV pool")
    args = parser.parse_args()
    result = run(args.contexts, args.repeats, args.budget_tokens)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return
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


if __name__ == "__main__":
    main()
