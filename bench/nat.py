"""Serving across NAT vs the same hosts on one flat segment (root, Linux, nftables).

``python bench/nat.py [--json]`` runs two meshes of real ``hetmesh node start``
processes, one after the other, each with the same three hosts and flags: a
``--no-serve`` node on host 0 and a serving node on hosts 1 and 2, each with a
100 Mbit/s link and too little ``--max-memory`` for the whole default model
(so the plan splits it across hosts 1 and 2):

- **nat**: host 0 public, hosts 1 and 2 each behind its own masquerading
  router (hetmesh/testbed/nat.py): they meet and serve through host 0's relay;
- **flat**: the three hosts on one bridge (hetmesh/testbed/netns.py), no NAT.

Reported (the flat mesh is the baseline, measured in the same run):

- ``nat_decode_ratio``: greedy decode tokens/s entering at host 1, NAT mesh ÷
  flat mesh (median of ``--runs`` generations each; target ≥ 0.9);
- ``relayed_link_utilisation``: the bandwidth the homes' link probe measured
  over the relayed libp2p connection (the path the data plane rides) ÷ the
  uplink's 12.5 MB/s (report);
- ``join_to_planned_s``: from starting the second home node to a ready plan
  over both homes (report);
- ``punched_link_utilisation``: bytes/s between the two homes over a TCP
  connection hole-punched through both routers (hetmesh.transport.punch, the
  path a punched data-plane link takes; raw bytes, median of ``--punch-runs``
  transfers of ``--punch-mib`` MiB) ÷ the uplink's 12.5 MB/s (target ≥ 0.8).
  ``--punch-only`` measures just this (no model, seconds).

Load on the machine (``os.getloadavg``) is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hetmesh.testbed.mesh import HostSpec, open_mesh_testbed, why_no_testbed
from hetmesh.testbed.nat import nat_unavailable_reason, open_nat_testbed, try_punch
from hetmesh.testbed.nat_mesh import open_nat_mesh

RATE = "100mbit"
RATE_BPS = 100e6 / 8
HOME_ARGS = ("--max-memory", "600MiB", "--max-sessions", "4", "--max-context", "256")
# "The capital of France is" in the default model's tokenizer
PROMPT_IDS = (504, 3458, 282, 4649, 314)


def decode_tps(gen: dict[str, Any]) -> float:
    """Tokens/s after the first token (the decode steps only)."""
    times = gen["times_s"]
    if len(times) < 2 or times[-1] <= times[0]:
        raise RuntimeError(f"too few tokens to time decoding: {gen}")
    return (len(times) - 1) / (times[-1] - times[0])


def run_nat(workdir: Path, tokens: int, runs: int) -> dict[str, Any]:
    with open_nat_mesh(workdir, homes=2, rate=RATE) as mesh:
        public, home0, home1 = mesh.bed.hosts
        first = mesh.start_node(public, "--no-serve").wait_up(300)
        node0 = mesh.start_node(home0, *HOME_ARGS, bootstrap=first.addr).wait_up(300)
        joined_at = time.monotonic()
        node1 = mesh.start_node(home1, *HOME_ARGS, bootstrap=first.addr).wait_up(300)
        plan, _ = mesh.wait_serving(home0, node0, timeout_s=400)
        join_s = time.monotonic() - joined_at
        if {s.peer_id for s in plan.pipelines[0].stages} != {node0.peer_id, node1.peer_id}:
            raise RuntimeError(f"the plan does not span both homes: {plan}")
        gens = [mesh.generate(home0, node0, PROMPT_IDS, tokens) for _ in range(runs)]
        errors = [g for g in gens if "error" in g]
        if errors:
            raise RuntimeError(f"NAT mesh generation failed: {errors[0]}")
        pair = {(node0.peer_id, node1.peer_id), (node1.peer_id, node0.peer_id)}
        deadline = time.monotonic() + 180
        links: list[dict[str, Any]] = []
        while not links and time.monotonic() < deadline:
            view = mesh.status(home0, node0)
            links = [lk for lk in view.get("links", []) if (lk["src"], lk["dst"]) in pair]
            if not links:
                time.sleep(3)
        relayed_bps = max((float(lk["bandwidth_bps"]) for lk in links), default=None)
        return {
            "decode_tps": statistics.median(decode_tps(g) for g in gens),
            "tokens": gens[0]["tokens"],
            "join_to_planned_s": join_s,
            "relayed_link_bps": relayed_bps,
            "relayed_link_rtt_s": min((float(lk["rtt_s"]) for lk in links), default=None),
        }


def run_punch(mib: int, runs: int) -> dict[str, Any]:
    """Throughput from home 0 to home 1 over connections punched through both routers."""
    nbytes = mib << 20
    rates: list[float] = []
    with open_nat_testbed(2, rate=RATE) as bed:
        home0, home1 = bed.homes
        for i in range(runs):
            sent, got = try_punch(bed, home0, home1, port=41000 + i, nbytes=nbytes)
            if not (sent.get("ok") and got.get("received") == nbytes):
                raise RuntimeError(f"hole punching between the homes failed: {sent} {got}")
            rates.append(nbytes / float(sent["seconds"]))
    return {"punched_link_bps": statistics.median(rates), "punched_link_runs_bps": rates}


def run_flat(workdir: Path, tokens: int, runs: int) -> dict[str, Any]:
    specs = [
        HostSpec(rate=RATE, args=("--no-serve",)),
        HostSpec(rate=RATE, args=HOME_ARGS),
        HostSpec(rate=RATE, args=HOME_ARGS),
    ]
    with open_mesh_testbed(workdir, specs) as bed:
        bed.start_all(timeout_s=300)
        bed.wait_serving(timeout_s=400)
        gens = [bed.generate(PROMPT_IDS, tokens, node=1)[0] for _ in range(runs)]
        errors = [g for g in gens if "error" in g]
        if errors:
            raise RuntimeError(f"flat mesh generation failed: {errors[0]}")
        return {
            "decode_tps": statistics.median(decode_tps(g) for g in gens),
            "tokens": gens[0]["tokens"],
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--punch-mib", type=int, default=32)
    parser.add_argument("--punch-runs", type=int, default=3)
    parser.add_argument("--punch-only", action="store_true", help="only the punched link")
    args = parser.parse_args()
    reason = nat_unavailable_reason(need_tc=True) or why_no_testbed()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hetmesh-nat-"))
    (workdir / "nat").mkdir(parents=True, exist_ok=True)
    (workdir / "flat").mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    punch = run_punch(args.punch_mib, args.punch_runs)
    if args.punch_only:
        out = {
            "punched_link_utilisation": punch["punched_link_bps"] / RATE_BPS,
            **punch,
            "punch_mib": args.punch_mib,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        }
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return 0
    nat = run_nat(workdir / "nat", args.tokens, args.runs)
    flat = run_flat(workdir / "flat", args.tokens, args.runs)
    relayed = nat["relayed_link_bps"]
    out = {
        "nat_decode_ratio": nat["decode_tps"] / flat["decode_tps"],
        "relayed_link_utilisation": None if relayed is None else relayed / RATE_BPS,
        "punched_link_utilisation": punch["punched_link_bps"] / RATE_BPS,
        "punched_link_bps": punch["punched_link_bps"],
        "join_to_planned_s": nat["join_to_planned_s"],
        "nat_decode_tps": nat["decode_tps"],
        "flat_decode_tps": flat["decode_tps"],
        "relayed_link_bps": relayed,
        "relayed_link_rtt_s": nat["relayed_link_rtt_s"],
        "same_tokens": nat["tokens"] == flat["tokens"],
        "tokens": args.tokens,
        "runs": args.runs,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "workdir": str(workdir),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
