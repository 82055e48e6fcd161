"""Ad-hoc (cutF, issue 42 item 3): each node's CPU for a 512-token prefill through a
3-stage int4 cut, by thread (/proc/PID/task/TID/schedstat run time, summed over REPEATS
single TTFT requests after a warm-up), to set beside the same forwards in one process
(2026-12-14-fast-cut-9f-ops.py). Arms (env CHUNK_ARMS, as 8d-trace.py's: even, taper, or
a schedule "85,171,171,85" through HETMESH_PREFILL_SCHEDULE) on one fresh mesh each.

PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-14-fast-cut-9f-nodecpu.py [REPEATS]
"""
import os, statistics, sys, time
sys.path.insert(0, "bench")
import cut  # noqa
import trio
from pipeline import CHECKED_TOKENS, NODE_ARGS, Reference, _stream
from hetmesh.client.mesh import open_mesh_client
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, wait_settled

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
ARMS = os.environ.get("CHUNK_ARMS", "taper").split(",")
ENV = {
    "even": {"HETMESH_PREFILL_TAPER": "0"},
    "taper": {"HETMESH_PREFILL_TAPER": "1"},  # 4 chunks: 85 / 171 / 171 / 85
    # 5 chunks, tapered: 64 / 128 / 128 / 128 / 64 (the nodes' queues take 5 too)
    "taper5": {"HETMESH_PREFILL_MAX_CHUNKS": "5", "HETMESH_PREFILL_CHUNK_TOKENS": "96"},
}


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[tid] = (name, ns)
    return out


model_dir = resolve_model(None)
tokenizer = load_tokenizer(model_dir)
long_ids = encode_prompt(tokenizer, "The sea is wide and the night is long. " * 80)[:512]
reference = Reference(model_dir, "native")
expected = reference.ids(long_ids, CHECKED_TOKENS)
node_args = cut.node_args_for(model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)])
for arm in ARMS:
    for k in ("HETMESH_PREFILL_CHUNK_TOKENS", "HETMESH_PREFILL_MAX_CHUNKS", "HETMESH_PREFILL_SCHEDULE", "HETMESH_PREFILL_TAPER"):
        os.environ.pop(k, None)
    os.environ.update(ENV.get(arm, {"HETMESH_PREFILL_SCHEDULE": arm}))
    with local_mesh(3, node_args=node_args) as mesh:
        plan = newest_in_view(wait_settled(mesh))
        names = cut.node_names(n.peer_id for n in mesh.nodes)
        pids = [n.proc.pid for n in mesh.nodes]

        async def main():
            async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as c:
                await _stream(c, long_ids, 2)
                got = []
                await _stream(c, long_ids, CHECKED_TOKENS, got)
                await _stream(c, long_ids, 1)
                ours, refs, idle = [], [], []
                before = [threads(p) for p in pids]
                for _ in range(REPEATS):
                    stamps = await _stream(c, long_ids, 1)
                    ours.append(stamps[1] - stamps[0])
                mid = [threads(p) for p in pids]
                await trio.sleep(0.5 * sum(ours) / len(ours))  # idle beside: the background
                after = [threads(p) for p in pids]
                for _ in range(REPEATS):
                    t0 = time.thread_time()
                    refs.append(reference.ttft(long_ids))
                    idle.append(time.thread_time() - t0)
                return ours, refs, idle, got == expected, before, mid, after

        ours, refs, rcpu, same, before, mid, after = trio.run(main)
        m, r = statistics.median(ours), statistics.median(refs)
        print(f"arm {arm} plan {cut.describe(plan, names)} gateway node{len(pids)-1}: mesh {m*1e3:.0f} ms, ref {r*1e3:.0f} ms (ref thread CPU {min(rcpu)*1e3:.0f} ms best), ratio {m/r:.3f}, identical {same}, load {os.getloadavg()[0]:.1f}", flush=True)
        total = 0.0
        for j, pid in enumerate(pids):
            d = {t: (mid[j][t][1] - before[j].get(t, (None, 0))[1]) / 1e6 / REPEATS for t in mid[j]}
            bg = {t: (after[j][t][1] - mid[j].get(t, (None, 0))[1]) / 1e6 for t in after[j] if t in mid[j]}
            ranked = sorted(d.items(), key=lambda kv: -kv[1])
            top = ", ".join(f"{mid[j][t][0]}:{v:.0f}" for t, v in ranked[:5] if v >= 0.5)
            s = sum(d.values())
            total += s
            print(f"  node{j}: {s:.0f} ms a prefill ({top}); idle beside {sum(bg.values()):.1f} ms in {0.5*m*1e3:.0f} ms", flush=True)
        print(f"  nodes: {total:.0f} ms a prefill", flush=True)
