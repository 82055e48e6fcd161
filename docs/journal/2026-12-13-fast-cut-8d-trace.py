"""Ad-hoc (cutD): where a 512-token prefill's CPU goes through a 3-stage int4 cut.

Each node process's threads' run time (/proc/PID/task/TID/schedstat, ns) sampled every
2 ms during single TTFT requests; printed as a timeline in BIN_MS bins: each node's CPU
(cores busy), the client's, and the idle share of the 2 cores. Arms (env CHUNK_ARMS,
e.g. "128x4,64x8") alternated on one mesh per arm.

PYTHONPATH=. OMP_NUM_THREADS=1 python trace.py [REPEATS]
"""
import os, statistics, sys, threading, time
sys.path.insert(0, "bench")
import cut  # noqa
import trio
from pipeline import CHECKED_TOKENS, NODE_ARGS, Reference, _stream
from hetmesh.client.mesh import open_mesh_client
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, wait_settled

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
BIN = float(os.environ.get("BIN_MS", "20")) / 1e3
ARMS = [a for a in os.environ.get("CHUNK_ARMS", "A").split(",")]
ENV = {
    "A": {},
    "even": {"HETMESH_PREFILL_TAPER": "0"},
    "taper": {"HETMESH_PREFILL_TAPER": "1"},
}
def env_of(arm):
    if arm in ENV:
        return ENV[arm]
    return {"HETMESH_PREFILL_SCHEDULE": arm}

def run_ns(pid):
    tot = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    tot += int(f.read().split()[0])
            except OSError:
                pass
    except OSError:
        pass
    return tot

class Sampler:
    def __init__(self, pids):
        self.pids = pids; self.rows = []; self.stop = False
        self.t = threading.Thread(target=self.loop, daemon=True)
    def loop(self):
        while not self.stop:
            self.rows.append((time.perf_counter(), [run_ns(p) for p in self.pids]))
            time.sleep(0.002)

model_dir = resolve_model(None)
tokenizer = load_tokenizer(model_dir)
long_ids = encode_prompt(tokenizer, "The sea is wide and the night is long. " * 80)[:512]
reference = Reference(model_dir, "native")
expected = reference.ids(long_ids, CHECKED_TOKENS)
node_args = cut.node_args_for(model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)])
for arm in ARMS:
    for k in ("HETMESH_PREFILL_CHUNK_TOKENS", "HETMESH_PREFILL_MAX_CHUNKS", "HETMESH_PREFILL_SCHEDULE", "HETMESH_PREFILL_TAPER"):
        os.environ.pop(k, None)
    os.environ.update(env_of(arm))
    with local_mesh(3, node_args=node_args) as mesh:
        plan = newest_in_view(wait_settled(mesh))
        names = cut.node_names(n.peer_id for n in mesh.nodes)
        pids = [n.proc.pid for n in mesh.nodes] + [os.getpid()]
        async def main():
            async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as c:
                await _stream(c, long_ids, 2)
                got = []
                await _stream(c, long_ids, CHECKED_TOKENS, got)
                ours, refs, traces = [], [], []
                for _ in range(REPEATS):
                    s = Sampler(pids); s.t.start()
                    stamps = await _stream(c, long_ids, 1)
                    s.stop = True; s.t.join()
                    ours.append(stamps[1] - stamps[0]); traces.append((stamps[0], stamps[1], s.rows))
                    refs.append(reference.ttft(long_ids))
                return ours, refs, got == expected, traces
        ours, refs, same, traces = trio.run(main)
        m, r = statistics.median(ours), statistics.median(refs)
        print(f"arm {arm} plan {cut.describe(plan, names)} gateway node{len(mesh.nodes)-1}: mesh {m*1e3:.0f} ms ({[round(x*1e3) for x in ours]}), ref {r*1e3:.0f} ms, ratio {m/r:.3f}, identical {same}, load {os.getloadavg()[0]:.1f}", flush=True)
        # the median request's timeline
        if os.environ.get("NO_TL"):
            continue
        i = ours.index(sorted(ours)[len(ours)//2])
        t0, t1, rows = traces[i]
        first = rows[0][1]
        print("  ms    " + " ".join(f"node{j}" for j in range(len(pids)-1)) + "  client  idle-of-2")
        b = t0; k = 0; prev = rows[0]
        cpu_tot = [0.0]*len(pids)
        while b < t1:
            e = b + BIN
            inbin = [row for row in rows if b <= row[0] < e]
            if not inbin:
                b = e; continue
            last = inbin[-1]
            dt = last[0] - prev[0]
            d = [(last[1][j] - prev[1][j]) / 1e9 for j in range(len(pids))]
            for j in range(len(pids)): cpu_tot[j] += d[j]
            busy = [x / dt if dt > 0 else 0 for x in d]
            print(f"  {(b-t0)*1e3:5.0f} " + " ".join(f"{x:5.2f}" for x in busy) + f"  idle {max(0.0, 2 - sum(busy)):.2f}")
            prev = last; b = e
        print("  cpu s", [round(x, 3) for x in cpu_tot], "wall", round(t1 - t0, 3), flush=True)
