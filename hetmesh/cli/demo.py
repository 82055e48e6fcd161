"""``hetmesh demo``: a three-node mesh on this machine serving the default model.

Each node is offered memory for only a third of the model in the demo's format
(:func:`hetmesh.scheduler.caps.node_memory_cap`, from the model's bytes): no
node can hold it, so the planner cuts it into three stages, one a node, and the
demo prints the cut. ``--replicas`` offers each node the whole model instead: the
plan is then whole-model replicas (one serves, the others stand by).

The first node serves the HTTP API and the web dashboard on loopback; the demo
prints its URL. With ``--keep`` the mesh stays up after the demo's generation
until Ctrl-C (SIGINT) or SIGTERM, which stop every node.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from hetmesh.cli._app import app
from hetmesh.node.config import ServingConfig
from hetmesh.scheduler.records import Plan

# the demo nodes' settings, which their memory caps are computed for
DEMO_SESSIONS = 4
DEMO_CONTEXT = 2048
DEMO_STAGES = 3  # the cut shown (fewer with fewer nodes)
# The default model ships as a 4-bit (Q4_1) GGUF: served as int4 it is never
# inflated, and int4 decodes fastest of the formats on this project's CPUs
# (docs/weights.md).
DEMO_WEIGHTS = "int4"
WEIGHT_CHOICES = ("float32", "bfloat16", "float16", "int8", "int4")


@app.command()
def demo(
    prompt: Annotated[str, typer.Argument(help="What to ask.")] = (
        "Write one sentence about the sea."
    ),
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 48,
    nodes: Annotated[int, typer.Option(min=1, max=8, help="Node processes to start.")] = 3,
    cache_dir: Annotated[Path | None, typer.Option(envvar="HETMESH_HOME")] = None,
    keep: Annotated[
        bool, typer.Option(help="Keep the mesh (and its dashboard) up until Ctrl-C.")
    ] = False,
    api_port: Annotated[
        int, typer.Option(min=0, max=65535, help="The dashboard's port (0: any free one).")
    ] = 0,
    weights: Annotated[
        str,
        typer.Option(help="The weight format every node serves: " + "|".join(WEIGHT_CHOICES) + "."),
    ] = DEMO_WEIGHTS,
    replicas: Annotated[
        bool,
        typer.Option(
            help="Offer each node the whole model: whole-model replicas instead of a cut."
        ),
    ] = False,
) -> None:
    """Start a local mesh, stream one chat generation through it, show its status, stop it."""
    from hetmesh.cli.model import _resolve, _stream_mesh
    from hetmesh.cli.status import render_status
    from hetmesh.scheduler.replan import newest_in_view
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    if weights not in WEIGHT_CHOICES:
        raise typer.BadParameter(
            f"{weights!r} is not one of {', '.join(WEIGHT_CHOICES)}", param_hint="--weights"
        )
    model_dir = _resolve("smollm2-135m-instruct", cache_dir)  # pull once, before the nodes
    stages = 1 if replicas else min(nodes, DEMO_STAGES)
    memory = node_memory(model_dir, weights, stages)
    args = ["--weights", weights, "--max-memory", str(memory)]
    args += ["--max-sessions", str(DEMO_SESSIONS), "--max-context", str(DEMO_CONTEXT)]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    err = sys.stderr
    port = api_port or _free_port()
    url = f"http://127.0.0.1:{port}/"
    print(f"starting {nodes} nodes on loopback serving {model_dir.name} in {weights} ...", file=err)
    layout = "whole-model replicas" if stages == 1 else f"a {stages}-stage cut"
    print(f"each node offers {memory / 2**20:.0f} MiB: the planner must place {layout}", file=err)
    with local_mesh(nodes, node_args=args, per_node_args=[["--api-port", str(port)]]) as mesh:
        plan = newest_in_view(wait_serving(mesh))
        if plan is not None:
            names = {n.peer_id: f"node{i + 1}" for i, n in enumerate(mesh.nodes)}
            print(describe_plan(plan, names), file=err)
        print(f"dashboard: {url}", file=err)
        print(f"mesh up; asking {mesh.nodes[-1].addr}\n", file=err)
        print(f"> {prompt}")
        request = {"prompt": prompt, "chat": True, "max_new_tokens": max_new_tokens}
        _stream_mesh(mesh.nodes[-1].addr, mesh.secret, request)
        view = _settled_view(mesh.addr, mesh.secret)
        print()
        print(render_status(view, width=120))
        if keep:
            print(f"the mesh stays up: open {url} (Ctrl-C stops it)", file=err, flush=True)
            _wait_for_stop()
        print("stopping the mesh ...", file=err)
    print("done", file=err)


def node_memory(model_dir: Path, weights: str, stages: int) -> int:
    """Each demo node's ``--max-memory``: the model in ``weights`` needs ``stages`` nodes
    (1: each holds it whole)."""
    from hetmesh.node.weights import weight_bytes
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir
    from hetmesh.scheduler.caps import node_memory_cap

    config = check_model_dir(model_dir)
    name = model_dir.name
    return node_memory_cap(
        model_profile(config, name=name),
        weight_bytes(config, weights, name=name),
        stages,
        max_context_tokens=DEMO_CONTEXT,
        max_sessions=DEMO_SESSIONS,
        reserve_bytes=ServingConfig().reserve_bytes,
    )


def describe_plan(plan: Plan, names: Mapping[str, str]) -> str:
    """``cut into 3 stages: node1 [0, 13) -> node2 [13, 26) -> node3 [26, 32)``, or the
    replicas, one line each."""
    lines = []
    for i, pipeline in enumerate(plan.pipelines):
        chain = " -> ".join(
            f"{names.get(s.peer_id, s.peer_id[-6:])} [{s.start}, {s.end})" for s in pipeline.stages
        )
        count = len(pipeline.stages)
        kind = "whole model" if count == 1 else f"cut into {count} stages"
        role = "" if len(plan.pipelines) == 1 else (" (serving)" if i == 0 else " (standby)")
        lines.append(f"{kind}{role}: {chain}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_stop() -> None:
    """Block until SIGINT or SIGTERM; the caller's ``with`` then stops the nodes."""
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in signals}
    try:
        while not stop.wait(0.5):  # a short wait keeps the main thread responsive
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _settled_view(addr: str, secret: str) -> dict[str, Any]:
    """The mesh's status once the finished session has left every announcement."""
    import trio

    from hetmesh.discovery.status import fetch_status

    async def fetch() -> dict[str, Any]:
        view: dict[str, Any] = {}
        with trio.move_on_after(5):  # announcements go out about once a second
            while True:
                view = await fetch_status(addr, mesh_secret=secret)
                loads = [p["record"]["load"]["active_sessions"] for p in view["peers"]]
                if not any(loads):
                    break
                await trio.sleep(0.5)
        return view

    return trio.run(fetch)
