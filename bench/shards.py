"""Weights over the mesh: what a node with no model fetches, how fast, and when it serves.

    python bench/shards.py            # table
    python bench/shards.py --json     # one JSON object

Loopback, in one process: three daemons with the default model in float32
(each offered ``--memory-mib``, so the plan needs all three); the first holds
the converted model, the other two start with ``--model mesh`` and empty caches
and fetch their stages' tensors from it (and from each other) over
``/hetmesh/shards/1.0.0``. Reported per joining node:

* ``fetched_ratio``: bytes fetched ÷ the stored bytes of the tensors its stages
  load (config and tokenizer files are fetched besides, listed apart);
* ``fetch_rate_bps``: bytes fetched ÷ the time its fetch took;
* ``start_to_serving_s``: from ``run_node`` to its stage serving, against the
  holder's own (which had the model on disk);

and whether a greedy generation through the mesh equals the single-process
reference. Not here yet (issue 15, item 5): the same on the testbed's
namespaces with a 50 Mbit/s shaped link (``shaped_link_utilisation``); the
testbed still forces the libp2p data plane.
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
    out: dict[str, Any] = {"manifest": manifest.id, "side_file_bytes": side_bytes, "nodes": []}
    async with trio.open_nursery() as nursery:
        nodes: list[Any] = []
        started: list[float] = []
        for i in range(3):
            serving = ServingConfig(
                model=None if i == 0 else "mesh",
                cache_dir=None if i == 0 else tmp / f"cache{i}",
                max_sessions=2,
                max_context_tokens=256,
                block_step_s=0.002,
            )
            config = NodeConfig(
                listen=("/ip4/127.0.0.1/tcp/0",),
                bootstrap=(str(nodes[0].discovery.addrs[0]),) if nodes else (),
                mesh_secret=SECRET,
                mdns=False,
                data_dir=tmp / f"n{i}",
                max_memory_bytes=args.memory_mib << 20,
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
                    if i not in serving_at and s is not None and s._served:
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
            stages = sorted(node.serving._served)
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
        for node in nodes:
            node.request_stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--memory-mib", type=int, default=360)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(_run, args, Path(tmp))
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return
    print(
        f"manifest {result['manifest'][:16]}…  equal to reference: {result['equal_to_reference']}"
    )
    for row in result["nodes"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
