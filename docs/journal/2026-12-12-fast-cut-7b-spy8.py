"""Ad-hoc (from 2026-12-11-fast-cut-6-spy.py): a 3-stage int4 cut built as bench/pipeline.py
builds it; py-spy records every node for SECONDS while 8 greedy streams decode at once,
again and again (STREAMS=N for another count).

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-12-fast-cut-7b-spy8.py OUT SECONDS
writes OUT/<node>.txt (py-spy's collapsed stacks, --native, --idle off) and prints the plan;
with STRACE=1, OUT/<node>.strace: strace -tt of each node's main (trio) thread instead.
"""

import os
import subprocess
import sys
import time

sys.path.insert(0, "bench")
import cut  # noqa: E402
import trio  # noqa: E402
from pipeline import NODE_ARGS, PROMPT, _stream  # noqa: E402

from hetmesh.client.mesh import open_mesh_client  # noqa: E402
from hetmesh.partition.store import resolve_model  # noqa: E402
from hetmesh.partition.text import encode_prompt, load_tokenizer  # noqa: E402
from hetmesh.scheduler.replan import newest_in_view  # noqa: E402
from hetmesh.testbed.local_mesh import local_mesh, wait_settled  # noqa: E402

OUT, SECONDS = sys.argv[1], int(sys.argv[2])
os.makedirs(OUT, exist_ok=True)
SPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
model_dir = resolve_model(None)
prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
node_args = cut.node_args_for(
    model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
)
with local_mesh(3, node_args=node_args) as mesh:
    plan = newest_in_view(wait_settled(mesh))
    names = cut.node_names(n.peer_id for n in mesh.nodes)
    print("plan", cut.describe(plan, names), "gateway", names[mesh.nodes[-1].peer_id], flush=True)
    pids = {names[n.peer_id]: n.proc.pid for n in mesh.nodes}

    async def main() -> None:
        async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as client:
            await _stream(client, prompt_ids, 8)
            if os.environ.get("STRACE"):  # each node's trio thread's syscalls instead
                spies = [
                    subprocess.Popen(
                        ["timeout", str(SECONDS), "strace", "-tt", "-p", str(pid),
                         "-o", f"{OUT}/{name}.strace"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                    for name, pid in pids.items()
                ]
            else:
                spies = [
                    subprocess.Popen(
                        [SPY, "record", "--native", "-r", "100", "-d", str(SECONDS), "-f",
                         "raw", "-o", f"{OUT}/{name}.txt", "-p", str(pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                    for name, pid in pids.items()
                ]
            began = time.perf_counter()
            tokens = 0
            streams = int(os.environ.get("STREAMS", "8"))
            while time.perf_counter() - began < SECONDS + 1:
                spans = []

                async def one() -> None:
                    spans.append(await _stream(client, prompt_ids, 64))

                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(streams):
                        nursery.start_soon(one)
                made = sum(len(s) - 1 for s in spans)
                tokens += made
                print(f"{streams} streams {made / (time.perf_counter() - t0):.1f} tok/s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
            for spy in spies:
                spy.wait()

    trio.run(main)
