"""A/B inside one mesh: where the client's gateway runs relative to the stages.

One 3-process loopback mesh of the default model (int4) cut in 3 as bench/pipeline.py
builds it (bench/cut.py's caps); a client on each node in turn, rounds interleaved
(order rotated each round), each round one greedy stream of ``tokens`` after the chat
prompt, the median ms/token between its first and last token recorded per entry
node, named by the stage that node holds. The outputs are checked against one
another (every entry must give the same tokens).

Usage: PYTHONPATH=. .venv/bin/python docs/journal/2026-12-06-fast-cut-2-entry-ab.py [rounds] [tokens]
"""

from __future__ import annotations

import json
import statistics
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


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    model_dir = resolve_model(None)
    tok = load_tokenizer(model_dir)
    prompt_ids = encode_prompt(tok, pipeline.PROMPT, chat=True)
    args = [*pipeline.NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
    args = cut.node_args_for(model_dir, 3, args)
    with local_mesh(3, node_args=args) as mesh:
        plan = newest_in_view(wait_settled(mesh))
        assert plan is not None and cut.stages_of(plan) == [3], plan
        stage_of = {s.peer_id: i for i, s in enumerate(plan.pipelines[0].stages)}
        names = cut.node_names(n.peer_id for n in mesh.nodes)
        print("plan", cut.describe(plan, names), flush=True)
        order = sorted(mesh.nodes, key=lambda n: stage_of[n.peer_id])

        async def run() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {f"stage{i}": [] for i in range(3)}
            outs: dict[str, list[int]] = {}
            for r in range(rounds):
                rot = order[r % 3 :] + order[: r % 3]
                for node in rot:
                    key = f"stage{stage_of[node.peer_id]}"
                    async with open_mesh_client(node.addr, mesh_secret=mesh.secret) as client:
                        if r == 0:
                            await pipeline._stream(client, prompt_ids, 4)
                        ids: list[int] = []
                        stamps = await pipeline._stream(client, prompt_ids, tokens, ids)
                    outs.setdefault(key, ids)
                    assert outs[key] == ids, (key, outs[key], ids)
                    times[key].append((stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3)
                print(r, {k: round(v[-1], 1) for k, v in times.items()}, flush=True)
            assert len({tuple(v) for v in outs.values()}) == 1, outs
            return times

        began = time.time()
        times = trio.run(run)
    print(
        json.dumps(
            {
                "median_ms_per_token": {
                    k: round(statistics.median(v), 2) for k, v in times.items()
                },
                "rounds": rounds,
                "tokens": tokens,
                "seconds": round(time.time() - began, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
