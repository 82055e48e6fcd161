"""A/B in one run: two 3-process meshes side by side, one started with ``ENV=A[,ENV2=A2]``, the
other with ``ENV=B`` (say ``HETMESH_SHM_INLINE=1`` / ``=0``), rounds alternating
between them (order swapped each round), each round one greedy stream of ``tokens``
(ms/token between its first and last token) and then 8 concurrent streams
(tokens/s), through a client on the node that bench/pipeline.py uses (the last).
Both are the default model (int4) cut in 3 by bench/cut.py's caps. The meshes'
tokens must equal each other's in every round.

Usage: PYTHONPATH=. .venv/bin/python docs/journal/2026-12-06-fast-cut-2-ab.py \
    NAME=A NAME=B [rounds] [tokens]
"""

from __future__ import annotations

import contextlib
import json
import os
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


@contextlib.contextmanager
def env(settings: str):  # type: ignore[no-untyped-def]
    """``NAME=VALUE[,NAME=VALUE...]`` set within."""
    olds = {}
    for setting in settings.split(","):
        name, value = setting.split("=", 1)
        olds[name] = os.environ.get(name)
        os.environ[name] = value
    try:
        yield
    finally:
        for name, old in olds.items():
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old


def main() -> None:
    arms = sys.argv[1:3]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    model_dir = resolve_model(None)
    tok = load_tokenizer(model_dir)
    prompt_ids = encode_prompt(tok, pipeline.PROMPT, chat=True)
    args = [*pipeline.NODE_ARGS, "--weights", "native", "--model", str(model_dir)]
    args = cut.node_args_for(model_dir, 3, args)
    with contextlib.ExitStack() as stack:
        meshes = {}
        for arm in arms:
            with env(arm):
                meshes[arm] = stack.enter_context(local_mesh(3, node_args=args))
        for arm, mesh in meshes.items():
            plan = newest_in_view(wait_settled(mesh))
            assert plan is not None and cut.stages_of(plan) == [3], plan
            names = cut.node_names(n.peer_id for n in mesh.nodes)
            stage_of = {s.peer_id: i for i, s in enumerate(plan.pipelines[0].stages)}
            print(
                arm,
                "plan",
                cut.describe(plan, names),
                "gateway holds stage",
                stage_of.get(mesh.nodes[-1].peer_id),
                flush=True,
            )

        async def run() -> dict[str, dict[str, list[float]]]:
            out = {arm: {"ms_per_token": [], "tok_s_8": []} for arm in arms}
            clients = {}
            async with contextlib.AsyncExitStack() as astack:
                for arm, mesh in meshes.items():
                    clients[arm] = await astack.enter_async_context(
                        open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret)
                    )
                    await pipeline._stream(clients[arm], prompt_ids, 4)  # warm
                for r in range(rounds):
                    seen = []
                    for arm in arms if r % 2 == 0 else arms[::-1]:
                        ids: list[int] = []
                        stamps = await pipeline._stream(clients[arm], prompt_ids, tokens, ids)
                        seen.append(ids)
                        out[arm]["ms_per_token"].append(
                            (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3
                        )
                        spans: list[list[float]] = []

                        async def one(client=clients[arm]) -> None:  # type: ignore[no-untyped-def]
                            spans.append(await pipeline._stream(client, prompt_ids, tokens))

                        began = time.perf_counter()
                        async with trio.open_nursery() as nursery:
                            for _ in range(8):
                                nursery.start_soon(one)
                        took = time.perf_counter() - began
                        out[arm]["tok_s_8"].append(sum(len(s) - 1 for s in spans) / took)
                    assert seen[0] == seen[1], "the two meshes' tokens differ"
                    print(
                        r,
                        {
                            a: (round(v["ms_per_token"][-1], 1), round(v["tok_s_8"][-1], 1))
                            for a, v in out.items()
                        },
                        os.getloadavg()[0],
                        flush=True,
                    )
            return out

        out = trio.run(run)
    summary = {
        arm: {k: round(statistics.median(v), 2) for k, v in figures.items()}
        for arm, figures in out.items()
    }
    a, b = arms
    summary["ratio_ms_per_token_a_over_b"] = [
        round(x / y, 3) for x, y in zip(out[a]["ms_per_token"], out[b]["ms_per_token"])
    ]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
