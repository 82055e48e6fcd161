"""Ad-hoc: TTFT of a 512-token prompt on a 3-stage int4 cut (bench/pipeline.py's nodes),
4 chunks of 128 (arm A, the default) against 8 of 64 (arm B:
HETMESH_PREFILL_CHUNK_TOKENS=64 HETMESH_PREFILL_MAX_CHUNKS=8), arms A/B/A/B, each a
fresh mesh; the single process's TTFT alternated with the mesh's in every arm.

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-12-fast-cut-7a-ttft.py [REPEATS]
prints each arm's plan, mesh and reference TTFTs (median), their ratio, and whether the
mesh's first 16 tokens of the long prompt equal the reference's.
"""

import os
import statistics
import sys

sys.path.insert(0, "bench")
import cut  # noqa: E402
import trio  # noqa: E402
from pipeline import CHECKED_TOKENS, NODE_ARGS, Reference, _stream  # noqa: E402

from hetmesh.client.mesh import open_mesh_client  # noqa: E402
from hetmesh.partition.store import resolve_model  # noqa: E402
from hetmesh.partition.text import encode_prompt, load_tokenizer  # noqa: E402
from hetmesh.scheduler.replan import newest_in_view  # noqa: E402
from hetmesh.testbed.local_mesh import local_mesh, wait_settled  # noqa: E402

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ARMS = {"A": {}, "B": {"HETMESH_PREFILL_CHUNK_TOKENS": "64", "HETMESH_PREFILL_MAX_CHUNKS": "8"}}
model_dir = resolve_model(None)
tokenizer = load_tokenizer(model_dir)
long_ids = encode_prompt(tokenizer, "The sea is wide and the night is long. " * 80)[:512]
reference = Reference(model_dir, "native")
expected = reference.ids(long_ids, CHECKED_TOKENS)
node_args = cut.node_args_for(
    model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
)
for arm in "ABAB":
    for key in ("HETMESH_PREFILL_CHUNK_TOKENS", "HETMESH_PREFILL_MAX_CHUNKS"):
        os.environ.pop(key, None)
    os.environ.update(ARMS[arm])  # the nodes inherit it
    with local_mesh(3, node_args=node_args) as mesh:
        plan = newest_in_view(wait_settled(mesh))
        names = cut.node_names(n.peer_id for n in mesh.nodes)

        async def main() -> tuple[list[float], list[float], bool]:
            async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as c:
                await _stream(c, long_ids, 2)  # warm up
                got: list[int] = []
                await _stream(c, long_ids, CHECKED_TOKENS, got)
                ours, refs = [], []
                for _ in range(REPEATS):
                    stamps = await _stream(c, long_ids, 1)
                    ours.append(stamps[1] - stamps[0])
                    refs.append(reference.ttft(long_ids))
                return ours, refs, got == expected

        ours, refs, same = trio.run(main)
        m, r = statistics.median(ours), statistics.median(refs)
        print(
            f"arm {arm} plan {cut.describe(plan, names)}: mesh {m * 1e3:.0f} ms, reference "
            f"{r * 1e3:.0f} ms, ratio {m / r:.3f}, identical {same}, "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
