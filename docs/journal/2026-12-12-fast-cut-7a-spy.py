"""Ad-hoc: a 3-stage int4 cut built as bench/pipeline.py builds it; each node's CPU a
second while IDLE (no stream), py-spy of the idle nodes, then py-spy of the nodes and
this client while one greedy stream decodes.

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-12-fast-cut-7a-spy.py OUT SECONDS
writes OUT/idle-<node>.txt and OUT/<node>.txt (py-spy raw stacks, --native), prints
the plan, each node's idle CPU (ms/s, /proc/PID/stat over SECONDS) and ms/token.
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
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def spy(pids: dict[str, int], prefix: str) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [
                SPY,
                "record",
                "--native",
                "-r",
                "250",
                "-d",
                str(SECONDS),
                "-f",
                "raw",
                "-o",
                f"{OUT}/{prefix}{name}.txt",
                "-p",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]


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
            await trio.sleep(2)
            for rnd in range(2):
                before = {k: cpu_s(p) for k, p in pids.items()}
                t0 = time.perf_counter()
                await trio.sleep(SECONDS)
                dt = time.perf_counter() - t0
                print(
                    f"idle round {rnd}: ms CPU/s",
                    {k: round((cpu_s(p) - before[k]) / dt * 1e3, 1) for k, p in pids.items()},
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            spies = spy(pids, "idle-")
            await trio.to_thread.run_sync(lambda: [s.wait() for s in spies])
            spies = spy({**pids, "client": os.getpid()}, "")
            began = time.perf_counter()
            while time.perf_counter() - began < SECONDS + 1:
                stamps = await _stream(client, prompt_ids, 200)
                print(
                    f"{(stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3:.2f} ms/token, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            await trio.to_thread.run_sync(lambda: [s.wait() for s in spies])

    trio.run(main)
