"""Ad-hoc (cutD): the gateway's turn (a decode token in, the next step out) on the 3-stage
int4 cut, lane on (HETMESH_GATEWAY_LANE=1) against off (=0), arms alternated, a fresh
mesh each; one greedy stream of TOKENS tokens per arm after a warm-up; the gateway's
announced statistics (lane_turns / lane_turn_s / trio_turns / trio_turn_s) read back.

PYTHONPATH=. OMP_NUM_THREADS=1 python turns.py [TOKENS] [ARMS e.g. on,off,on,off]
"""
import os, sys, time
sys.path.insert(0, "bench")
import cut  # noqa
import trio
from pipeline import NODE_ARGS, _stream
from hetmesh.client.mesh import open_mesh_client
from hetmesh.discovery.status import fetch_status
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, wait_settled

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
ARMS = (sys.argv[2] if len(sys.argv) > 2 else "on,off,on,off").split(",")
model_dir = resolve_model(None)
tokenizer = load_tokenizer(model_dir)
prompt = encode_prompt(tokenizer, "Write a long story about a lighthouse keeper and the sea.", chat=True)
node_args = cut.node_args_for(model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)])

def find(obj, out):
    if isinstance(obj, dict):
        if "lane_turns" in obj and "tokens_out" in obj:
            out.append(obj)
        for v in obj.values():
            find(v, out)
    elif isinstance(obj, list):
        for v in obj:
            find(v, out)
    return out

for arm in ARMS:
    os.environ["HETMESH_GATEWAY_LANE"] = "1" if arm == "on" else "0"
    with local_mesh(3, node_args=node_args) as mesh:
        plan = newest_in_view(wait_settled(mesh))
        names = cut.node_names(n.peer_id for n in mesh.nodes)
        async def main():
            async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as c:
                await _stream(c, prompt, 8)
                before = max(find(await fetch_status(mesh.nodes[-1].addr, mesh_secret=mesh.secret), []), key=lambda g: g["tokens_out"])
                t0 = time.perf_counter()
                stamps = await _stream(c, prompt, TOKENS)
                wall = time.perf_counter() - t0
            for _ in range(20):
                await trio.sleep(0.5)
                gs = find(await fetch_status(mesh.nodes[-1].addr, mesh_secret=mesh.secret), [])
                after = max(gs, key=lambda g: g["tokens_out"])
                if after["tokens_out"] >= before["tokens_out"] + TOKENS:
                    break
            return before, after, wall, stamps
        before, after, wall, stamps = trio.run(main)
        d = {k: after[k] - before[k] for k in ("lane_turns", "lane_turn_s", "trio_turns", "trio_turn_s", "tokens_out")}
        lt = d["lane_turn_s"] / d["lane_turns"] * 1e3 if d["lane_turns"] else float("nan")
        tt = d["trio_turn_s"] / d["trio_turns"] * 1e3 if d["trio_turns"] else float("nan")
        tpot = (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2) * 1e3 if len(stamps) > 2 else float("nan")
        print(f"arm {arm} plan {cut.describe(plan, names)}: tokens {d['tokens_out']}, lane turns {d['lane_turns']} mean {lt:.3f} ms, trio turns {d['trio_turns']} mean {tt:.3f} ms, ms/token {tpot:.1f}, load {os.getloadavg()[0]:.1f}", flush=True)
