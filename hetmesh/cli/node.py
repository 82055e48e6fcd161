"""``hetmesh node start``: run a node until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path
from typing import Annotated, Any

import trio
import typer

from hetmesh.cli._app import app
from hetmesh.errors import MeshError

node_app = typer.Typer(help="Run a mesh node.", no_args_is_help=True)
app.add_typer(node_app, name="node")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def parse_size(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512M"``, ``"1000000"``; ``ValueError`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (try 8GiB, 512M or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def resolve_secret(secret: str | None, secret_file: Path | None) -> str | None:
    if secret_file is not None:
        return secret_file.read_text().strip()
    return secret


def first_mesh_error(exc: BaseException) -> MeshError | None:
    """The first MeshError inside a (possibly nested) exception group."""
    if isinstance(exc, MeshError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_mesh_error(inner)
            if found is not None:
                return found
    return None


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from hetmesh.discovery.host import configure_libp2p_logging

    configure_libp2p_logging(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger().handlers[0].addFilter(
        lambda r: "Error getting transport addresses" not in r.getMessage()
    )


async def _run_until_signal(config: object) -> None:
    """Run the node; the first SIGINT/SIGTERM stops it gracefully, a second one at once."""
    from hetmesh.node.daemon import Node, NodeConfig, run_node

    assert isinstance(config, NodeConfig)
    log = logging.getLogger("hetmesh.node")
    running: list[Node] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def node_main(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                await run_node(config, task_status=task_status)
                nursery.cancel_scope.cancel()

            async def watch_signals() -> None:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    if running and not running[0].stop_requested.is_set():
                        running[0].request_stop()
                    else:
                        nursery.cancel_scope.cancel()

            nursery.start_soon(watch_signals)
            running.append(await nursery.start(node_main))


@node_app.command("start")
def start(
    listen: Annotated[
        list[str] | None, typer.Option(help="Multiaddr to listen on (repeatable).")
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Peer multiaddr with /p2p/ID (repeatable).")
    ] = None,
    mesh_secret: Annotated[
        str | None, typer.Option(envvar="HETMESH_MESH_SECRET", help="Shared secret of the mesh.")
    ] = None,
    mesh_secret_file: Annotated[
        Path | None, typer.Option(help="File holding the mesh secret.")
    ] = None,
    no_mdns: Annotated[bool, typer.Option("--no-mdns", help="Do not use mDNS discovery.")] = False,
    data_dir: Annotated[Path | None, typer.Option(help="Identity and caches live here.")] = None,
    max_memory: Annotated[
        str | None, typer.Option(help="Cap the memory this node offers, e.g. 8GiB.")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Only offer this torch device (cpu, cuda:0).")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a node: host, discovery, profiling, announcements, liveness."""
    from hetmesh.node.daemon import NodeConfig, default_data_dir

    setup_logging(verbose)
    try:
        max_bytes = parse_size(max_memory) if max_memory else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-memory") from exc
    config = NodeConfig(
        listen=tuple(listen or ("/ip4/0.0.0.0/tcp/0",)),
        bootstrap=tuple(bootstrap or ()),
        mesh_secret=resolve_secret(mesh_secret, mesh_secret_file),
        mdns=not no_mdns,
        data_dir=data_dir or default_data_dir(),
        max_memory_bytes=max_bytes,
        device=device,
    )
    try:
        trio.run(_run_until_signal, config)
    except BaseExceptionGroup as group:
        found = first_mesh_error(group)
        if found is None:
            raise
        raise found from None
    logging.getLogger("hetmesh.node").info("stopped")
