"""Bring up a heterogeneous mesh of real nodes on one machine (root, Linux).

``python bench/testbed.py`` builds three emulated hosts (network namespaces on
a bridge; CPU quotas 100%, 50% and 25% of a core; host 2 behind a 50 Mbit
link), starts ``hetmesh node start`` in each, waits until the planner's plan
is served, prints the hosts, their measured speeds and the plan, runs one
greedy generation, and tears everything down (also on Ctrl-C or failure).

Options: ``--cpu 1,0.5,0.25`` (one share per host), ``--rate 2=50mbit``
(repeatable), ``--memory-limit 1.5GiB`` (cgroup limit per host),
``--max-memory 500MiB`` (what each node offers the planner), ``--hold``
(keep the mesh up until Ctrl-C and print the commands to reach it),
``--json``. Node logs stay in ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
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
    why_no_testbed,
)

PROMPT = "The three laws of robotics are"


def parse_size(text: str) -> int:
    from hetmesh.cli.node import parse_size as parse

    return parse(text)


def host_specs(args: argparse.Namespace) -> list[HostSpec]:
    shares = [float(x) for x in args.cpu.split(",")]
    rates = dict(r.split("=", 1) for r in args.rate)
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    return [
        HostSpec(
            cpu=share if share > 0 else None,
            memory_limit_bytes=limit,
            rate=rates.get(str(i)),
            max_memory=args.max_memory,
        )
        for i, share in enumerate(shares)
    ]


def describe(bed: MeshTestbed, view: dict[str, Any]) -> dict[str, Any]:
    """Hosts, measured speeds and the adopted plan, as a plain dict."""
    hosts = bed.peer_host()
    devices = devices_of(view)
    plan = plan_of(view)
    out: dict[str, Any] = {"hosts": []}
    for node in bed.nodes:
        spec = bed.specs[node.host]
        dev = devices.get(node.peer_id, {})
        out["hosts"].append(
            {
                "host": node.host,
                "ip": bed.net.hosts[node.host].ip,
                "peer_id": node.peer_id,
                "cpu_share": spec.cpu,
                "link_rate": spec.rate or "unlimited",
                "gflops": round(float(dev.get("matmul_flops", 0.0)) / 1e9, 2),
                "memory_total_mib": int(dev.get("memory_total_bytes", 0)) >> 20,
            }
        )
    if plan is not None:
        out["plan"] = {
            "strategy": plan.strategy,
            "epoch": plan.epoch,
            "predicted_ms_per_token": round(plan.decode_latency_s * 1e3, 1),
            "stages": [
                {
                    "host": hosts.get(s.peer_id),
                    "units": [s.start, s.end],
                    "weights": s.weights,
                    "predicted_step_ms": round(s.decode_step_s * 1e3, 2),
                }
                for s in plan.pipelines[0].stages
            ],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", default="1,0.5,0.25")
    parser.add_argument("--rate", action="append", default=["2=50mbit"])
    parser.add_argument("--memory-limit", default="")
    parser.add_argument("--max-memory", default="500MiB")
    parser.add_argument("--max-sessions", type=int, default=4)
    parser.add_argument("--plan-strategy", default="hetmesh")
    parser.add_argument("--weights", default="float32", help="every node's weight format")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    why = why_no_testbed()
    if why:
        print(f"cannot build the testbed here: {why}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hetmesh-testbed-"))
    workdir.mkdir(parents=True, exist_ok=True)
    specs = host_specs(args)
    began = time.monotonic()
    with open_mesh_testbed(workdir, specs) as bed:
        bed.start_all(
            "--max-sessions",
            str(args.max_sessions),
            "--plan-strategy",
            args.plan_strategy,
            "--weights",
            args.weights,
        )
        view = bed.wait_serving()
        up_s = time.monotonic() - began
        from hetmesh.partition.store import resolve_model
        from hetmesh.partition.text import encode_prompt, load_tokenizer

        tokenizer = load_tokenizer(resolve_model())
        ids = encode_prompt(tokenizer, PROMPT)
        (gen,) = bed.generate(ids, args.tokens)
        out = describe(bed, view)
        out["mesh_up_s"] = round(up_s, 1)
        out["workdir"] = str(workdir)
        if "tokens" in gen:
            times = gen["times_s"]
            out["text"] = tokenizer.decode(gen["tokens"])
            out["ttft_s"] = round(times[0], 3)
            if len(times) > 1:
                out["decode_ms_per_token"] = round(
                    1e3 * (times[-1] - times[0]) / (len(times) - 1), 1
                )
        else:
            out["error"] = f"{gen.get('error')}: {gen.get('message')}"
        if args.json:
            print(json.dumps(out))
        else:
            print(json.dumps(out, indent=1))
        if args.hold:
            n0 = bed.nodes[0]
            print(
                f"\nmesh up; from host 0:  nsenter --net=/run/netns/{bed.net.hosts[0].namespace}"
                f" {sys.executable} -m hetmesh status --mesh {n0.addr}"
                f" --mesh-secret {bed.secret}\nCtrl-C tears it down."
            )
            try:
                while all(n.proc.poll() is None for n in bed.nodes):
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
