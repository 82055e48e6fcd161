"""Scheduler benchmark: optimality gap, gain over baselines, planning time.

    python bench/scheduler.py            # a table
    python bench/scheduler.py --json     # one JSON object

1. **Optimality** — random meshes of 2-7 devices drawn from realistic classes
   (datacenter / consumer / laptop GPU, CPU server / desktop; links 100 Mbit/s to
   100 Gbit/s) for 7B-, 13B- and 70B-shaped models in fp16, both objectives: the
   planner and the heuristic alone (the path used beyond 7 devices) against the
   brute-force optimum (every ordered device subset × every contiguous split ×
   every partition into replicas). Ratio = planner quality ÷ optimum (1 = optimal).
2. **Baselines** — random meshes of 3-12 devices with mixed compute and links:
   how many times better the planner's prediction is than even split,
   memory-proportional (exo) and greedy fill (Petals-style), medians over both
   objectives (per-objective figures too). Instances where a baseline does not
   fit at all are counted apart.
3. **Planning time** — site-structured meshes of 10, 100 and 1,000 devices
   (datacenter racks and homes), an 80-layer (70B-shaped) model: the slower of
   the two objectives, median of three runs.

Everything is seeded; every figure comes from the scheduler's cost model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from hetmesh.errors import InsufficientCapacity
from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.resources import ModelProfile
from hetmesh.scheduler import BASELINES, PlanConstraints, SearchOptions, plan
from hetmesh.scheduler.bruteforce import optimum
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.dp import Problem
from hetmesh.scheduler.planner import usable_devices
from hetmesh.scheduler.records import Objective
from hetmesh.scheduler.synthetic import random_mesh, site_mesh

OBJECTIVES: tuple[Objective, ...] = ("latency", "throughput")
HEURISTIC = SearchOptions(exact_device_limit=0)


def models() -> dict[str, ModelProfile]:
    return {
        name: model_profile(KNOWN_SHAPES[name], dtype="float16", name=name)
        for name in ("llama-7b", "llama-13b", "llama-70b")
    }


def quality(objective: Objective, found: float, best: float) -> float:
    """1.0 = as good as ``best``; below 1 = worse."""
    return best / found if objective == "latency" else found / best


def optimality(rng: random.Random, per_model: int) -> dict[str, Any]:
    planner: dict[str, list[float]] = {o: [] for o in OBJECTIVES}
    heuristic: dict[str, list[float]] = {o: [] for o in OBJECTIVES}
    cons = PlanConstraints()
    for model in models().values():
        for objective in OBJECTIVES:
            done = 0
            while done < per_model:
                devices, links = random_mesh(rng, rng.randint(2, 7))
                try:
                    got = plan(devices, links, model, objective=objective, constraints=cons)
                except InsufficientCapacity:
                    continue
                cost = CostModel(model, devices, links, cons)
                best = optimum(Problem(cost, objective), usable_devices(cost))
                heur = plan(devices, links, model, objective=objective, options=HEURISTIC)
                planner[objective].append(quality(objective, got.objective_value, best))
                heuristic[objective].append(quality(objective, heur.objective_value, best))
                done += 1
    everything = planner["latency"] + planner["throughput"]
    heur_all = heuristic["latency"] + heuristic["throughput"]
    out: dict[str, Any] = {
        "optimal_instances": len(everything),
        "optimal_ratio_median": statistics.median(everything),
        "optimal_ratio_worst": min(everything),
        "optimal_within_1pct_fraction": sum(q >= 0.99 for q in everything) / len(everything),
        "heuristic_optimal_ratio_median": statistics.median(heur_all),
        "heuristic_optimal_ratio_worst": min(heur_all),
        "heuristic_within_1pct_fraction": sum(q >= 0.99 for q in heur_all) / len(heur_all),
    }
    for objective in OBJECTIVES:
        out[f"heuristic_optimal_ratio_median_{objective}"] = statistics.median(heuristic[objective])
        out[f"heuristic_optimal_ratio_worst_{objective}"] = min(heuristic[objective])
    return out


def versus_baselines(rng: random.Random, per_model: int) -> dict[str, Any]:
    gains: dict[str, dict[str, list[float]]] = {b: {o: [] for o in OBJECTIVES} for b in BASELINES}
    unfit = {b: 0 for b in BASELINES}
    compared = 0
    for model in models().values():
        for objective in OBJECTIVES:
            done = 0
            while done < per_model:
                devices, links = random_mesh(rng, rng.randint(3, 12))
                try:
                    got = plan(devices, links, model, objective=objective)
                except InsufficientCapacity:
                    continue
                done += 1
                compared += 1
                for name, baseline in BASELINES.items():
                    try:
                        other = baseline(devices, links, model, objective=objective)
                    except InsufficientCapacity:
                        unfit[name] += 1
                        continue
                    gains[name][objective].append(
                        1.0 / quality(objective, other.objective_value, got.objective_value)
                    )
    out: dict[str, Any] = {"baseline_instances": compared}
    keys = {"even": "even", "memory-proportional": "memory_proportional", "greedy": "greedy"}
    for name, key in keys.items():
        pooled = gains[name]["latency"] + gains[name]["throughput"]
        out[f"vs_{key}_median"] = statistics.median(pooled)
        out[f"vs_{key}_worst"] = min(pooled)
        for objective in OBJECTIVES:
            out[f"vs_{key}_median_{objective}"] = statistics.median(gains[name][objective])
        out[f"{key}_does_not_fit_fraction"] = unfit[name] / compared
    return out


def planning_time(rng_seed: int) -> dict[str, Any]:
    model = models()["llama-70b"]
    out: dict[str, Any] = {}
    for size in (10, 100, 1000):
        devices, links = site_mesh(random.Random(rng_seed + size), size)
        slowest = 0.0
        for objective in OBJECTIVES:
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                result = plan(devices, links, model, objective=objective)
                runs.append(time.perf_counter() - t0)
            seconds = statistics.median(runs)
            out[f"plan_seconds_{size}_devices_{objective}"] = seconds
            out[f"pipelines_{size}_devices_{objective}"] = len(result.pipelines)
            slowest = max(slowest, seconds)
        out[f"plan_seconds_{size}_devices"] = slowest
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--per-model", type=int, default=20, help="instances per model/objective")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"seed": args.seed}
    result.update(optimality(random.Random(args.seed), args.per_model))
    result.update(versus_baselines(random.Random(args.seed + 1), args.per_model))
    result.update(planning_time(args.seed + 2))
    result["bench_seconds"] = time.perf_counter() - t0
    result["targets_met"] = {
        "optimal_ratio_median >= 0.99": result["optimal_ratio_median"] >= 0.99,
        "vs_memory_proportional_median >= 1.5": result["vs_memory_proportional_median"] >= 1.5,
        "plan_seconds_1000_devices <= 1.0": result["plan_seconds_1000_devices"] <= 1.0,
    }
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
    else:
        width = max(len(k) for k in result)
        for key in sorted(result):
            value = result[key]
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {shown}")
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
