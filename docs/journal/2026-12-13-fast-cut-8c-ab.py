"""Ad-hoc A/B (cutC, 2026-12-13): one greedy stream through a 3-stage int4 cut built as
bench/pipeline.py builds it, a fresh mesh per arm, arms alternated.

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-13-fast-cut-8c-ab.py TOKENS ENV=V,V2,... [ENV=...]
e.g. ``200 HETMESH_CONTROL_NICE=0,10,0,10``: arm i sets each ENV to its i-th value
(the node processes inherit it). Prints per arm: ms/token of the stream, the load,
and per node ms a token of CPU by thread kind (reader = the link reader threads
that compute the lane's steps, worker = trio's worker threads, main = trio's) and
of run-queue wait (schedstat: time runnable but not running) of all its threads; KIND_sys:
the part of KIND's CPU spent in the kernel (system time).
"""

import collections
import os
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

TOKENS = int(sys.argv[1])
ARMS = [(k, v.split(",")) for k, v in (a.split("=", 1) for a in sys.argv[2:])]
TICK = os.sysconf("SC_CLK_TCK")


def kind(pid: int, tid: str, name: str) -> str:
    if tid == str(pid):
        return "main"
    if name.startswith("Trio thread"):
        return "worker"
    if "reader" in name or name.startswith("hetmesh-"):
        return "reader"
    return "other"


def sample(pid: int) -> dict[str, float]:
    """CPU seconds by thread kind, and 'wait': run-queue seconds of all threads."""
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                wait_ns = int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = raw.rsplit(")", 1)[1].split()
        out[kind(pid, tid, name)] += (int(fields[11]) + int(fields[12])) / TICK
        out[kind(pid, tid, name) + "_sys"] += int(fields[12]) / TICK  # of it, in the kernel
        out["wait"] += wait_ns / 1e9
    return dict(out)


model_dir = resolve_model(None)
prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
node_args = cut.node_args_for(
    model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
)
for i in range(len(ARMS[0][1])):
    arm = {k: vs[i] for k, vs in ARMS}
    os.environ.update(arm)
    with local_mesh(3, node_args=node_args) as mesh:
        plan = newest_in_view(wait_settled(mesh))
        names = cut.node_names(n.peer_id for n in mesh.nodes)
        gw = mesh.nodes[-1]
        pids = {
            names[n.peer_id]: n.proc.pid for n in sorted(mesh.nodes, key=lambda n: names[n.peer_id])
        }

        async def main() -> None:
            async with open_mesh_client(gw.addr, mesh_secret=mesh.secret) as client:
                await _stream(client, prompt_ids, 16)
                before = {k: sample(p) for k, p in pids.items()}
                t0 = time.perf_counter()
                stamps = await _stream(client, prompt_ids, TOKENS)
                wall = time.perf_counter() - t0
                after = {k: sample(p) for k, p in pids.items()}
                n = len(stamps) - 1
                per = (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3
                print(
                    f"arm {arm} {time.strftime('%H:%M:%S', time.gmtime())}: {per:.2f} ms/token "
                    f"({wall:.1f} s), load {os.getloadavg()[0]:.1f}, plan {cut.describe(plan, names)}",
                    flush=True,
                )
                for k in pids:
                    d = {
                        x: round((after[k].get(x, 0) - before[k].get(x, 0)) / n * 1e3, 2)
                        for x in sorted(after[k])
                    }
                    print(f"  {k} ms/token {d}", flush=True)

        trio.run(main)
