"""What exactness costs, in one process (``python bench/exact.py --speed``; see
``bench/exact.py``'s docstring)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def padded_lone_rows(stage: torch.nn.Module) -> Iterator[int]:
    """``stage``'s fp32 layers pad a few rows as before the exact kernel (to 4 on AMD's
    EPYC, F.linear's way; to 2 where a packed way takes 1-row calls); yields how many
    layers took the kernel or 1-row calls."""
    from hetmesh.partition.exact_linear import ExactLinear

    fp32 = [
        m for m in stage.modules() if isinstance(m, ExactLinear) and m.weight.dtype == torch.float32
    ]
    kernel = [(m, m.kernel) for m in fp32 if m.kernel]
    lone = [m for m in fp32 if m.lone]
    for m, _ in kernel:
        m.kernel = 0
    for m in lone:
        m.lone = False
    try:
        yield len(kernel) + len(lone)
    finally:
        for m, chain in kernel:
            m.kernel = chain
        for m in lone:
            m.lone = True


def speed(fmt: str, context: int = 200, repeats: int = 3) -> dict[str, Any]:
    """Exact attention against torch's kernel, in one process (see the docstring)."""
    from hetmesh.partition.exact_gemm import per_query_calls
    from hetmesh.partition.stage import StageModule, load_stage
    from hetmesh.partition.store import resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model()
    end = 32  # the default model's units: embedding, 30 layers, head
    stages = {
        "exact": load_stage(model_dir, 0, end, weights=fmt, attn_implementation="exact"),
        "plain_linear": load_stage(model_dir, 0, end, weights=fmt, exact_linears=False),
        "sdpa": load_stage(
            model_dir, 0, end, weights=fmt, attn_implementation="sdpa", exact_linears=False
        ),
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

    # "exact_calls": the exact stage with one attention call per query (exact_gemm's
    # products off), the way before them; "exact_padded" (a decode step and a round):
    # the exact stage with its fp32 products' few rows padded, the way before the exact
    # kernel (and before 1-row packed calls)
    names = [*stages, "exact_calls"]
    best: dict[str, dict[str, float]] = {i: {} for i in names}
    padded: dict[str, list[float]] = {"decode": [], "round8": []}
    lone_layers: list[int] = []
    for rep in range(repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            calls = name == "exact_calls"
            with per_query_calls() if calls else contextlib.nullcontext():
                for what, fn in (("decode", single), ("round8", batched), ("prefill", prefill)):
                    t = fn(stages["exact" if calls else name])
                    best[name][what] = min(best[name].get(what, t), t)
        with padded_lone_rows(stages["exact"]) as flipped:
            padded["decode"].append(single(stages["exact"]))
            padded["round8"].append(batched(stages["exact"]))
        lone_layers.append(flipped)
    out: dict[str, Any] = {"speed_format": fmt, "speed_prefill_tokens": len(prompts[-1])}
    for what in ("decode", "round8", "prefill"):
        for name in names:
            out[f"speed_{what}_ms_{name}"] = round(1e3 * best[name][what], 2)
        out[f"speed_{what}_ratio"] = round(best["exact"][what] / best["sdpa"][what], 3)
        plain = best["plain_linear"][what]
        out[f"speed_{what}_ratio_vs_plain_linear"] = round(best["exact"][what] / plain, 3)
    for what in ("decode", "round8"):
        out[f"speed_{what}_ms_exact_padded"] = round(1e3 * min(padded[what]), 2)
        out[f"speed_{what}_ratio_padded"] = round(min(padded[what]) / best["sdpa"][what], 3)
    out["speed_lone_row_layers"] = lone_layers[-1] if lone_layers else 0
    return out
