"""Ad-hoc: 8 concurrent streams through a 3-stage int4 cut (as bench/pipeline.py builds it),
per arm (``NAME=VALUE[,...]`` env settings, one mesh each, one after the other): tokens/s,
and the CPU seconds each process's threads spent during the 8-stream phases (per token).
With a stage-server trace patch writing ``CUT8_TRACE`` files (see the journal), the
analysis of rounds is done by the companion lines at the end.

Usage: PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-09-fast-cut-5-eight.py \
    REPEATS TOKENS ARM [ARM...]
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cut  # noqa: E402
import pipeline  # noqa: E402
import trio  # noqa: E402

from hetmesh.client.mesh import open_mesh_client  # noqa: E402
from hetmesh.partition.store import resolve_model  # noqa: E402
from hetmesh.partition.text import encode_prompt, load_tokenizer  # noqa: E402
from hetmesh.scheduler.replan import newest_in_view  # noqa: E402
from hetmesh.testbed.local_mesh import local_mesh, wait_settled  # noqa: E402


def cpu(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            out[tid] = (name, int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0]) / 1e9)
        except OSError:
            pass
    return out


STREAMS = int(os.environ.get("STREAMS", "8"))


def main():
    repeats, tokens = int(sys.argv[1]), int(sys.argv[2])
    model_dir = resolve_model(None)
    prompt_ids = encode_prompt(load_tokenizer(model_dir), pipeline.PROMPT, chat=True)
    args = cut.node_args_for(model_dir, 3, [*pipeline.NODE_ARGS, "--weights", "native", "--model", str(model_dir)])
    for arm in sys.argv[3:]:
        saved = dict(os.environ)
        for setting in arm.split(","):
            k, v = setting.split("=", 1)
            os.environ[k] = v
        with local_mesh(3, node_args=args) as mesh:
            os.environ.clear()
            os.environ.update(saved)
            plan = newest_in_view(wait_settled(mesh))
            names = cut.node_names(n.peer_id for n in mesh.nodes)
            stage_of = {s.peer_id: i for i, s in enumerate(plan.pipelines[0].stages)}
            pids = {f"stage{stage_of[n.peer_id]}" + ("+gw" if n is mesh.nodes[-1] else ""): n.proc.pid for n in mesh.nodes}
            pids["client"] = os.getpid()
            print(arm, "plan", cut.describe(plan, names), "pids", pids, flush=True)

            async def run():
                async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as client:
                    await pipeline._stream(client, prompt_ids, 8)
                    alone: list[int] = []  # one stream's greedy tokens: each of the 8 must match
                    await pipeline._stream(client, prompt_ids, tokens, alone)
                    for r in range(repeats):
                        before = {k: cpu(p) for k, p in pids.items()}
                        spans = []

                        streams_ids = []

                        async def one():
                            ids = []
                            spans.append(await pipeline._stream(client, prompt_ids, tokens, ids))
                            streams_ids.append(ids)

                        began = time.perf_counter()
                        async with trio.open_nursery() as nursery:
                            for _ in range(STREAMS):
                                nursery.start_soon(one)
                        ended = time.perf_counter()
                        after = {k: cpu(p) for k, p in pids.items()}
                        n = sum(len(s) - 1 for s in spans)
                        same = all(ids == alone for ids in streams_ids)
                        print(f"  every stream's tokens equal the lone stream's: {same}")
                        assert same
                        print(f"  {STREAMS} streams {n / (ended - began):.1f} tok/s, phase {began:.6f}..{ended:.6f}, load {os.getloadavg()[0]:.1f}")
                        for k in pids:
                            per = {}
                            for tid, (name, c) in after[k].items():
                                d = c - before[k].get(tid, (name, 0.0))[1]
                                if d > 0.002:
                                    per[f"{name}"] = per.get(name, 0.0) + d
                            total = sum(per.values())
                            top = ", ".join(f"{nm} {v / n * 1e3:.2f}" for nm, v in sorted(per.items(), key=lambda x: -x[1])[:4])
                            print(f"    {k:<9} {total / n * 1e3:5.2f} ms CPU/token ({top})")

            trio.run(run)


if __name__ == "__main__":
    main()
