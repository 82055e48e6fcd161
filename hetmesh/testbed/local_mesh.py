"""A mesh of node processes on this machine's loopback: ``hetmesh demo`` and the benches.

Each node is a real ``hetmesh node start`` process with its own data
directory and logs; the first is the bootstrap peer of the others. Every
process is stopped (SIGTERM, then SIGKILL) when the block exits, whatever
happened inside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetmesh.discovery.profiling import CACHE_FILE
from hetmesh.errors import MeshError, RequestTimeout


@dataclass
class LocalNode:
    """A ``hetmesh node start`` process; ``info`` is its ``node.json`` once it is up."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return str(self.info["addrs"][0])

    @property
    def peer_id(self) -> str:
        return str(self.info["peer_id"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


@dataclass
class LocalMesh:
    nodes: list[LocalNode]
    secret: str
    root: Path

    @property
    def addr(self) -> str:
        return self.nodes[0].addr


def node_argv(data_dir: Path, listen: str, *args: str) -> list[str]:
    """The command line of a ``hetmesh node start`` process keeping its state in
    ``data_dir``, listening on ``listen`` (a multiaddr), with mDNS off, then ``args``
    (every harness here and in the testbed starts its nodes so)."""
    return [
        sys.executable,
        *("-m", "hetmesh", "node", "start"),
        *("--data-dir", str(data_dir), "--listen", listen, "--no-mdns"),
        *args,
    ]


def _wait_info(node: LocalNode, timeout_s: float) -> None:
    info_file = node.data_dir / "node.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise MeshError(
                f"node in {node.data_dir} exited with {node.proc.returncode}:\n{node.log_tail()}"
            )
        if info_file.exists():
            node.info = json.loads(info_file.read_text())
            return
        time.sleep(0.1)
    raise RequestTimeout(f"node in {node.data_dir} did not start in {timeout_s:.0f} s")


def _benchmark_of(node: LocalNode) -> str | None:
    """A started node's CPU benchmark cache (stored before it wrote ``node.json``), for
    the others to start from; None if it stored none.

    The nodes share this machine's cores: one benchmark is this machine's figure, where
    nodes measuring at once would each see part of the machine, and each would spend
    1.5 s of every core on it.
    """
    with contextlib.suppress(OSError):
        return (node.data_dir / CACHE_FILE).read_text() or None
    return None


def _start(
    root: Path, name: str, args: Sequence[str], secret: str, benchmark: str | None = None
) -> LocalNode:
    data_dir = root / name
    data_dir.mkdir(parents=True, exist_ok=True)
    if benchmark is not None:
        (data_dir / CACHE_FILE).write_text(benchmark)
    log_path = root / f"{name}.log"
    argv = node_argv(data_dir, "/ip4/127.0.0.1/tcp/0", "--serve", *args)
    env = dict(os.environ, HETMESH_MESH_SECRET=secret)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    return LocalNode(proc, data_dir, log_path)


def _stop(nodes: Sequence[LocalNode], grace_s: float = 10.0) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGCONT)
                node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for node in nodes:
        try:
            node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


def ready_pipelines(view: dict[str, Any]) -> int:
    """Pipelines of the newest plan in a status view whose every stage is ready."""
    from hetmesh.node.peer_view import ready_pipelines_in_view

    return len(ready_pipelines_in_view(view))


def wait_serving(
    mesh: LocalMesh, *, pipelines: int = 1, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Block until the first node sees ``pipelines`` ready pipelines; its view then."""
    return _poll(mesh, lambda view: ready_pipelines(view) >= pipelines, timeout_s, "serve")


def wait_settled(
    mesh: LocalMesh, *, quiet_s: float = 3.0, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Block until every pipeline of the newest plan is ready and that plan has been
    the newest for ``quiet_s``: standby replicas loaded, no stage loading any more
    (a benchmark measured meanwhile would share the cores with the loads)."""
    from hetmesh.scheduler.replan import newest_in_view

    last: tuple[int, tuple[str, ...]] | None = None  # the ready plan last seen ...
    since = 0.0  # ... and since when

    def settled(view: dict[str, Any]) -> bool:
        nonlocal last, since
        plan = newest_in_view(view)
        key = None
        if plan is not None and ready_pipelines(view) == len(plan.pipelines):
            key = (plan.epoch, tuple(p.key for p in plan.pipelines))
        if key != last:
            last, since = key, time.monotonic()
        return key is not None and time.monotonic() - since >= quiet_s

    return _poll(mesh, settled, timeout_s, "settle")


def _poll(
    mesh: LocalMesh, done: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
) -> dict[str, Any]:
    """The first node's status view, every half second, until ``done`` says so."""
    import trio

    from hetmesh.discovery.status import fetch_status

    deadline = time.monotonic() + timeout_s
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for node in mesh.nodes:
            if node.proc.poll() is not None:
                raise MeshError(f"a node exited with {node.proc.returncode}:\n{node.log_tail()}")
        with contextlib.suppress(MeshError, OSError):
            view = trio.run(lambda: fetch_status(mesh.addr, mesh_secret=mesh.secret))
            if done(view):
                return view
        time.sleep(0.5)
    raise RequestTimeout(f"the local mesh did not {what} within {timeout_s:.0f} s")


def share_threads(nodes: int) -> int:
    """Torch threads of each of ``nodes`` nodes on this host: its cores split evenly,
    at least one each."""
    from hetmesh.node.config import default_threads

    return max(1, default_threads() // max(1, nodes))


@contextlib.contextmanager
def local_mesh(
    count: int = 3,
    *,
    node_args: Sequence[str] = (),
    per_node_args: Sequence[Sequence[str]] = (),
    root: Path | None = None,
    start_timeout_s: float = 120.0,
) -> Iterator[LocalMesh]:
    """``count`` serving nodes on loopback, bootstrapped from the first one."""
    secret = secrets.token_hex(16)
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hetmesh-")))
        nodes: list[LocalNode] = []
        try:
            extra = list(per_node_args) + [()] * count
            if "--threads" not in node_args:  # the host's cores, shared by its nodes
                node_args = [*node_args, "--threads", str(share_threads(count))]
            first = _start(root, "node1", [*node_args, *extra[0]], secret)
            nodes.append(first)
            _wait_info(first, start_timeout_s)
            benchmark = _benchmark_of(first)
            for i in range(1, count):
                args = [*node_args, *extra[i], "--bootstrap", first.addr]
                nodes.append(_start(root, f"node{i + 1}", args, secret, benchmark))
            for node in nodes[1:]:
                _wait_info(node, start_timeout_s)
            yield LocalMesh(nodes, secret, root)
        finally:
            _stop(nodes)


__all__ = [
    "LocalMesh",
    "LocalNode",
    "local_mesh",
    "node_argv",
    "ready_pipelines",
    "share_threads",
    "wait_serving",
]
