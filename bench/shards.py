"""Weights over the mesh: what a node with no model fetches, how fast, and when it serves.

    python bench/shards.py                    # table (loopback, in one process)
    python bench/shards.py --json             # one JSON object
    python bench/shards.py --json --testbed   # on the testbed's namespaces (root)

Loopback, in one process: three daemons with the default model as shipped
(int4; each offered ``--memory-mib``, by default the memory for a third of the
model, bench/cut.py, so the plan needs all three); the first holds
the converted model, the other two start with ``--model mesh`` and empty caches
and fetch their stages' tensors from it (and from each other) over data-plane
links (shm: one host). ``--testbed``: the same with three ``hetmesh node
start`` processes on emulated hosts (hetmesh/testbed), the third behind a
50 Mbit/s ``tc tbf`` link; tensors travel over direct TCP between namespaces.
Reported per joining node:

* ``fetched_ratio``: bytes fetched ÷ the stored bytes of the tensors its stages
  load (config and tokenizer files are fetched besides, listed apart);
* ``fetch_rate_bps``: bytes fetched ÷ the time its fetch took;
* ``start_to_serving_s``: from starting the node to its stage serving, against
  the holder's own (which had the model on disk);

and whether a greedy generation through the mesh equals the single-process
reference. The run fails unless each joiner was planned only part of the model
(``plan``: each node's stages): a joiner planned the whole model would fetch a
whole replica, not its stage. On the testbed also ``shaped_link_utilisation``: the shaped host's
fetch rate ÷ the bandwidth the mesh measured on its links.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

PROMPT_IDS = [1, 504, 3458, 282, 1029, 314, 253]
SECRET = "bench-shards"
SESSIONS, CONTEXT = 2, 256  # every node's --max-sessions and --max-context


def memory_mib(args: argparse.Namespace, model_dir: Path) -> int:
    """Each node's memory: ``--memory-mib``, else what makes the model need 3 nodes."""
    import cut  # bench/cut.py, beside this file

    if args.memory_mib:
        return int(args.memory_mib)
    cap = cut.memory_cap(model_dir, "native", 3, max_context=CONTEXT, max_sessions=SESSIONS)
    return -(-cap // (1 << 20))


def check_joiners(stages: dict[int, list[tuple[int, int]]], units: int) -> None:
    """Fail unless every joiner (nodes 1 and 2) was planned a part of the model only."""
    import cut

    for node in (1, 2):
        held = sum(b - a for a, b in stages.get(node, []))
        if not 0 < held < units:
            raise cut.PlanShapeError(
                f"joiner node{node} was planned {stages.get(node)} of {units} units: "
                "it would fetch all of the model or none, not its stage"
            )


async def _run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.node.config import ServingConfig
    from hetmesh.node.daemon import NodeConfig, run_node
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.shards.manifest import load_or_build, tensors_for_units

    model_dir = resolve_model()
    manifest = load_or_build(model_dir)
    reference = list(
        LocalPipeline.load(model_dir, 1).generate_ids(
            PROMPT_IDS, SamplingParams(max_new_tokens=args.tokens)
        )
    )
    side_bytes = sum(f.nbytes for f in manifest.files)
    memory = memory_mib(args, model_dir)
    out: dict[str, Any] = {"manifest": manifest.id, "side_file_bytes": side_bytes, "nodes": []}
    out["node_memory_mib"] = memory
    async with trio.open_nursery() as nursery:
        nodes: list[Any] = []
        started: list[float] = []
        for i in range(3):
            serving = ServingConfig(
                model=None if i == 0 else "mesh",
                cache_dir=None if i == 0 else tmp / f"cache{i}",
                max_sessions=SESSIONS,
                max_context_tokens=CONTEXT,
                block_step_s=0.002,
            )
            config = NodeConfig(
                listen=("/ip4/127.0.0.1/tcp/0",),
                bootstrap=(str(nodes[0].discovery.addrs[0]),) if nodes else (),
                mesh_secret=SECRET,
                mdns=False,
                data_dir=tmp / f"n{i}",
                max_memory_bytes=memory << 20,
                benchmark_budget_s=0.2,
                serving=serving,
            )
            started.append(time.monotonic())
            nodes.append(await nursery.start(run_node, config))
        serving_at: dict[int, float] = {}
        with trio.fail_after(args.timeout_s):
            while len(serving_at) < 3:
                for i, node in enumerate(nodes):
                    s = node.serving
                    if i not in serving_at and s is not None and s.stages.servers():
                        serving_at[i] = time.monotonic() - started[i]
                await trio.sleep(0.2)
            got: list[int] = []
            while not got:
                try:
                    async with open_mesh_client(
                        str(nodes[0].discovery.addrs[0]), mesh_secret=SECRET
                    ) as client:
                        request = {"prompt_ids": PROMPT_IDS, "max_new_tokens": args.tokens}
                        async for event in client.stream(**request):
                            if isinstance(event, TokenEvent) and event.token_id >= 0:
                                got.append(event.token_id)
                except Exception as exc:  # not ready everywhere yet: try again
                    logging.getLogger(__name__).info("generate: %s", exc)
                    got = []
                    await trio.sleep(1.0)
        out["equal_to_reference"] = got == reference
        for i, node in enumerate(nodes):
            shards = node.serving.shards
            stages = sorted(node.serving.stages.servers())
            needed = {
                t.name: t.nbytes for a, b in stages for t in tensors_for_units(manifest, a, b)
            }
            stats = shards.statistics() if shards is not None else None
            row: dict[str, Any] = {
                "role": "holder" if i == 0 else "joiner",
                "stages": [list(s) for s in stages],
                "start_to_serving_s": round(serving_at[i], 2),
            }
            if i > 0 and stats is not None:
                row["bytes_fetched"] = stats.bytes_fetched
                row["stage_tensor_bytes"] = sum(needed.values())
                row["fetched_ratio"] = round(stats.bytes_fetched / max(1, sum(needed.values())), 4)
                row["fetch_rate_bps"] = round(stats.fetch_rate_bps)
                row["from_peers"] = {p[-6:]: n for p, n in shards.bytes_by_peer.items()}
            elif stats is not None:
                row["bytes_served"] = stats.bytes_served
            out["nodes"].append(row)
        out["plan"] = {f"node{i}": row["stages"] for i, row in enumerate(out["nodes"])}
        for node in nodes:
            node.request_stop()
        check_joiners(
            {i: [tuple(x) for x in row["stages"]] for i, row in enumerate(out["nodes"])},
            nodes[0].serving.profile.num_units,
        )
    return out


def _testbed(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.shards.manifest import load_or_build, tensors_for_units
    from hetmesh.testbed.mesh import HostSpec, open_mesh_testbed, plan_of, wait_for

    model_dir = resolve_model()
    manifest = load_or_build(model_dir)
    reference = list(
        LocalPipeline.load(model_dir, 1).generate_ids(
            PROMPT_IDS, SamplingParams(max_new_tokens=args.tokens)
        )
    )
    memory = f"{memory_mib(args, model_dir)}MiB"
    caches = {h: tmp / f"cache{h}" for h in (1, 2)}
    specs = [
        HostSpec(max_memory=memory),
        HostSpec(max_memory=memory, args=("--model", "mesh", "--cache-dir", str(caches[1]))),
        HostSpec(
            max_memory=memory,
            rate=args.rate,
            args=("--model", "mesh", "--cache-dir", str(caches[2])),
        ),
    ]
    node_args = (
        *("--max-sessions", str(SESSIONS), "--max-context", str(CONTEXT)),
        *("--block-step-ms", "2"),
    )
    out: dict[str, Any] = {
        "manifest": manifest.id,
        "side_file_bytes": sum(f.nbytes for f in manifest.files),
        "shaped_rate": args.rate,
        "nodes": [],
    }
    (tmp / "bed").mkdir()
    with open_mesh_testbed(tmp / "bed", specs) as bed:
        started = {0: time.monotonic()}
        first = bed.start_node(0, *node_args).wait_up(args.timeout_s)
        for h in (1, 2):
            started[h] = time.monotonic()
            bed.start_node(h, *node_args, bootstrap=first.addr)
        serving_at: dict[int, float] = {}

        def all_serving() -> bool:
            try:
                view = bed.status()
            except (RuntimeError, ValueError, OSError):
                return False
            now = time.monotonic()
            for node in bed.nodes:  # a joiner's node.json may come only once it serves
                if not node.info and (node.data_dir / "node.json").exists():
                    node.wait_up(10)
            hosts = {n.peer_id: n.host for n in bed.nodes if n.info}
            for peer in view["peers"]:
                h = hosts.get(peer["peer_id"])
                stages = (peer.get("record") or {}).get("stages") or ()
                if h is not None and h not in serving_at and any(s.get("ready") for s in stages):
                    serving_at[h] = now - started[h]
            return len(serving_at) == 3

        wait_for(all_serving, args.timeout_s, "all three hosts to serve", every_s=0.5)
        for node in bed.nodes:
            node.wait_up(args.timeout_s)
        view = bed.wait_serving(args.timeout_s)
        (got,) = bed.generate(PROMPT_IDS, args.tokens)
        out["equal_to_reference"] = got.get("tokens") == reference
        plan = plan_of(view)
        assert plan is not None
        hosts = bed.peer_host()
        peer_of = {h: p for p, h in hosts.items()}
        stages = {
            h: [(s.start, s.end) for s in plan.pipelines[0].stages if hosts[s.peer_id] == h]
            for h in (0, 1, 2)
        }
        out["plan"] = {f"node{h}": [list(x) for x in stages[h]] for h in (0, 1, 2)}
        check_joiners(stages, plan.pipelines[0].stages[-1].end)
        needed = {
            h: sum(t.nbytes for a, b in stages[h] for t in tensors_for_units(manifest, a, b))
            for h in (1, 2)
        }

        def counters() -> dict[int, dict[str, Any]] | None:
            found = {}
            for peer in bed.status()["peers"]:
                h = hosts.get(peer["peer_id"])
                shards = ((peer.get("record") or {}).get("extra") or {}).get("shards") or {}
                if h is not None:
                    found[h] = shards
            done = all(found.get(h, {}).get("bytes_fetched", 0) >= needed[h] for h in (1, 2))
            return found if done and len(found) == 3 else None

        shards = wait_for(counters, 60, "the joiners' shard counters", every_s=1.0)
        shaped = float(shards[2]["fetch_rate_bps"])

        def shaped_links() -> list[float] | None:
            found = [
                float(lk["bandwidth_bps"])
                for lk in bed.status()["links"]
                if peer_of[2] in (lk["src"], lk["dst"])
            ]
            return found if len(found) >= 2 else None

        measured = wait_for(shaped_links, 150, "the shaped host's links measured", every_s=2.0)
        bandwidth = sorted(measured)[len(measured) // 2]  # the median of its probes
        out["shaped_link_measured_bps"] = round(bandwidth)
        out["shaped_link_fetch_rate_bps"] = round(shaped)
        out["shaped_link_utilisation"] = round(shaped / bandwidth, 3)
        for h in (0, 1, 2):
            row: dict[str, Any] = {
                "role": "holder" if h == 0 else "joiner",
                "host": h,
                "stages": [list(s) for s in stages[h]],
                "start_to_serving_s": round(serving_at[h], 2),
            }
            if h > 0:
                fetched = int(shards[h]["bytes_fetched"])
                row["bytes_fetched"] = fetched
                row["bytes_direct"] = int(shards[h].get("bytes_direct", 0))
                row["stage_tensor_bytes"] = needed[h]
                row["fetched_ratio"] = round(fetched / max(1, needed[h]), 4)
                row["fetch_rate_bps"] = round(float(shards[h]["fetch_rate_bps"]))
                row["shaped"] = specs[h].rate is not None
            else:
                row["bytes_served"] = int(shards[0].get("bytes_served", 0))
            out["nodes"].append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument(
        "--memory-mib", type=int, default=0, help="each node's memory (0: a third of the model's)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--testbed", action="store_true", help="emulated hosts (root)")
    parser.add_argument("--rate", default="50mbit", help="--testbed: the shaped host's link")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        result = _testbed(args, Path(tmp)) if args.testbed else trio.run(_run, args, Path(tmp))
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return
    print(
        f"manifest {result['manifest'][:16]}…  equal to reference: {result['equal_to_reference']}"
    )
    print(f"plan {result['plan']}")
    for row in result["nodes"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
