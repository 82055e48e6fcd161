"""Ad-hoc: a 3-stage int4 cut built as bench/pipeline.py builds it; each node's CPU by
thread (/proc/PID/task/*/schedstat) idle, during one greedy stream and during 8 streams,
and how many record versions each node published meanwhile (its record's ``seq`` in the
gateway's view) and which ``extra`` entries moved between versions.

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-14-fast-cut-9e-cpu.py ROUNDS [TOKENS]

Each round: IDLE_S (default 10) seconds idle, one stream of TOKENS (default 200), then
STREAMS (default 8) streams of TOKENS at once. Prints, a phase: tokens, seconds, and a
node: ms of CPU a token (a second, idle) of its busiest thread (the forwards), trio's
thread ("main"), the rest, and its record versions a second. The client's CPU a token
too. With SPY=OUT, py-spy (PYSPY=its path, default the venv's) (100 Hz, raw) records every node during the last round's 8
streams (OUT-<node>.txt). With SPEC=1 the gateway speculates as a node does by
default (bench/pipeline.py's nodes do not): a step may bring several tokens at once.
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

ROUNDS = int(sys.argv[1])
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
IDLE_S = float(os.environ.get("IDLE_S", "10"))
STREAMS = int(os.environ.get("STREAMS", "8"))


def cpu(pid: int) -> dict[str, float]:
    """CPU seconds by thread (the trio thread "main", others by id), and the process's."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out["main" if tid == str(pid) else tid] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError):
            continue
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out["(process)"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def split(a: dict[str, float], b: dict[str, float], per: float) -> tuple[float, float, float]:
    """(busiest thread, trio's, the rest) ms ``per`` unit between two readings."""
    d = {k: b[k] - a.get(k, 0.0) for k in b if k != "(process)"}
    busiest = max((k for k in d if k != "main"), key=lambda k: d[k])
    rest = max(sum(d.values()), b["(process)"] - a["(process)"]) - d[busiest] - d["main"]
    return tuple(round(x / per * 1e3, 2) for x in (d[busiest], d["main"], rest))  # type: ignore[return-value]


model_dir = resolve_model(None)
prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
args = [a for a in NODE_ARGS if not (os.environ.get("SPEC") and a == "--no-speculative")]
node_args = cut.node_args_for(
    model_dir, 3, [*args, "--weights", "native", "--model", str(model_dir)]
)
with local_mesh(3, node_args=node_args) as mesh:
    plan = newest_in_view(wait_settled(mesh))
    names = cut.node_names(n.peer_id for n in mesh.nodes)
    gw = mesh.nodes[-1]
    print("plan", cut.describe(plan, names), "gateway", names[gw.peer_id], flush=True)
    pids = {names[n.peer_id]: n.proc.pid for n in mesh.nodes}
    ids = {n.peer_id: names[n.peer_id] for n in mesh.nodes}

    async def main() -> None:
        async with open_mesh_client(gw.addr, mesh_secret=mesh.secret) as client:
            seen: dict[str, dict] = {}

            async def versions() -> dict[str, int]:
                view = await client.status()
                out = {}
                for p in view["peers"]:
                    rec = p["record"]
                    name = ids.get(p["peer_id"], p["peer_id"][:8])
                    old = seen.get(name)
                    if old is not None and old.get("seq") != rec.get("seq"):
                        ex0, ex1 = old.get("extra", {}), rec.get("extra", {})
                        moved = sorted(k for k in ex1 if ex0.get(k) != ex1.get(k))
                        if old.get("load") != rec.get("load"):
                            moved.append("(load)")
                        moved_all[name].update(moved)
                    seen[name] = rec
                    out[name] = int(rec.get("seq", 0))
                return out

            moved_all: dict[str, set[str]] = {k: set() for k in pids}
            await _stream(client, prompt_ids, 8)

            async def phase(label: str, streams: int, spies: list) -> None:
                for k in moved_all:
                    moved_all[k].clear()
                v0 = await versions()
                before = {k: cpu(p) for k, p in pids.items()}
                me0, t0 = time.process_time(), time.perf_counter()
                made = together = 0
                if streams == 0:
                    await trio.sleep(IDLE_S)
                else:

                    async def one() -> None:
                        nonlocal made, together
                        stamps = await _stream(client, prompt_ids, TOKENS)
                        made += len(stamps) - 1
                        # tokens that came within 0.5 ms of the one before: in one step
                        together += sum(b - a < 5e-4 for a, b in zip(stamps[1:], stamps[2:]))

                    async with trio.open_nursery() as nursery:
                        for _ in range(streams):
                            nursery.start_soon(one)
                dt = time.perf_counter() - t0
                me = time.process_time() - me0
                after = {k: cpu(p) for k, p in pids.items()}
                for spy in spies:
                    spy.send_signal(2)
                    await trio.to_thread.run_sync(spy.wait)
                v1 = await versions()
                per = made if made else dt
                unit = "token" if made else "second"
                print(
                    f"{label}: {made} tokens ({together} within 0.5 ms of the one before), "
                    f"{dt:.1f} s, client {me / per * 1e3:.2f} ms/{unit}, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                for k in pids:
                    b, m, r = split(before[k], after[k], per)
                    vs = (v1.get(k, 0) - v0.get(k, 0)) / dt
                    print(
                        f"  {k} ms/{unit}: forwards {b} trio {m} rest {r}; "
                        f"versions/s {vs:.2f} moved {sorted(moved_all[k])}",
                        flush=True,
                    )

            for rnd in range(ROUNDS):
                await phase(f"round {rnd} idle", 0, [])
                await phase(f"round {rnd} one stream", 1, [])
                spies = []
                if os.environ.get("SPY") and rnd == ROUNDS - 1:
                    spy = os.environ.get("PYSPY") or os.path.join(
                        os.path.dirname(sys.executable), "py-spy"
                    )
                    spies = [
                        subprocess.Popen(
                            [spy, "record", "--native", "-r", "100", "-f", "raw",
                             "-o", f"{os.environ['SPY']}-{k}.txt", "-p", str(p)],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                        for k, p in pids.items()
                    ]
                    await trio.sleep(1)
                await phase(f"round {rnd} {STREAMS} streams", STREAMS, spies)

    trio.run(main)
