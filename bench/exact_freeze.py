"""The freeze runs of ``bench/exact.py`` (see its docstring): a replica frozen
(SIGSTOP) under a stream, thawed after the stream moved on."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from exact import CONTEXT, GATEWAY_MEMORY, WHOLE_MEMORY, started_mesh

SAMPLE_S = 0.5  # one look at the replicas' CPU time
SAMPLE_MAX_S = 30.0  # how long the serving replica is looked for before the run is redone
SERVING_CPU_S = 0.1  # CPU seconds the serving replica must have used since the first look
SERVING_LEAD = 3.0  # ... and this many times what any other replica used


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pick_serving(used: Mapping[str, float], loaded: Sequence[str]) -> str | None:
    """The replica computing the one stream, or None while the evidence is unclear:
    the only one whose announcement shows a session, else the one whose CPU time grew
    by :data:`SERVING_CPU_S` and :data:`SERVING_LEAD` times any other's (an idle
    replica still burns a little on announcements; at load 25 a busy one gets ~0.1 of
    a core, so the caller keeps sampling until the lead shows)."""
    if len(loaded) == 1:
        return loaded[0]
    if not used:
        return None
    busiest = max(used, key=lambda p: used[p])
    others = max((v for p, v in used.items() if p != busiest), default=0.0)
    if used[busiest] >= SERVING_CPU_S and used[busiest] >= SERVING_LEAD * others:
        return busiest
    return None


def judge_freezes(
    outputs: Sequence[Mapping[str, Any]], runs: int, want: list[int], alone: list[int]
) -> dict[str, int]:
    """The freeze keys from every run made (redone ones included): ``freeze_runs`` the
    runs that froze their serving replica, ``freeze_runs_redone`` those that froze
    nothing (and were made again), ``freeze_runs_identical`` 1 only when ``runs`` runs
    froze and every stream made (frozen or not) equals ``want``, and the stream
    generated alone equals it too."""
    frozen = sum(bool(o["frozen"]) for o in outputs)
    equal = sum(o["tokens"] == want for o in outputs) if alone == want else 0
    return {
        "freeze_runs": frozen,
        "freeze_runs_frozen": frozen,
        "freeze_runs_redone": len(outputs) - frozen,
        "freeze_runs_recovered": sum(bool(o["recovered"]) for o in outputs if o["frozen"]),
        "freeze_runs_streams_equal": equal,
        "freeze_runs_identical": int(bool(outputs) and frozen >= runs and equal == len(outputs)),
    }


def freeze_stream(prompt: list[int], tokens: int, runs: int, pool_tokens: int) -> dict[str, Any]:
    """``runs`` int4 streams, each with the replica serving it frozen (SIGSTOP) at the
    stream's 20th token, thawed (SIGCONT) once 3 more tokens came (the session replayed
    on the other replica) or 20 s passed; per stream its tokens, whether a replica was
    frozen under it and whether tokens came while it was frozen (a recovery). A run
    whose serving replica was not found within :data:`SAMPLE_MAX_S` froze nothing: it
    is kept (its stream is compared too) and made again, up to ``runs`` extra runs."""
    import trio

    from hetmesh.client.mesh import TokenEvent, open_mesh_client

    args = [
        *("--weights", "int4", "--max-memory", WHOLE_MEMORY, "--max-context", str(CONTEXT)),
        *("--kv-pool-tokens", str(pool_tokens)),
    ]
    outputs: list[dict[str, Any]] = []
    start_retries: list[str] = []
    # the gateway serves no stage (too little memory for one): a stream it computed
    # itself could not be frozen under it; the two others hold a replica each
    with started_mesh(
        "freeze mesh",
        args,
        per_node_args=[["--max-memory", GATEWAY_MEMORY]],
        pipelines=2,  # a replica to move to
        retries=start_retries,
    ) as (mesh, _view):
        gateway = mesh.nodes[0]
        replicas = {n.peer_id: n for n in mesh.nodes[1:]}

        async def announced(client: Any) -> list[str]:
            """The replicas whose announced load shows a session (lags by seconds)."""
            try:
                view = await client.status(timeout_s=30.0)
            except Exception as exc:  # a starved gateway: the CPU time decides alone
                print(f"freeze: status failed: {exc!r}", file=sys.stderr)
                return []
            return [
                str(e["peer_id"])
                for e in view["peers"]
                if e["peer_id"] in replicas and e["record"]["load"]["active_sessions"]
            ]

        async def serving(client: Any, ended: trio.Event) -> str | None:
            """The replica computing the stream (:func:`pick_serving`), looked at every
            :data:`SAMPLE_S` until it is clear, the stream ended or :data:`SAMPLE_MAX_S`
            passed (the stream goes on meanwhile)."""
            before = {p: _cpu_seconds(n.proc.pid) for p, n in replicas.items()}
            used: dict[str, float] = {}
            with trio.move_on_after(SAMPLE_MAX_S):
                while not ended.is_set():
                    await trio.sleep(SAMPLE_S)
                    loaded = await announced(client)
                    used = {p: _cpu_seconds(n.proc.pid) - before[p] for p, n in replicas.items()}
                    peer = pick_serving(used, loaded)
                    if peer is not None:
                        return peer
            print(f"freeze: no serving replica found (CPU s {used})", file=sys.stderr)
            return None

        async def one(client: Any) -> dict[str, Any]:
            got: list[int] = []
            frozen: list[str] = []  # the replica frozen under the stream, once it is
            at_freeze = [0]  # tokens delivered when it was frozen
            twenty = trio.Event()  # the 20th token came (or the stream ended)
            ended = trio.Event()
            moved_on = trio.Event()  # 3 tokens came after the freeze: replayed elsewhere

            async def read() -> None:
                events = client.stream(prompt_ids=prompt, max_new_tokens=tokens)
                async with contextlib.aclosing(events) as stream:
                    async for event in stream:
                        if not (isinstance(event, TokenEvent) and event.token_id >= 0):
                            continue
                        got.append(event.token_id)
                        if len(got) >= 20:
                            twenty.set()
                        if frozen and len(got) > at_freeze[0] + 2:
                            moved_on.set()
                ended.set()
                twenty.set()

            async def freeze() -> None:
                await twenty.wait()
                peer = await serving(client, ended)
                if peer is None or ended.is_set():
                    return  # froze nothing: the run is made again
                pid = replicas[peer].proc.pid
                at_freeze[0] = len(got)
                frozen.append(peer)
                os.kill(pid, signal.SIGSTOP)
                try:
                    with trio.move_on_after(20):
                        await moved_on.wait()
                finally:
                    os.kill(pid, signal.SIGCONT)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                nursery.start_soon(freeze)
            return {"tokens": got, "frozen": bool(frozen), "recovered": moved_on.is_set()}

        async def run() -> None:
            async with open_mesh_client(gateway.addr, mesh_secret=mesh.secret, timeout_s=900) as c:
                made = 0
                while sum(o["frozen"] for o in outputs) < runs and made < 2 * runs:
                    outputs.append(await one(c))
                    made += 1
                    if not outputs[-1]["frozen"]:
                        print(f"freeze: run {made} froze nothing: made again", file=sys.stderr)

        trio.run(run)
    return {"outputs": outputs, "start_retries": start_retries}
