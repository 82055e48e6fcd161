"""Where a decode step's time goes, and how it scales with torch threads (issue 47).

One process, the default model whole in one stage (``--weights``, default int4),
greedy decode steps after a short prompt:

- ``--profile``: ``torch.profiler`` over ``--steps`` decode steps at each of
  ``--threads`` (e.g. ``1,2``): the table of ops by self CPU time, and the
  wall time per token under the profiler (which inflates per-op overhead);
- ``--split``: a decode token's wall time in the layers (one scripted call,
  or lean_decode's), the head and the rest, best of ``--rounds`` at each thread
  count, beside the stage's own int4 products called alone (the layers less
  these: the work between the kernels);
- default: decode steps timed at each thread count, interleaved round by round
  (ABBA) in this one process, wall and CPU time per token, with the median
  ratio (a count above 1 also with the stage's thread chooser,
  :mod:`hetmesh.partition.threads`); then single kernels at decode shapes (int4
  products, the int8 head) at each thread count, best of several tries.

On a shared machine compare only the ratios of one run (both arms share its
slow spells), and say the machine was loaded.

Usage: ``python bench/step_profile.py [--json] [--profile | --split] [--threads 1,2] [--steps 8]
[--rounds 4] [--weights int4] [--eager]`` (``--eager``: transformers' decoder layers
instead of :mod:`hetmesh.partition.lean`'s, for a before/after profile)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

PROMPT = [1, 504, 3458, 282, 4649, 314]


def _stage(weights: str, lean: bool = True) -> Any:
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.stage import load_stage
    from hetmesh.partition.store import check_model_dir, resolve_model

    model = resolve_model()
    units = model_profile(check_model_dir(model)).num_units
    stage = load_stage(model, 0, units, weights=weights)
    stage.lean = stage.lean and lean
    return stage


def _decode(stage: Any, steps: int, prof: Any = None) -> tuple[float, float]:
    """Wall and CPU seconds per decode step over ``steps`` steps of a fresh session
    (its prefill not counted; ``prof``: a torch profiler to start after it)."""
    kv = stage.new_kv()
    token = int(stage.forward(torch.tensor(PROMPT), kv, last_only=True)[-1].argmax())
    if prof is not None:
        prof.start()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        token = int(stage.forward(torch.tensor([token]), kv, last_only=True)[-1].argmax())
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def profile(stage: Any, threads: list[int], steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out: dict[str, Any] = {}
    for count in threads:
        torch.set_num_threads(count)
        _decode(stage, 4)  # warm
        prof = torch_profile(activities=[ProfilerActivity.CPU])
        wall, _cpu = _decode(stage, steps, prof)
        prof.stop()
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        out[f"{count}t"] = {
            "ms_per_token_profiled": round(wall * 1e3, 1),
            "ops": [
                {
                    "op": e.key,
                    "share": round(e.self_cpu_time_total / total, 3),
                    "calls_per_token": round(e.count / steps, 1),
                    "mean_us": round(e.self_cpu_time_total / max(1, e.count), 1),
                }
                for e in rows
            ],
        }
    return out


def thread_ab(stage: Any, threads: list[int], steps: int, rounds: int) -> dict[str, Any]:
    """Decode steps at each thread count, interleaved round by round (ABBA); a count above
    1 twice where the stage has a thread chooser: fixed (``"2t"``) and chosen by it
    (``"2t-adaptive"``, its probes included; the chooser keeps its state across rounds)."""
    chooser = stage.threads
    arms = [(t, False) for t in threads]
    if chooser is not None:
        arms += [(t, True) for t in threads if t > 1]
    wall: dict[tuple[int, bool], list[float]] = {arm: [] for arm in arms}
    cpu: dict[tuple[int, bool], list[float]] = {arm: [] for arm in arms}
    try:
        for r in range(rounds):
            for count, adaptive in arms if r % 2 == 0 else list(reversed(arms)):
                torch.set_num_threads(count)
                stage.threads = chooser if adaptive else None
                w, c = _decode(stage, steps)
                wall[(count, adaptive)].append(w * 1e3)
                cpu[(count, adaptive)].append(c * 1e3)
    finally:
        stage.threads = chooser
    base = statistics.median(wall[arms[0]])
    return {
        f"{t}t{'-adaptive' if adaptive else ''}": {
            "wall_ms_per_token": [round(x, 1) for x in wall[(t, adaptive)]],
            "cpu_ms_per_token": [round(x, 1) for x in cpu[(t, adaptive)]],
            "speedup_vs_first": round(base / statistics.median(wall[(t, adaptive)]), 3),
        }
        for t, adaptive in arms
    }


class _Restart:
    """Passed to :func:`_decode` as its profiler: empties ``spent`` once the prefill is done."""

    def __init__(self, spent: dict[str, float]) -> None:
        self.spent = spent

    def start(self) -> None:
        self.spent.clear()


def split(stage: Any, threads: list[int], steps: int, rounds: int) -> dict[str, Any]:
    """Where a decode token's wall time goes, best of ``rounds`` at each thread count: the
    layers (the scripted call or the Python lean_decode, per step), the head, the rest of
    the step; and the stage's own int4 products alone, called as the layers call them (one
    bf16 row each, in layer order): the layers less these is the work between kernels."""
    from hetmesh.partition import stage as stage_module
    from hetmesh.partition.quant import INT4_GROUP

    spent: dict[str, float] = {}

    def timed(label: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - began

        return call

    names = ("decode_layers", "lean_decode")
    reals = {name: getattr(stage_module, name) for name in names}
    head_forward = stage.lm_head.forward
    products = [
        (torch.ones(1, sz.shape[0] * INT4_GROUP, dtype=torch.bfloat16), packed, sz)
        for plan in stage._lean_plans()
        for group in (plan.qkv, plan.o, plan.mlp_in, plan.mlp_down)
        for packed, sz, *_ in group.int4 or ()
    ]
    out: dict[str, Any] = {}
    try:
        for name in names:
            setattr(stage_module, name, timed("layers", reals[name]))
        stage.lm_head.forward = timed("head", head_forward)
        for count in threads:
            torch.set_num_threads(count)
            best: dict[str, float] = {}
            for _ in range(rounds):
                wall, _cpu = _decode(stage, steps, _Restart(spent))  # counts from the steps
                row = {k: v / steps for k, v in spent.items()}
                row["step"] = wall
                began = time.perf_counter()
                for x, packed, sz in products:
                    torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz)
                row["int4_kernels_alone"] = time.perf_counter() - began
                for key, value in row.items():
                    best[key] = min(best.get(key, value), value)
            ms = {f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}
            ms["rest_ms"] = round(
                (best["step"] - best.get("layers", 0.0) - best.get("head", 0.0)) * 1e3, 3
            )
            ms["int4_calls"] = len(products)
            out[f"{count}t"] = ms
    finally:
        for name in names:
            setattr(stage_module, name, reals[name])
        del stage.lm_head.forward
    return out


def kernels(threads: list[int], tries: int = 10) -> dict[str, Any]:
    from hetmesh.partition.quant import (
        Int4Linear,
        Int8Linear,
        quantize_groups_int4,
        quantize_rows_int8,
    )

    torch.manual_seed(0)

    def int4(k: int, n: int) -> Int4Linear:
        layer = Int4Linear(k, n, bias=False, device="cpu")
        layer.weight_packed, layer.scales_zeros = Int4Linear.pack(
            *quantize_groups_int4(torch.randn(n, k))
        )
        return layer

    head = Int8Linear(576, 49152, bias=False, device="cpu", bf16_activations=True)
    head.weight_q, head.weight_scale = quantize_rows_int8(torch.randn(49152, 576))
    # the stage's head: W8A8 from oneDNN's packed product where exact (quant.py)
    packed = Int8Linear(576, 49152, bias=False, device="cpu", packed=True)
    packed.weight_q, packed.weight_scale = head.weight_q, head.weight_scale
    cases: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {
        "int4 576x1536": (int4(576, 1536), torch.randn(1, 576)),
        "int4 1536x576": (int4(1536, 576), torch.randn(1, 1536)),
        "int4 576x192": (int4(576, 192), torch.randn(1, 576)),
        "int8 head 576x49152 (bf16 act)": (head, torch.randn(1, 576)),
        "int8 head 576x49152 (packed W8A8)": (packed, torch.randn(1, 576)),
        "fp32 linear 576x1536": (torch.nn.Linear(576, 1536, bias=False), torch.randn(1, 576)),
    }
    best: dict[tuple[str, int], float] = {}
    for r in range(tries):
        for count in threads if r % 2 == 0 else list(reversed(threads)):
            torch.set_num_threads(count)
            for name, (module, x) in cases.items():
                module(x)
                began = time.perf_counter()
                for _ in range(3):
                    module(x)
                took = (time.perf_counter() - began) / 3 * 1e6
                best[(name, count)] = min(best.get((name, count), took), took)
    return {
        name: {f"{t}t_us": round(best[(name, t)], 1) for t in threads}
        | {"speedup": round(best[(name, threads[0])] / best[(name, threads[-1])], 2)}
        for name in cases
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--split", action="store_true", help="a token's time: layers, head, rest, kernels alone"
    )
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--eager", action="store_true", help="transformers' decoder layers, not the lean ones"
    )
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    stage = _stage(args.weights, lean=not args.eager)
    result: dict[str, Any] = {"weights": args.weights, "cpu": _cpu_name(), "lean": stage.lean}
    with torch.inference_mode():
        if args.profile:
            result["profile"] = profile(stage, threads, args.steps)
        elif args.split:
            result["split"] = split(stage, threads, args.steps, args.rounds)
        else:
            result["decode"] = thread_ab(stage, threads, args.steps, args.rounds)
            result["kernels"] = kernels(threads)
    print(json.dumps(result, indent=None if args.json else 2))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
