"""A/B of the stage lane (hetmesh.node.stage_lane) on one 3-stage cut, switched on and
off between rounds of the same mesh (same plan, same processes' state, same minute).

Three in-process serving daemons (real libp2p, real data plane links, the default
model int4, memory caps from bench/cut.py forcing 3 stages), one torch thread. Each
round: one greedy stream of TOKENS tokens with every link's sink set (lane on, B),
then with every sink removed (every step through trio, A), order alternating;
then the same for 8 concurrent streams. Outputs checked equal to the reference.

Caveat: the three nodes, their gateways and the client share one process and one
trio thread here (in a real mesh each node has its own).

    PYTHONPATH=. .venv/bin/python docs/journal/2026-12-05-fast-cut-lane-ab.py [ROUNDS] [TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 32


async def main() -> None:
    import cut

    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.node.config import ServingConfig
    from hetmesh.partition.store import resolve_model
    from hetmesh.transport.links import ThreadedLink
    from tests.integration.node.inprocess_mesh import SECRET, open_mesh, stage_servers
    from tests.integration.node.mesh_nodes import reference_ids

    torch.set_num_threads(1)
    model = resolve_model(None)
    serving = ServingConfig(max_sessions=8, max_context_tokens=1024, threads=1, prefix_cache=False)
    args = cut.node_args_for(
        model, 3, ["--weights", "native", "--max-context", "1024", "--max-sessions", "8"]
    )
    memory = int(cut.option(args, "--max-memory", "0"))
    prompt = [1, 504, 3458, 282, 1029, 314, 253, 1200, 45, 77]
    expected = reference_ids(model, prompt, TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        async with open_mesh(Path(tmp), serving, 3, memory_bytes=memory) as mesh:
            servers = stage_servers(mesh.nodes)
            print("stages", [(s.stage.start, s.stage.end) for s in servers], flush=True)
            async with open_mesh_client(mesh.addr, mesh_secret=SECRET) as client:

                async def stream() -> tuple[list[int], list[float]]:
                    ids, stamps = [], []
                    async for event in client.stream(prompt_ids=prompt, max_new_tokens=TOKENS):
                        if isinstance(event, TokenEvent) and event.token_id >= 0:
                            ids.append(event.token_id)
                            stamps.append(time.perf_counter())
                    return ids, stamps

                sinks = {}

                def lane(on: bool) -> None:
                    for node in mesh.nodes:
                        for link in node.serving.pool.links().values():
                            if isinstance(link, ThreadedLink):
                                sinks.setdefault(id(link), link.sink)
                                link.sink = sinks[id(link)] if on else None

                await stream()  # warm up
                tpot = {True: [], False: []}
                tps8 = {True: [], False: []}
                identical = True
                for r in range(ROUNDS):
                    for on in (True, False) if r % 2 == 0 else (False, True):
                        lane(on)
                        ids, stamps = await stream()
                        identical &= ids == expected
                        tpot[on].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                        began = time.perf_counter()
                        outs = []

                        async def one(outs: list[list[int]] = outs) -> None:
                            outs.append((await stream())[0])

                        async with trio.open_nursery() as nursery:
                            for _ in range(8):
                                nursery.start_soon(one)
                        tps8[on].append(sum(map(len, outs)) / (time.perf_counter() - began))
                        identical &= all(o == expected for o in outs)
                        ms, tps = tpot[on][-1] * 1e3, tps8[on][-1]
                        print(f"round {r} lane={on} tpot {ms:.1f} ms, 8 streams {tps:.1f} tok/s")
                lane(True)
    a, b = statistics.median(tpot[False]), statistics.median(tpot[True])
    print(f"decode ms/token: lane off (A) {a * 1e3:.1f}, lane on (B) {b * 1e3:.1f}")
    print(f"A/B speed-up {a / b:.3f}")
    a8, b8 = statistics.median(tps8[False]), statistics.median(tps8[True])
    print(f"8 streams tok/s: lane off {a8:.1f}, lane on {b8:.1f}, ratio {b8 / a8:.3f}")
    print("lane steps per stage", [s.statistics().lane_steps for s in servers])
    print("outputs identical to the reference:", identical)


trio.run(main)
