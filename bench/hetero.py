"""Does placing by measured speed beat the baselines on real runs? (root, Linux)

``python bench/hetero.py [--json]`` builds three emulated hosts on this machine
(``hetmesh/testbed/mesh.py``: network namespaces, ``tc tbf``, cgroup v1) that differ
the way a home cluster does:

====  =========  ==============  ==========
host  CPU quota  offers memory   link
====  =========  ==============  ==========
A     100%       600 MiB         unlimited
B     50%        450 MiB         unlimited
C     25%        3 GiB           50 Mbit
====  =========  ==============  ==========

The memory offers are sized for the default model in float32, the default
``--weights`` here: A alone cannot hold it, so every plan cuts it (as int4 the
whole model fits on A, and hetmesh's plan has no hop to predict). The run fails
unless hetmesh's plan has at least ``--min-stages`` stages (default 2), and
prints each strategy's plan.

For each strategy — ``hetmesh`` (the planner), ``memory-proportional`` (exo's
split) and ``even`` — it starts a fresh mesh of real ``hetmesh node start``
processes with ``--plan-strategy`` forcing that placement on the coordinator,
waits until the plan is served, and times greedy generations entering at host
A: decode tokens/s is ``(n - 1) ÷`` the time from the first to the last token,
the median over ``--runs``. It also reads the plan's predicted per-token
decode latency (the cost model, calibrated by each node's measured block step)
and compares it with the measured one.

``--json`` prints one object: ``vs_memory_proportional`` and ``vs_even``
(hetmesh's decode tokens/s ÷ the baseline's; targets ≥ 1.3 for the first),
``prediction_error`` (|predicted − measured| ÷ measured for hetmesh's plan;
target ≤ 0.10 since issue 16), and per strategy the plan, predicted and measured
figures, with ``error_terms``: the prediction's miss split into the stages'
compute (each stage server's own recent step times, read right after the
generations) and the rest of a token (hops, the gateway), and
``contention_per_token``: each host's CPU, waits for a CPU and quota throttling
per token during the generations (schedstat, the cgroup's ``cpu.stat``). On a
loaded machine ``prediction_error_cpu`` compares the prediction with every host's
CPU per token (one stream's stages work in sequence, so a quiet machine's token
takes about that; other load stretches wall time, not CPU time; prefill and
background threads included). ``prediction_error`` stays the figure of record. ``--strategies
hetmesh`` measures hetmesh's plan alone (the ratios need all three).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hetmesh.testbed.mesh import (
    HostSpec,
    MeshTestbed,
    devices_of,
    open_mesh_testbed,
    plan_of,
    wait_for,
    why_no_testbed,
)

GIB = 1 << 30
HOSTS = (
    HostSpec(cpu=1.0, max_memory="600MiB"),
    HostSpec(cpu=0.5, max_memory="450MiB"),
    HostSpec(cpu=0.25, max_memory="3GiB", rate="50mbit"),
)
NAMES = "ABC"
STRATEGIES = ("hetmesh", "memory-proportional", "even")
NODE_ARGS = ("--max-sessions", "4", "--max-context", "256")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def stage_steps_of(view: dict[str, Any]) -> dict[str, float]:
    """peer id -> the median of its stage servers' recent step times (wall, seconds).

    Read right after the generations, so these are decode steps of one stream:
    what each stage really costs per token, against which the plan's predicted
    ``decode_step_s`` is compared (the rest of a token's time is hops and the gateway).
    """
    out = {}
    for peer in view.get("peers", []):
        recent = [
            float(x)
            for x in ((peer.get("record") or {}).get("load") or {}).get("recent_step_s") or ()
        ]
        if recent:
            out[str(peer["peer_id"])] = statistics.median(recent)
    return out


def placed_everyone(bed: MeshTestbed) -> dict[str, Any] | None:
    """The status view once a served plan places every host, costed on every host's
    calibration (else None): on a loaded machine the slowest host can join, or still
    be timing its block, after a first plan of the others is served, and a baseline
    planned without it measures another layout beside a node burning CPU."""
    view = bed.wait_serving()
    plan = plan_of(view)
    peers = set(bed.peer_host())
    if plan is None:
        return None
    placed = {s.peer_id for p in plan.pipelines for s in p.stages}
    calibrated = {k.split("/")[0] for k in plan.constraints.block_step_s_by_device}
    return view if peers <= placed and peers <= calibrated else None


def _pids(bed: MeshTestbed, host: int) -> set[int]:
    """The processes in host ``host``'s cgroups (its node and anything it started)."""
    pids: set[int] = set()
    for group in bed.net.hosts[host].cgroups:
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(x) for x in (group / "cgroup.procs").read_text().split())
    return pids


def sched_of(bed: MeshTestbed) -> dict[int, tuple[float, float, float]]:
    """host -> (CPU seconds, seconds runnable but waiting for a CPU, seconds throttled by
    its quota), summed over its processes' threads (``/proc/PID/task/*/schedstat``; the
    cgroup's ``cpu.stat``) since they started: read before and after the generations,
    the difference says what the machine's other load cost each host."""
    out = {}
    for host in range(len(bed.specs)):
        cpu = wait = throttled = 0.0
        for pid in _pids(bed, host):
            for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    words = stat.read_text().split()
                    cpu += int(words[0]) / 1e9
                    wait += int(words[1]) / 1e9
        for group in bed.net.hosts[host].cgroups:
            with contextlib.suppress(OSError, ValueError):
                for line in (group / "cpu.stat").read_text().splitlines():
                    key, value = line.split()
                    if key == "throttled_time":  # cgroup v1, ns
                        throttled += int(value) / 1e9
                    elif key == "throttled_usec":  # v2
                        throttled += int(value) / 1e6
        out[host] = (cpu, wait, throttled)
    return out


def contention_of(
    before: dict[int, tuple[float, float, float]],
    after: dict[int, tuple[float, float, float]],
    tokens: int,
) -> dict[str, dict[str, float]]:
    """Per host, per generated token: CPU, waiting for a CPU, throttled (milliseconds)."""
    return {
        NAMES[h]: {
            name: round((after[h][i] - before[h][i]) / max(1, tokens) * 1e3, 2)
            for i, name in enumerate(("cpu_ms", "runqueue_wait_ms", "throttled_ms"))
        }
        for h in after
        if h in before
    }


def error_terms(
    stages: list[dict[str, Any]], measured_ms: float, overhead_ms: float
) -> dict[str, float]:
    """Where a plan's prediction misses: stage compute, and everything else per token.

    ``overhead_ms``: the plan's ``stage_overhead_s`` (in its predicted steps; counted
    here with the rest, as a stage server's measured step is its compute alone).
    """
    steps = [s["measured_step_ms"] for s in stages]
    if any(x is None for x in steps):
        return {}
    compute_measured = sum(steps)
    compute_predicted = sum(s["predicted_step_ms"] - overhead_ms for s in stages)
    links_predicted = sum(s["predicted_link_out_ms"] + overhead_ms for s in stages)
    from hetmesh.node.calibration import stage_overhead_from_tokens

    return {
        # the cost model's PlanConstraints.stage_overhead_s as this run measured it
        "stage_overhead_measured_ms": round(stage_overhead_from_tokens(measured_ms, steps), 2),
        "stages_measured_ms": round(compute_measured, 2),
        "stages_predicted_ms": round(compute_predicted, 2),
        "rest_measured_ms": round(measured_ms - compute_measured, 2),  # hops, gateway, stream
        "rest_predicted_ms": round(links_predicted, 2),
    }


def measure_strategy(
    bed: MeshTestbed,
    strategy: str,
    prompt_ids: list[int],
    tokens: int,
    runs: int,
    weights: str = "float32",
    min_stages: int = 1,
) -> dict[str, Any]:
    import cut  # bench/cut.py, beside this file

    began = time.monotonic()
    bed.start_all(*NODE_ARGS, "--plan-strategy", strategy, "--weights", weights)
    try:
        view = wait_for(
            lambda: placed_everyone(bed), 240.0, f"{strategy}: a plan placing every host"
        )
        up_s = time.monotonic() - began
        plan = plan_of(view)
        if plan is None:  # placed_everyone saw one
            raise RuntimeError(f"{strategy}: the plan vanished from the status view")
        hosts = bed.peer_host()
        names = {p: NAMES[h] for p, h in hosts.items()}
        print(f"{strategy}: plan {cut.describe(plan, names)}", file=sys.stderr, flush=True)
        cut.require_plan(
            plan,
            f"a cut of at least {min_stages} stages",
            lambda p: len(p.pipelines[0].stages) >= min_stages,
            names,
        )
        devices = devices_of(view)
        bed.generate(prompt_ids, 4)  # warm-up: links opened, caches touched
        sched_before = sched_of(bed)
        gens = bed.generate(prompt_ids, tokens, repeat=runs)
        contention = contention_of(
            sched_before, sched_of(bed), sum(len(g.get("tokens") or ()) for g in gens)
        )
        failed = [g for g in gens if "tokens" not in g]
        if failed:
            raise RuntimeError(f"{strategy}: generation failed: {failed[0]}")
        per_token = [
            (g["times_s"][-1] - g["times_s"][0]) / (len(g["times_s"]) - 1)
            for g in gens
            if len(g["times_s"]) > 1
        ]
        decode_s = statistics.median(per_token)
        # every host's CPU per generated token (prefill and background threads included):
        # one stream's token is its stages' work in sequence plus the links' transit,
        # so on a quiet machine its wall time is about this; the machine's other load
        # stretches wall time, not CPU time
        cpu_s = max(sum(c["cpu_ms"] for c in contention.values()) / 1e3, 1e-9)
        served = stage_steps_of(bed.status())  # the stages' own step times, just now
        stages = [
            {
                "host": NAMES[hosts[s.peer_id]],
                "units": [s.start, s.end],
                "predicted_step_ms": round(s.decode_step_s * 1e3, 2),
                "measured_step_ms": round(served[s.peer_id] * 1e3, 2)
                if s.peer_id in served
                else None,
                "predicted_link_out_ms": round(s.link_out_s * 1e3, 2),
            }
            for s in plan.pipelines[0].stages
        ]
        calibration = plan.constraints.block_step_s_by_device
        return {
            "strategy": plan.strategy,
            "plan": cut.describe(plan, names),
            "stages": stages,
            "units_per_host": {
                NAMES[h]: sum(
                    s.end - s.start for s in plan.pipelines[0].stages if hosts[s.peer_id] == h
                )
                for h in range(len(bed.specs))
            },
            "measured_gflops": {
                NAMES[hosts[p]]: round(float(d.get("matmul_flops", 0.0)) / 1e9, 1)
                for p, d in devices.items()
                if p in hosts
            },
            "measured_block_step_ms": {
                NAMES[hosts[k.split("/")[0]]]: round(v * 1e3, 2)
                for k, v in calibration.items()
                if k.split("/")[0] in hosts
            },
            # the quota each host announced under one core (its stages of a cut burst)
            "cpu_share": {
                NAMES[hosts[k.split("/")[0]]]: v
                for k, v in plan.constraints.cpu_share_by_device.items()
                if k.split("/")[0] in hosts
            },
            "error_terms": error_terms(
                stages, decode_s * 1e3, plan.constraints.stage_overhead_s * 1e3
            ),
            "contention_per_token": contention,
            "cpu_ms_per_token": round(cpu_s * 1e3, 1),
            "predicted_ms_per_token": round(plan.decode_latency_s * 1e3, 1),
            "measured_ms_per_token": round(decode_s * 1e3, 1),
            "runs_ms_per_token": [round(x * 1e3, 1) for x in per_token],
            "decode_tokens_per_s": round(1.0 / decode_s, 2),
            "tokens": gens[0]["tokens"],
            "mesh_up_s": round(up_s, 1),
            "predicted_s": plan.decode_latency_s,
            "measured_s": decode_s,
            "cpu_s": cpu_s,
        }
    finally:
        bed.stop_nodes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--weights",
        default="float32",
        help="every node's weight format (the hosts' offers are sized to cut float32)",
    )
    parser.add_argument(
        "--min-stages", type=int, default=2, help="fail unless hetmesh's plan has this many"
    )
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated subset (hetmesh first); the ratios need all three",
    )
    args = parser.parse_args()
    strategies = [s for s in STRATEGIES if s in args.strategies.split(",")]
    why = why_no_testbed()
    if why:
        print(f"cannot build the testbed here: {why}", file=sys.stderr)
        return 2
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, load_tokenizer

    prompt_ids = encode_prompt(load_tokenizer(resolve_model()), PROMPT, chat=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hetmesh-hetero-"))
    began, load_before = time.monotonic(), os.getloadavg()[0]
    results: dict[str, dict[str, Any]] = {}
    with open_mesh_testbed(workdir, HOSTS) as bed:
        for strategy in strategies:
            results[strategy] = measure_strategy(
                bed,
                strategy,
                prompt_ids,
                args.tokens,
                args.runs,
                args.weights,
                args.min_stages if strategy == "hetmesh" else 1,
            )
            if not args.json:
                r = results[strategy]
                print(
                    f"{strategy:>20}: plan {r['plan']}, units {r['units_per_host']}, "
                    f"{r['decode_tokens_per_s']:.2f} tokens/s measured, "
                    f"{r['measured_ms_per_token']:.1f} ms/token "
                    f"(predicted {r['predicted_ms_per_token']:.1f})",
                    flush=True,
                )
    het = results["hetmesh"]
    out: dict[str, Any] = {
        **{
            f"vs_{name.replace('-', '_')}": round(
                results[name]["measured_s"] / het["measured_s"], 3
            )
            for name in ("memory-proportional", "even")
            if name in results
        },
        "prediction_error": round(
            abs(het["predicted_s"] - het["measured_s"]) / het["measured_s"], 3
        ),
        # the same against all hosts' CPU per token (a loaded machine stretches wall time)
        "prediction_error_cpu": round(abs(het["predicted_s"] - het["cpu_s"]) / het["cpu_s"], 3),
        "prediction_error_baselines": {
            s: round(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"], 3)
            for s, r in results.items()
            if s != "hetmesh"
        },
        "outputs_identical": len({tuple(r["tokens"]) for r in results.values()}) == 1,
        "hosts": {
            NAMES[i]: {"cpu_quota": h.cpu, "offers": h.max_memory, "link": h.rate or "unlimited"}
            for i, h in enumerate(HOSTS)
        },
        "weights": args.weights,
        "plan": het["plan"],
        "tokens": args.tokens,
        "runs": args.runs,
        "seconds": round(time.monotonic() - began, 1),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "strategies": {
            s: {
                k: v
                for k, v in r.items()
                if k not in ("tokens", "predicted_s", "measured_s", "cpu_s")
            }
            for s, r in results.items()
        },
    }
    (workdir / "hetero.json").write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "strategies"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
