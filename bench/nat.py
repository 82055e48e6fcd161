"""Serving across NAT vs the same hosts on one flat segment (root, Linux, nftables).

``python bench/nat.py [--json]`` runs two meshes of real ``hetmesh node start``
processes, both up at once, each with the same three hosts and flags: a
``--no-serve`` node on host 0 and a serving node on hosts 1 and 2, each with a
100 Mbit/s link and a ``--max-memory`` for only half of the default model as
shipped (bench/cut.py: computed from its bytes in that format), so the plan
must cut it across hosts 1 and 2; both meshes fail unless their plan spans
both homes, and print it:

- **nat**: host 0 public, hosts 1 and 2 each behind its own masquerading
  router (hetmesh/testbed/nat.py): they meet through host 0's relay and
  hole-punch their links;
- **flat**: the three hosts on one bridge (hetmesh/testbed/netns.py), no NAT.

Reported (the flat mesh is the baseline, measured in the same run):

- ``nat_decode_ratio``: greedy decode tokens/s entering at host 1, NAT mesh ÷
  flat mesh: generations alternate between the two meshes (one untimed
  warm-up each), ratio of the medians of ``--runs`` (target ≥ 0.9);
- ``homes_link_utilisation``: the bandwidth of the homes' link as their link
  probe published it (the path the data plane takes: hole-punched where the
  routers allow, else relayed) ÷ the uplink's 12.5 MB/s (report);
- ``relayed_link_utilisation``: the same link when home 1's router is symmetric
  (a third mesh, after the other two: no punch, so the homes' link rides the
  relay through host 0) ÷ 12.5 MB/s (report), with that mesh's decode rate and
  whether its tokens equal the others' (``--no-relayed`` skips it);
- ``join_to_planned_s``: from starting the second home node to a ready plan
  over both homes (report);
- ``punched_link_utilisation``: tensors from home 0 to home 1 over a sealed
  data-plane link hole-punched through both routers, negotiated by two
  data planes as over a relayed connection (hetmesh/testbed/nat_link.py:
  4 MiB activations, ``--punch-mib`` MiB per transfer timed to the receiver's
  acknowledgement, median of ``--punch-runs``) ÷ the uplink's 12.5 MB/s
  (target ≥ 0.8); ``punched_raw_utilisation``: the same with raw bytes over a
  bare punched socket (the ceiling). ``--punch-only`` measures just these
  (no model, seconds).

Load on the machine (``os.getloadavg``) is printed with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hetmesh.testbed.mesh import REPO, HostSpec, child_env, open_mesh_testbed, why_no_testbed
from hetmesh.testbed.nat import nat_unavailable_reason, open_nat_testbed, try_punch
from hetmesh.testbed.nat_mesh import open_nat_mesh

RATE = "100mbit"
RATE_BPS = 100e6 / 8
HOME_SETTINGS = ("--max-sessions", "4", "--max-context", "256")


def home_args() -> tuple[str, ...]:
    """A home node's flags: memory for half of the model, so the two homes must cut it."""
    import cut  # bench/cut.py, beside this file

    from hetmesh.partition.store import resolve_model

    return tuple(cut.node_args_for(resolve_model(), 2, HOME_SETTINGS))


def require_both_homes(plan: Any, homes: set[str], names: dict[str, str]) -> None:
    """Fail unless the plan's pipeline is a cut over both homes; print it."""
    import cut

    cut.require_plan(
        plan,
        "a cut over both homes",
        lambda p: {s.peer_id for s in p.pipelines[0].stages} == homes,
        names,
    )
    print(f"plan: {cut.describe(plan, names)}", file=sys.stderr, flush=True)


# "The capital of France is" in the default model's tokenizer
PROMPT_IDS = (504, 3458, 282, 4649, 314)


def decode_tps(gen: dict[str, Any]) -> float:
    """Tokens/s after the first token (the decode steps only)."""
    times = gen["times_s"]
    if len(times) < 2 or times[-1] <= times[0]:
        raise RuntimeError(f"too few tokens to time decoding: {gen}")
    return (len(times) - 1) / (times[-1] - times[0])


@contextlib.contextmanager
def nat_mesh(
    workdir: Path, symmetric: tuple[int, ...] = ()
) -> Iterator[tuple[Callable[[int], dict[str, Any]], dict[str, Any]]]:
    """The NAT mesh serving over both homes: (generate(tokens), figures measured on the way).
    ``symmetric``: the homes whose router maps every destination to a new port (no punch)."""
    with open_nat_mesh(workdir, homes=2, symmetric=symmetric, rate=RATE) as mesh:
        public, home0, home1 = mesh.bed.hosts
        first = mesh.start_node(public, "--no-serve").wait_up(300)
        args = home_args()
        node0 = mesh.start_node(home0, *args, bootstrap=first.addr).wait_up(300)
        joined_at = time.monotonic()
        node1 = mesh.start_node(home1, *args, bootstrap=first.addr).wait_up(300)
        plan, _ = mesh.wait_serving(home0, node0, timeout_s=400)
        join_s = time.monotonic() - joined_at
        homes = {node0.peer_id, node1.peer_id}
        require_both_homes(plan, homes, {node0.peer_id: "home0", node1.peer_id: "home1"})

        def generate(tokens: int) -> dict[str, Any]:
            return mesh.generate(home0, node0, PROMPT_IDS, tokens)

        figures: dict[str, Any] = {"join_to_planned_s": join_s}

        def links() -> list[dict[str, Any]]:
            pair = {(node0.peer_id, node1.peer_id), (node1.peer_id, node0.peer_id)}
            view = mesh.status(home0, node0)
            return [lk for lk in view.get("links", []) if (lk["src"], lk["dst"]) in pair]

        figures["links"] = links
        yield generate, figures


@contextlib.contextmanager
def flat_mesh(workdir: Path) -> Iterator[Callable[[int], dict[str, Any]]]:
    """The same three hosts on one bridge, serving: generate(tokens) entering at host 1."""
    from hetmesh.testbed.mesh import plan_of

    args = home_args()
    specs = [
        HostSpec(rate=RATE, args=("--no-serve",)),
        HostSpec(rate=RATE, args=args),
        HostSpec(rate=RATE, args=args),
    ]
    with open_mesh_testbed(workdir, specs) as bed:
        bed.start_all(timeout_s=300)
        view = bed.wait_serving(timeout_s=400)
        hosts = bed.peer_host()
        names = {p: f"home{h - 1}" for p, h in hosts.items() if h > 0}
        require_both_homes(plan_of(view), set(names), names)

        def generate(tokens: int) -> dict[str, Any]:
            return bed.generate(PROMPT_IDS, tokens, node=1)[0]

        yield generate


def run_meshes(workdir: Path, tokens: int, runs: int) -> dict[str, Any]:
    """Both meshes up at once, generations alternated (nat, flat, nat, ...): a change in
    the machine's load hits both sides alike; the ratio is of the medians."""
    with nat_mesh(workdir / "nat") as (nat_gen, figures), flat_mesh(workdir / "flat") as flat_gen:
        for gen in (nat_gen, flat_gen):  # one untimed warm-up each (first-use costs)
            gen(2)
        nat_gens, flat_gens = [], []
        for _ in range(runs):
            nat_gens.append(nat_gen(tokens))
            flat_gens.append(flat_gen(tokens))
        errors = [g for g in nat_gens + flat_gens if "error" in g]
        if errors:
            raise RuntimeError(f"a generation failed: {errors[0]}")
        links = homes_links(figures)
        nat_tps = [decode_tps(g) for g in nat_gens]
        flat_tps = [decode_tps(g) for g in flat_gens]
        return {
            "nat_decode_tps": statistics.median(nat_tps),
            "flat_decode_tps": statistics.median(flat_tps),
            "nat_decode_runs_tps": nat_tps,
            "flat_decode_runs_tps": flat_tps,
            "same_tokens": all(g["tokens"] == nat_gens[0]["tokens"] for g in nat_gens + flat_gens),
            "tokens_generated": nat_gens[0]["tokens"],
            "join_to_planned_s": figures["join_to_planned_s"],
            "link_bps": max((float(lk["bandwidth_bps"]) for lk in links), default=None),
            "link_rtt_s": min((float(lk["rtt_s"]) for lk in links), default=None),
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
    return {"punched_raw_bps": statistics.median(rates), "punched_raw_runs_bps": rates}


def _link_run(bed: Any, port: int, mib: int, rounds: int) -> dict[str, Any]:
    """One data-plane link negotiated between the homes (hetmesh.testbed.nat_link), timed."""
    public, (home0, home1) = bed.public, bed.homes
    module = [sys.executable, "-m", "hetmesh.testbed.nat_link"]
    splice = bed.popen(
        public,
        [*module, "splice", public.ip, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    assert splice.stdout is not None
    if splice.stdout.readline().strip() != "ready":
        raise RuntimeError("the control splice did not start")
    homes = [
        bed.popen(
            host,
            [*module, role, public.ip, str(port), host.ip, host.public_ip, str(mib), str(rounds)],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        for host, role in ((home1, "accept"), (home0, "dial"))
    ]
    outs = [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in homes]
    splice.wait(timeout=30)
    got, sent = outs
    punched = "hole-punched" in sent["reason"]
    if not (punched and sent["backend"] == "tcp" and sent["encrypted"] and sent.get("acked")):
        raise RuntimeError(f"no sealed hole-punched data-plane link: {sent} {got}")
    if got.get("received") != sent["bytes"]:
        raise RuntimeError(f"the link lost bytes: {sent} {got}")
    return sent


def homes_links(figures: dict[str, Any], deadline_s: float = 180) -> list[dict[str, Any]]:
    """The homes' links as their probes published them, once there are any."""
    deadline = time.monotonic() + deadline_s
    links: list[dict[str, Any]] = figures["links"]()
    while not links and time.monotonic() < deadline:
        time.sleep(3)
        links = figures["links"]()
    return links


def run_relayed(workdir: Path, tokens: int) -> dict[str, Any]:
    """The NAT mesh with home 1 behind a symmetric router: no punch, so the homes' link
    rides the relay; its probed bandwidth and one generation's decode rate."""
    with nat_mesh(workdir, symmetric=(1,)) as (gen, figures):
        gen(2)
        out = gen(tokens)
        if "error" in out:
            raise RuntimeError(f"a generation over the relay failed: {out}")
        links = homes_links(figures)
    return {
        "relayed_link_bps": max((float(lk["bandwidth_bps"]) for lk in links), default=None),
        "relayed_link_rtt_s": min((float(lk["rtt_s"]) for lk in links), default=None),
        "relayed_links": links,
        "relayed_decode_tps": decode_tps(out),
        "relayed_tokens": out["tokens"],
    }


def run_punched_link(mib: int, rounds: int, runs: int) -> dict[str, Any]:
    """Tensors from home 0 to home 1 over a sealed data-plane link hole-punched through
    both routers, negotiated as over a relayed connection; median of ``runs``."""
    rates: list[float] = []
    with open_nat_testbed(2, rate=RATE) as bed:
        for i in range(runs):
            sent = _link_run(bed, 42000 + i, mib, rounds)
            rates.append(float(sent["bytes"]) / float(sent["seconds"]))
    return {
        "punched_link_bps": statistics.median(rates),
        "punched_link_runs_bps": rates,
        "punched_link_reason": sent["reason"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--punch-mib", type=int, default=32, help="MiB per punched transfer")
    parser.add_argument("--punch-runs", type=int, default=3)
    parser.add_argument("--punch-only", action="store_true", help="only the punched link")
    parser.add_argument("--no-relayed", action="store_true", help="skip the relayed mesh")
    args = parser.parse_args()
    reason = nat_unavailable_reason(need_tc=True) or why_no_testbed()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hetmesh-nat-"))
    (workdir / "nat").mkdir(parents=True, exist_ok=True)
    (workdir / "flat").mkdir(parents=True, exist_ok=True)
    (workdir / "relayed").mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rounds = max(1, args.punch_mib // 4)  # 4 MiB activations
    link = run_punched_link(4, rounds, args.punch_runs)
    raw = run_punch(args.punch_mib, args.punch_runs)
    out: dict[str, Any] = {
        "punched_link_utilisation": link["punched_link_bps"] / RATE_BPS,
        "punched_raw_utilisation": raw["punched_raw_bps"] / RATE_BPS,
        **link,
        **raw,
        "punch_mib": rounds * 4,
    }
    if not args.punch_only:
        meshes = run_meshes(workdir, args.tokens, args.runs)
        meshes_tokens = meshes.pop("tokens_generated")
        homes_bps = meshes.pop("link_bps")
        out = {
            "nat_decode_ratio": meshes["nat_decode_tps"] / meshes["flat_decode_tps"],
            "homes_link_utilisation": None if homes_bps is None else homes_bps / RATE_BPS,
            **out,
            **meshes,
            "homes_link_bps": homes_bps,
            "tokens": args.tokens,
            "runs": args.runs,
            "workdir": str(workdir),
        }
        if not args.no_relayed:
            relayed = run_relayed(workdir / "relayed", args.tokens)
            bps = relayed["relayed_link_bps"]
            out["relayed_link_utilisation"] = None if bps is None else bps / RATE_BPS
            out["relayed_same_tokens"] = relayed["relayed_tokens"] == meshes_tokens
            out.update(relayed)
    out["loadavg_before"] = load_before
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
