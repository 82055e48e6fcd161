"""Ad-hoc: a 3-stage int4 cut like bench/pipeline.py; one client stream of T tokens, per-thread CPU per token."""
import os, sys, time, json, statistics
sys.path.insert(0, "bench")
import trio
os.environ.setdefault("OMP_NUM_THREADS", "1")
from pipeline import NODE_ARGS, PROMPT, _stream
import cut
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, wait_settled
from hetmesh.client.mesh import open_mesh_client

T = int(sys.argv[1]) if len(sys.argv) > 1 else 128
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
HOLD = os.environ.get("HOLD")
CLK = os.sysconf("SC_CLK_TCK")

def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            cpu = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0]) / 1e9
            sched = open(f"/proc/{pid}/task/{tid}/sched").read()
            sw = {}
            for line in sched.splitlines():
                if "nr_voluntary_switches" in line or "nr_involuntary_switches" in line:
                    k, v = line.split(":"); sw[k.strip()] = int(v)
            out[tid] = (name + ":" + tid, cpu, sw.get("nr_voluntary_switches", 0), sw.get("nr_involuntary_switches", 0))
        except OSError:
            pass
    return out

def diff(a, b, toks):
    rows = []
    for tid, (name, cpu, v, iv) in b.items():
        n0, c0, v0, iv0 = a.get(tid, (name, 0, 0, 0))
        d = cpu - c0
        if d / toks > 2e-5 or v - v0 > toks // 2:
            rows.append(f"    {name:<24} {d/toks*1e3:6.2f} ms/tok  vol {(v-v0)/toks:5.2f}/tok  invol {(iv-iv0)/toks:5.2f}/tok")
    return rows

model_dir = resolve_model(None)
tok = load_tokenizer(model_dir)
prompt_ids = encode_prompt(tok, PROMPT, chat=True)
node_args = [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
node_args = cut.node_args_for(model_dir, 3, node_args)
with local_mesh(3, node_args=node_args) as mesh:
    plan = newest_in_view(wait_settled(mesh))
    names = cut.node_names(n.peer_id for n in mesh.nodes)
    print("plan", cut.describe(plan, names), "gateway", names[mesh.nodes[-1].peer_id], flush=True)
    entry = mesh.nodes[-1]
    if os.environ.get("ENTRY") == "first":
        first_name = cut.describe(plan, names)[0][0][0]
        entry = mesh.nodes[int(first_name[4:])]
    print("entry", names[entry.peer_id], flush=True)
    pids = {f"node{i}": n.proc.pid for i, n in enumerate(mesh.nodes)}
    pids["client"] = os.getpid()
    print(pids, flush=True)
    async def main():
        async with open_mesh_client(entry.addr, mesh_secret=mesh.secret) as client:
            await _stream(client, prompt_ids, 8)
            if HOLD:
                open("/tmp/cut7/pids.json", "w").write(json.dumps(pids))
                print("HOLD: streaming", flush=True)
                await _stream(client, prompt_ids, int(HOLD))
            b = {k: threads(p) for k, p in pids.items()}
            t0 = time.perf_counter(); await trio.sleep(5); el = time.perf_counter() - t0
            a = {k: threads(p) for k, p in pids.items()}
            print(f"idle 5 s (per second, shown as per 'tok' = per 100 ms):")
            for k in pids:
                print("  ", k); print("\n".join(diff(b[k], a[k], el * 10)))
            for r in range(ROUNDS):
                before = {k: threads(p) for k, p in pids.items()}
                ids = []
                stamps = await _stream(client, prompt_ids, T, ids)
                after = {k: threads(p) for k, p in pids.items()}
                n = len(stamps) - 2
                tpot = (stamps[-1] - stamps[1]) / n
                print(f"round {r}: {tpot*1e3:.2f} ms/token ({n} tokens) load {os.getloadavg()[0]:.2f}", flush=True)
                if r == ROUNDS - 1 or os.environ.get("ALL"):
                    for k in pids:
                        print("  ", k); print("\n".join(diff(before[k], after[k], n)))
    trio.run(main)
