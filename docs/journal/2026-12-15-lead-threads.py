"""Ad-hoc (the lead, 2026-12-15): Per-thread CPU of each node of a 3-stage synth1b int4 cut over one 64-token stream,
then py-spy record of each node for SECONDS during streams."""

import os, subprocess, sys, time

sys.path.insert(0, "bench")
import cut
import trio
from pipeline import NODE_ARGS, PROMPT, _stream
from hetmesh.client.mesh import open_mesh_client
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, wait_settled

OUT, SECONDS = sys.argv[1], int(sys.argv[2])
MODEL = os.environ.get("MODEL", "synth-llama-3.2-1b")
SPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
model_dir = resolve_model(MODEL)
prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
node_args = cut.node_args_for(
    model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
)


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            ran, waited = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[:2]
            out[int(tid)] = (name, int(ran) / 1e6, int(waited) / 1e6)
        except OSError:
            pass
    return out


with local_mesh(3, node_args=node_args) as mesh:
    plan = newest_in_view(wait_settled(mesh))
    names = cut.node_names(n.peer_id for n in mesh.nodes)
    print("plan", cut.describe(plan, names), "gateway", names[mesh.nodes[-1].peer_id], flush=True)
    pids = {names[n.peer_id]: n.proc.pid for n in mesh.nodes}

    async def main():
        async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as client:
            await _stream(client, prompt_ids, 8)
            for rep in range(2):
                before = {n: threads(p) for n, p in pids.items()}
                stamps = await _stream(client, prompt_ids, 64)
                after = {n: threads(p) for n, p in pids.items()}
                toks = len(stamps) - 1
                print(
                    f"rep {rep}: {(stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3:.1f} ms/token",
                    flush=True,
                )
                for n in pids:
                    rows = []
                    for tid, (name, ran, waited) in after[n].items():
                        b = before[n].get(tid, (name, 0.0, 0.0))
                        d = (ran - b[1]) / toks
                        if d > 0.05:
                            rows.append(f"{tid}:{name}={d:.2f}/{(waited - b[2]) / toks:.2f}")
                    print(" ", n, pids[n], " ".join(rows), flush=True)
            spies = [
                subprocess.Popen(
                    [
                        SPY,
                        "record",
                        "-r",
                        "200",
                        "-d",
                        str(SECONDS),
                        "-f",
                        "raw",
                        "-o",
                        f"{OUT}/{name}.txt",
                        "-p",
                        str(pid),
                        "--threads",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for name, pid in pids.items()
            ]
            began = time.perf_counter()
            while time.perf_counter() - began < SECONDS + 1:
                await _stream(client, prompt_ids, 64)
            for s in spies:
                s.wait()

    trio.run(main)
