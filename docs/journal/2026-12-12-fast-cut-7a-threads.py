"""Ad-hoc: a 3-stage int4 cut built as bench/pipeline.py builds it; each node's threads'
CPU (/proc/PID/task/*/stat) a token of one greedy stream, and a second of idle (IDLE_S seconds, default 5).

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-12-fast-cut-7a-threads.py ROUNDS [TOKENS]
prints, each round, ms/token and every node's threads' CPU: ms a token during the
stream (by thread name and id, the trio thread "main"; ended threads count in "ended") and ms a second idle.
With SPY=OUT, py-spy records every node (OUT-<node>.txt) at 50 Hz in the last round.
"""

import collections
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

ROUNDS = int(sys.argv[1])
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
IDLE_S = float(os.environ.get("IDLE_S", "5"))
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def threads(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed), and the process's."""
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        name = "main" if tid == str(pid) else f"{name}/{tid}"
        fields = raw.rsplit(")", 1)[1].split()
        out[name] += (int(fields[11]) + int(fields[12])) / TICK
    out["(process)"] = proc_cpu(pid)
    return dict(out)


def delta(a: dict[str, float], b: dict[str, float], per: float) -> dict[str, float]:
    d = {k: (b.get(k, 0.0) - a.get(k, 0.0)) / per * 1e3 for k in b}
    d["ended"] = d["(process)"] - sum(v for k, v in d.items() if k != "(process)")
    return {k: round(v, 2) for k, v in sorted(d.items()) if abs(v) >= 0.01}


model_dir = resolve_model(None)
prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
node_args = cut.node_args_for(
    model_dir, 3, [*NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
)
with local_mesh(3, node_args=node_args) as mesh:
    plan = newest_in_view(wait_settled(mesh))
    names = cut.node_names(n.peer_id for n in mesh.nodes)
    gw = mesh.nodes[-1]
    print("plan", cut.describe(plan, names), "gateway", names[gw.peer_id], flush=True)
    pids = {names[n.peer_id]: n.proc.pid for n in mesh.nodes}

    async def main() -> None:
        async with open_mesh_client(gw.addr, mesh_secret=mesh.secret) as client:
            await _stream(client, prompt_ids, 8)
            for rnd in range(ROUNDS):
                spies = []
                if os.environ.get("SPY") and rnd == ROUNDS - 1:  # every node, at 50 Hz
                    spies = [
                        subprocess.Popen(
                            [
                                os.path.join(os.path.dirname(sys.executable), "py-spy"),
                                "record",
                                "--native",
                                "-r",
                                "50",
                                "-f",
                                "raw",
                                "-o",
                                f"{os.environ['SPY']}-{k}.txt",
                                "-p",
                                str(p),
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                        for k, p in pids.items()
                    ]
                    await trio.sleep(1)
                before = {k: threads(p) for k, p in pids.items()}
                me0 = time.process_time()
                stamps = await _stream(client, prompt_ids, TOKENS)
                me = time.process_time() - me0
                n = len(stamps) - 1
                after = {k: threads(p) for k, p in pids.items()}
                for spy in spies:
                    spy.send_signal(2)
                    await trio.to_thread.run_sync(spy.wait)
                print(
                    f"round {rnd}: {(stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3:.2f} "
                    f"ms/token, {n} tokens, client {me / n * 1e3:.2f} ms/token, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                for k in pids:
                    print(f"  {k} ms/token", delta(before[k], after[k], n), flush=True)
                before = {k: threads(p) for k, p in pids.items()}
                t0 = time.perf_counter()
                await trio.sleep(IDLE_S)
                dt = time.perf_counter() - t0
                after = {k: threads(p) for k, p in pids.items()}
                for k in pids:
                    print(f"  {k} idle ms/s", delta(before[k], after[k], dt), flush=True)

    trio.run(main)
