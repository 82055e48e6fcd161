"""Ad-hoc: the client's CPU a token, reading each frame in two reads (arm A: as before,
wire.read_frame) or whatever has arrived in one (arm B: wire.FrameReader), alternated
stream by stream on one 3-stage int4 cut (bench/pipeline.py's nodes); with the gateway
node's trio thread's CPU a token (it reads the client's yamux window updates).

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-12-fast-cut-7a-client.py PAIRS [TOKENS]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, "bench")
import cut
import trio
from pipeline import NODE_ARGS, PROMPT, _stream

import hetmesh.discovery.wire as wire
from hetmesh.client.mesh import open_mesh_client
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, wait_settled

PAIRS = int(sys.argv[1])
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
TICK = os.sysconf("SC_CLK_TCK")
NEW = wire.FrameReader


class TwoReads:
    """Arm A: each frame read as before, its prefix and its body apart."""

    def __init__(self, stream, **_: object) -> None:
        self.stream = stream

    async def read_frame(self, *, max_bytes: int, timeout_s: float) -> bytes:
        return await wire.read_frame(self.stream, max_bytes=max_bytes, timeout_s=timeout_s)


def main_thread_s(pid: int) -> float:
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


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

    async def run() -> None:
        results: dict[str, list[tuple[float, float, float]]] = {"A": [], "B": []}
        async with open_mesh_client(gw.addr, mesh_secret=mesh.secret) as client:
            await _stream(client, prompt_ids, 8)
            for _ in range(PAIRS):
                for arm in "AB":
                    wire.FrameReader = TwoReads if arm == "A" else NEW  # type: ignore[misc]
                    gw0, me0 = main_thread_s(gw.proc.pid), time.process_time()
                    stamps = await _stream(client, prompt_ids, TOKENS)
                    n = len(stamps) - 1
                    results[arm].append(
                        (
                            (time.process_time() - me0) / n * 1e3,
                            (main_thread_s(gw.proc.pid) - gw0) / n * 1e3,
                            (stamps[-1] - stamps[1]) / (n - 1) * 1e3,
                        )
                    )
        for arm, rows in results.items():
            print(
                f"arm {arm}: client {statistics.median(r[0] for r in rows):.3f} ms/token, "
                f"gateway trio {statistics.median(r[1] for r in rows):.3f} ms/token, "
                f"{statistics.median(r[2] for r in rows):.2f} ms/token wall "
                f"(each: {[tuple(round(x, 2) for x in r) for r in rows]}), "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    trio.run(run)
