"""``hetmesh demo``: a three-node mesh on this machine serving the default model.

The first node serves the HTTP API and the web dashboard on loopback; the demo
prints its URL. With ``--keep`` the mesh stays up after the demo's generation
until Ctrl-C (SIGINT) or SIGTERM, which stop every node.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from hetmesh.cli._app import app

# Each node offers this much memory, so no single node can hold the model and
# its KV budget in any format: the planner has to cut it across the nodes.
DEMO_NODE_MEMORY = "500MiB"
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
) -> None:
    """Start a local mesh, stream one chat generation through it, show its status, stop it."""
    from hetmesh.cli.model import _resolve, _stream_mesh
    from hetmesh.cli.status import render_status
    from hetmesh.node.local import local_mesh, wait_serving

    if weights not in WEIGHT_CHOICES:
        raise typer.BadParameter(
            f"{weights!r} is not one of {', '.join(WEIGHT_CHOICES)}", param_hint="--weights"
        )
    model_dir = _resolve("smollm2-135m-instruct", cache_dir)  # pull once, before the nodes
    args = ["--weights", weights, "--max-memory", DEMO_NODE_MEMORY, "--max-sessions", "4"]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    err = sys.stderr
    port = api_port or _free_port()
    url = f"http://127.0.0.1:{port}/"
    print(f"starting {nodes} nodes on loopback serving {model_dir.name} in {weights} ...", file=err)
    with local_mesh(nodes, node_args=args, per_node_args=[["--api-port", str(port)]]) as mesh:
        wait_serving(mesh)
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
