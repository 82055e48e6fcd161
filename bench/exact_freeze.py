"""The freeze runs of ``bench/exact.py`` (see its docstring): a replica frozen
(SIGSTOP) under a stream, thawed after the stream moved on."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from exact import CONTEXT, GATEWAY_MEMORY, WHOLE_MEMORY


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def freeze_stream(
    prompt: list[int], tokens: int, runs: int, pool_tokens: int
) -> list[dict[str, Any]]:
    """``runs`` int4 streams, each with the replica serving it frozen (SIGSTOP) at the
    stream's 20th token, thawed (SIGCONT) once 3 more tokens came (the session replayed
    on the other replica) or 20 s passed; per stream its tokens, whether a replica was
    frozen under it and whether tokens came while it was frozen (a recovery)."""
    import trio

    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    args = [
        *("--weights", "int4", "--max-memory", WHOLE_MEMORY, "--max-context", str(CONTEXT)),
        *("--kv-pool-tokens", str(pool_tokens)),
    ]
    outputs: list[dict[str, Any]] = []
    # the gateway serves no stage (too little memory for one): a stream it computed
    # itself could not be frozen under it; the two others hold a replica each
    with local_mesh(3, node_args=args, per_node_args=[["--max-memory", GATEWAY_MEMORY]]) as mesh:
        wait_serving(mesh, pipelines=2, timeout_s=600)  # a replica to move to
        gateway = mesh.nodes[0]
        replicas = {n.peer_id: n for n in mesh.nodes[1:]}

        async def serving(client: Any) -> str | None:
            """The replica computing the stream: the one burning CPU while tokens come
            (its announced load lags by seconds), confirmed by the announcement when
            that already shows the session."""
            before = {p: _cpu_seconds(n.proc.pid) for p, n in replicas.items()}
            await trio.sleep(1.0)
            used = {p: _cpu_seconds(n.proc.pid) - before[p] for p, n in replicas.items()}
            busiest = max(used, key=lambda p: used[p])
            view = await client.status()
            loaded = [
                str(e["peer_id"])
                for e in view["peers"]
                if e["peer_id"] in replicas and e["record"]["load"]["active_sessions"]
            ]
            if len(loaded) == 1:
                return loaded[0]
            return busiest if used[busiest] > 0.05 else None

        async def one(client: Any) -> dict[str, Any]:
            got: list[int] = []
            frozen: str | None = None
            at_freeze = 0
            thawed = trio.Event()
            moved_on = trio.Event()  # tokens came after the freeze: replayed elsewhere

            async def thaw_later(peer: str) -> None:
                with trio.move_on_after(20):
                    await moved_on.wait()
                os.kill(replicas[peer].proc.pid, signal.SIGCONT)
                thawed.set()

            async with trio.open_nursery() as nursery:
                events = client.stream(prompt_ids=prompt, max_new_tokens=tokens)
                async with contextlib.aclosing(events) as stream:
                    async for event in stream:
                        if not (isinstance(event, TokenEvent) and event.token_id >= 0):
                            continue
                        got.append(event.token_id)
                        if frozen is not None and not thawed.is_set() and len(got) > at_freeze + 2:
                            moved_on.set()
                        if len(got) == 20 and frozen is None:
                            peer = await serving(client)
                            if peer is not None:
                                frozen = peer
                                at_freeze = len(got)
                                os.kill(replicas[peer].proc.pid, signal.SIGSTOP)
                                nursery.start_soon(thaw_later, peer)
                if frozen is not None:
                    await thawed.wait()
            return {"tokens": got, "frozen": frozen is not None, "recovered": moved_on.is_set()}

        async def run() -> None:
            async with open_mesh_client(gateway.addr, mesh_secret=mesh.secret, timeout_s=900) as c:
                for _ in range(runs):
                    outputs.append(await one(c))

        trio.run(run)
    return outputs
