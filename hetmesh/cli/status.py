"""``hetmesh status --mesh ADDR``: ask any node for its view of the mesh.

Peers (devices, memory, FLOP/s, health), the link matrix, the plan (stages,
predicted against measured step times, the bottleneck highlighted) and the
load (sessions, queue, tokens/s from two views a moment apart). ``--json``
prints the raw view plus that summary; ``--watch`` refreshes in place.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table

from hetmesh.cli._app import app
from hetmesh.cli.status_view import kv_table, load_table, plan_table, summarize
from hetmesh.nat.reachability import link_kind, reach_text
from hetmesh.scheduler.announcement import read_serving

# columns of a status printed to a pipe or a file (a terminal uses its own width)
PIPE_WIDTH = 200


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def _bytes(value: float) -> str:
    for factor, prefix in ((1 << 40, "Ti"), (1 << 30, "Gi"), (1 << 20, "Mi"), (1 << 10, "Ki")):
        if value >= factor:
            return f"{value / factor:.1f} {prefix}B"
    return f"{value:.0f} B"


def short_id(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 12 else f"…{peer_id[-8:]}"


def _host_of(record: dict[str, Any]) -> str:
    for addr in record.get("addrs") or ():
        parts = str(addr).split("/")
        if len(parts) > 4:
            return f"{parts[2]}:{parts[4]}"
    return "?"


def memory_texts(record: dict[str, Any], devices: list[dict[str, Any]]) -> tuple[str, str]:
    """(used, charged) of a node: the memory it really uses (RSS, or its own cgroup's
    usage) and what the plan charged it plus the runtime the plan does not charge (its
    record's ``memory`` entry, :mod:`hetmesh.node.memory`); a node announcing none:
    its devices' total less free, and "-"."""
    extra = record.get("extra") or {}
    memory = extra.get("memory") if isinstance(extra, dict) else None
    if not isinstance(memory, dict):
        used = ", ".join(
            _bytes(d.get("memory_total_bytes", 0) - d.get("memory_free_bytes", 0)) for d in devices
        )
        return used, "-"
    source = str(memory.get("source", "rss"))
    used = f"{_bytes(int(memory.get('in_use', 0)))} ({source})"
    charged = int(memory.get("charged", 0))
    runtime = int(memory.get("runtime", 0))
    return used, f"{_bytes(charged)} + {_bytes(runtime)} runtime"


def status_renderable(view: dict[str, Any]) -> Group:
    """The peers table and the link matrix for a status view (pure)."""
    peers = Table(title=f"mesh seen from {short_id(str(view.get('self', '?')))}")
    for col in (
        "peer",
        "host",
        "health",
        "reach",
        "devices",
        "weights",
        "memory used",
        "plan charged",
        "memory free/total",
        "FLOP/s",
        "mem BW",
    ):
        peers.add_column(col)
    ids: list[str] = []
    records: dict[str, dict[str, Any]] = {}
    for peer in view.get("peers", []):
        record = peer.get("record") or {}
        pid = str(peer.get("peer_id", "?"))
        ids.append(pid)
        records[pid] = record
        devices = record.get("devices") or []
        peers.add_row(
            short_id(pid),
            _host_of(record),
            str(peer.get("health", "?")),
            reach_text(record),
            ", ".join(str(d.get("device", "?")) for d in devices) or "(profiling)",
            read_serving(record.get("extra"), plan_of=None).weights or "-",
            *memory_texts(record, devices),
            ", ".join(
                f"{_bytes(d.get('memory_free_bytes', 0))}/{_bytes(d.get('memory_total_bytes', 0))}"
                for d in devices
            ),
            ", ".join(_si(float(d.get("matmul_flops", 0.0)), "FLOP/s") for d in devices),
            ", ".join(_si(float(d.get("memory_bandwidth_bps", 0.0)), "B/s") for d in devices),
        )
    links = {(str(lk["src"]), str(lk["dst"])): lk for lk in view.get("links", [])}
    estimated = {(str(lk["src"]), str(lk["dst"])): lk for lk in view.get("estimated_links", [])}
    matrix = Table(
        title="links (row → column): RTT, bandwidth",
        caption="measured by the row's peer; ≈ estimated from a measured link on the same "
        "host or subnet; ? unknown; (relayed) through a relay; (hole-punched) direct "
        "through both NAT routers",
    )
    matrix.add_column("from \\ to")
    for pid in ids:
        matrix.add_column(short_id(pid))
    for src in ids:
        cells = []
        for dst in ids:
            link = links.get((src, dst))
            mark = ""
            if link is None and (src, dst) in estimated:
                link, mark = estimated[(src, dst)], "≈ "
            if src == dst:
                cells.append("-")
            elif link is None:
                cells.append("?")
            else:
                rtt_ms = float(link["rtt_s"]) * 1e3
                bandwidth = _si(float(link["bandwidth_bps"]), "B/s")
                cells.append(f"{mark}{rtt_ms:.2f} ms, {bandwidth}")
            kind = "direct" if src == dst else link_kind(src, records[src], dst, records[dst])
            if kind != "direct":
                cells[-1] += f" ({kind})"
        matrix.add_row(short_id(src), *cells)
    summary = view.get("summary")
    if not isinstance(summary, dict):
        summary = summarize(view)
    return Group(peers, matrix, plan_table(summary), load_table(summary), kv_table(summary))


def render_status(view: dict[str, Any], *, width: int = 160) -> str:
    """The status view as plain text (pure; used by tests and ``--plain``)."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(status_renderable(view))
    return console.export_text()


async def sample_view(
    addr: str, *, mesh_secret: str | None, timeout_s: float, interval_s: float
) -> dict[str, Any]:
    """Two views ``interval_s`` apart over one connection; the second with its summary."""
    import trio

    from hetmesh.client.mesh import open_mesh_client
    from hetmesh.errors import InvalidRequest

    try:
        client_cm = open_mesh_client(addr, mesh_secret=mesh_secret, timeout_s=timeout_s)
        async with client_cm as client:
            first = await client.status(timeout_s)
            began = trio.current_time()
            if interval_s <= 0:
                return {**first, "summary": summarize(first)}
            await trio.sleep(interval_s)
            second = await client.status(timeout_s)
            elapsed = trio.current_time() - began
            return {**second, "summary": summarize(second, first, elapsed)}
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from exc


async def watch(
    addr: str, *, mesh_secret: str | None, timeout_s: float, interval_s: float, console: Console
) -> None:
    """Redraw the status in place every ``interval_s`` until SIGINT or SIGTERM.

    The first signal cancels the loop (a clean exit through every ``finally``)
    instead of raising KeyboardInterrupt wherever the process happens to be,
    which can land inside the libp2p host's own tasks; a second one exits at
    once. Piped output is written from a worker thread, so a reader that
    stopped reading (a full pipe) cannot keep the signal from being handled.
    """
    import os
    import signal

    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            work = trio.CancelScope()

            async def on_signals() -> None:
                async for _ in signals:
                    if work.cancel_called:
                        os._exit(130)  # asked twice: do not wait for a clean exit
                    work.cancel()

            nursery.start_soon(on_signals)
            with work:
                await _redraw(addr, mesh_secret, timeout_s, interval_s, console)
            nursery.cancel_scope.cancel()


async def _redraw(
    addr: str, mesh_secret: str | None, timeout_s: float, interval_s: float, console: Console
) -> None:
    import trio
    from rich.live import Live

    from hetmesh.client.mesh import open_mesh_client

    async def append(view: dict[str, Any]) -> None:
        def write() -> None:
            console.print(status_renderable(view))
            console.file.flush()

        await trio.to_thread.run_sync(write, abandon_on_cancel=True)  # type: ignore[call-arg]

    async with open_mesh_client(addr, mesh_secret=mesh_secret, timeout_s=timeout_s) as client:
        previous = await client.status(timeout_s)
        last = trio.current_time()
        view = {**previous, "summary": summarize(previous)}
        if not console.is_terminal:  # piped: append each view instead of redrawing
            await append(view)
        with contextlib.ExitStack() as stack:
            live = None
            if console.is_terminal:
                live = stack.enter_context(
                    Live(status_renderable(view), console=console, auto_refresh=False)
                )
            while True:
                await trio.sleep(interval_s)
                current = await client.status(timeout_s)
                now = trio.current_time()
                view = {**current, "summary": summarize(current, previous, now - last)}
                previous, last = current, now
                if live is not None:
                    live.update(status_renderable(view), refresh=True)
                else:
                    await append(view)


@app.command()
def status(
    mesh: Annotated[str, typer.Option(help="Any node's multiaddr, with /p2p/PEER_ID.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw view as JSON.")] = False,
    mesh_secret: Annotated[str | None, typer.Option(envvar="HETMESH_MESH_SECRET")] = None,
    mesh_secret_file: Annotated[Path | None, typer.Option()] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the node.")] = 5.0,
    watch_: Annotated[
        bool, typer.Option("--watch", help="Refresh in place until interrupted.")
    ] = False,
    interval: Annotated[
        float, typer.Option(help="Seconds between the views that tokens/s is measured over.")
    ] = 1.0,
    width: Annotated[int | None, typer.Option(help="Render this many columns wide.")] = None,
) -> None:
    """Print the peers, links, plan and load as one node sees them."""
    import trio

    from hetmesh.cli.node import first_mesh_error, resolve_secret
    from hetmesh.discovery.host import configure_libp2p_logging

    configure_libp2p_logging()
    secret = resolve_secret(mesh_secret, mesh_secret_file)
    if width is None and not sys.stdout.isatty():
        width = PIPE_WIDTH  # piped or captured: never squeeze a column out of the text
    console = Console(width=width) if width else Console()
    try:
        if watch_:
            with contextlib.suppress(KeyboardInterrupt):
                trio.run(
                    lambda: watch(
                        mesh,
                        mesh_secret=secret,
                        timeout_s=timeout,
                        interval_s=max(interval, 0.2),
                        console=console,
                    )
                )
            return
        view = trio.run(
            lambda: sample_view(mesh, mesh_secret=secret, timeout_s=timeout, interval_s=interval)
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mesh") from exc
    except BaseExceptionGroup as group:
        found = first_mesh_error(group)
        if found is None:
            raise
        raise found from None
    if as_json:
        typer.echo(json.dumps(view, indent=1, default=str))
    else:
        console.print(status_renderable(view))
