"""Helpers for the discovery tests: real node processes, reaped whatever happens."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from hetmesh.node.daemon import NodeConfig
from hetmesh.testbed.local_mesh import LocalNode

REPO = Path(__file__).resolve().parents[3]

SECRET = "integration-test-secret"


def node_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("HETMESH_MESH_SECRET", None)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "2")
    # as hetmesh.testbed.mesh.child_env sets it: the fork server serves both alike
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def node_argv(data_dir: Path, *args: str, secret: str | None = SECRET) -> list[str]:
    """``hetmesh node start`` argv; discovery-only (``--no-serve``) unless ``--serve`` is given."""
    serve = [] if "--serve" in args else ["--no-serve"]
    argv = [
        sys.executable,
        "-m",
        "hetmesh",
        "node",
        "start",
        *serve,
        "--threads",  # the suite's nodes share two cores (a later --threads wins)
        "1",
        "--data-dir",
        str(data_dir),
        *args,
    ]
    if secret is not None:
        argv += ["--mesh-secret", secret]
    return argv


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


# the least a node process is given to start (imports, model load): see NodeProc.wait_ready
READY_FLOOR_S = 240.0


class NodeProc(LocalNode):
    """A node process under test: waited for, signalled, stopped."""

    def wait_ready(self, timeout_s: float = 90.0) -> NodeProc:
        # a deadline only: the suite's xdist workers start meshes side by side, on a machine
        # that may carry other load, so no start-up gets less than READY_FLOOR_S
        timeout_s = max(timeout_s, READY_FLOOR_S)
        info_file = self.data_dir / "node.json"

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode}:\n{self.log()}")
            return info_file.exists()

        wait_for(ready, timeout_s, f"node in {self.data_dir} to be ready")
        self.info = json.loads(info_file.read_text())
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


_PROFILE_CACHE: list[str] = []


def measured_profile_cache() -> str:
    """A node's benchmark cache file (``profile-cache.json``), measured once per test process.

    Every node of the suite starts in a fresh data directory, so each would run the
    CPU benchmark (1.5 s of both cores) before it is ready; dozens of node starts made
    that minutes of the suite's CPU. Nodes given this file read this machine's
    figures as a restarted node does. The cache is keyed by the CPU allowance: a node
    in a CPU-limited namespace (the testbed) still measures its own.
    """
    if not _PROFILE_CACHE:
        import tempfile

        from hetmesh.discovery.profiling import CACHE_FILE, benchmark_cpu

        with tempfile.TemporaryDirectory() as folder:
            benchmark_cpu(Path(folder))
            _PROFILE_CACHE.append((Path(folder) / CACHE_FILE).read_text())
    return _PROFILE_CACHE[0]


_NODE_SERVER: list[Any] = []
# environment variables that the server's imports read (threads, paths, torch/HF settings)
_READ_AT_IMPORT = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
)


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)}


def node_server(env: dict[str, str]) -> Any:
    """This test process's fork server (tests/integration/node_server.py), started on
    first use with ``env``; None where nodes must start the ordinary way: the server
    could not fork safely (more than one thread after its imports), it has exited,
    ``env`` differs from the server's where an import reads it, or
    ``HETMESH_TEST_FORK=0`` asks for a new interpreter per node."""
    if os.environ.get("HETMESH_TEST_FORK", "1") == "0":
        return None
    if not _NODE_SERVER:
        import atexit

        from tests.integration.node_server import NodeServer

        server = NodeServer(str(REPO), env)
        atexit.register(server.close)
        _NODE_SERVER.append((server, dict(env)))
    server, server_env = _NODE_SERVER[0]
    if _import_env(env) != _import_env(server_env):
        return None
    return server if server.threads == 1 and server.alive() else None


def forked_spawn(argv: Sequence[str], placement: Any, kwargs: dict[str, Any]) -> Any:
    """A testbed's ``spawn`` (:data:`hetmesh.testbed.netns.Spawn`): the node forked from this
    test process's node server straight into the host (its network namespace and cgroups),
    or None (the testbed starts it with ``nsenter``) where the server cannot take it."""
    if list(argv[:3]) != [sys.executable, "-m", "hetmesh"]:
        return None
    server = node_server(kwargs["env"])
    if server is None:
        return None
    return server.start(
        list(argv[3:]),
        kwargs["stdout"].fileno(),
        kwargs["env"],
        netns=str(placement.netns),
        cgroups=tuple(str(c) for c in placement.cgroups),
    )


class NodeFactory:
    """Starts nodes (optionally through a testbed's ``popen``) and reaps them all.

    Nodes reuse one benchmark measured in the test process
    (:func:`measured_profile_cache`) unless ``measure`` is set: then each runs its own,
    as a first start in production does.

    A node started without ``popen`` is forked from this test process's node server
    (:func:`node_server`: its own process, only without a new interpreter's imports)
    unless ``exec_nodes`` is set: then each is a new ``python -m hetmesh node start``
    as users run it (the CLI tests).
    """

    def __init__(self, tmp_path: Path, *, measure: bool = False, exec_nodes: bool = False) -> None:
        self.tmp_path = tmp_path
        self.measure = measure
        self.exec_nodes = exec_nodes
        self.nodes: list[NodeProc] = []

    def start(
        self,
        *args: str,
        secret: str | None = SECRET,
        popen: Callable[..., subprocess.Popen[bytes]] | None = None,
        placement: Any = None,
        name: str | None = None,
        measure: bool | None = None,
    ) -> NodeProc:
        """Start a node; ``measure`` overrides the factory's choice for this one.

        ``placement`` (a testbed host's :class:`~hetmesh.testbed.netns.Placement`): the
        node is forked from the node server into that host, or started with ``popen``
        (the testbed's, which enters the host itself) where the server cannot take it.
        """
        name = name or f"node{len(self.nodes)}"
        data_dir = self.tmp_path / name
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "node.json").unlink(missing_ok=True)
        cache_file = data_dir / "profile-cache.json"
        if not (self.measure if measure is None else measure) and not cache_file.exists():
            cache_file.write_text(measured_profile_cache())
        log_path = self.tmp_path / f"{name}.log"
        argv = node_argv(data_dir, *args, secret=secret)
        log_file = log_path.open("ab")
        kwargs: dict[str, Any] = {
            "stdout": log_file,
            "stderr": subprocess.STDOUT,
            "env": node_env(),
            "cwd": str(REPO),
        }
        forkable = (popen is None or placement is not None) and not self.exec_nodes
        server = node_server(kwargs["env"]) if forkable else None
        if server is not None:
            # argv after `python -m hetmesh`; the child takes this environment whole
            proc: Any = server.start(
                argv[3:],
                log_file.fileno(),
                kwargs["env"],
                netns=str(placement.netns) if placement else None,
                cgroups=tuple(str(c) for c in placement.cgroups) if placement else (),
            )
        elif popen:
            proc = popen(argv, **kwargs)
        else:
            proc = subprocess.Popen(argv, **kwargs)
        log_file.close()
        node = NodeProc(proc, data_dir, log_path)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.stop()


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_HEALTH = re.compile(r"INFO hetmesh\.discovery\.service: peer (\S+): (\S+) -> (\S+)$")


def log_stamp(line: str) -> float | None:
    """The wall time a node's log line was written (its ``asctime``), or None."""
    m = _STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def log_time(node: LocalNode, needle: str, *, after: float = 0.0) -> float | None:
    """When ``node`` first logged a line containing ``needle`` at or after ``after``."""
    for line in node.log().splitlines():
        stamp = log_stamp(line)
        # stamps are truncated to the millisecond
        if stamp is not None and stamp >= after - 0.001 and needle in line:
            return stamp
    return None


def health_changes(node: LocalNode, peer_id: str, *, after: float = 0.0) -> list[tuple[float, str]]:
    """(wall time, new state) of every change ``node`` logged for ``peer_id`` since ``after``.

    The node's own record of when it judged the peer: no polling delay in it.
    """
    out = []
    for line in node.log().splitlines():
        m = _HEALTH.search(line)
        stamp = log_stamp(line)
        if m and stamp is not None and m.group(1) == peer_id and stamp >= after - 0.001:
            out.append((stamp, m.group(3)))
    return out


def wait_health(
    node: LocalNode, peer_id: str, states: set[str], *, after: float, timeout_s: float
) -> float:
    """Wait until ``node`` logs ``peer_id`` moving into one of ``states``; the log's time of it."""

    def changed() -> float | None:
        return next(
            (t for t, new in health_changes(node, peer_id, after=after) if new in states), None
        )

    stamp: float = wait_for(changed, timeout_s, f"{peer_id[-8:]} -> {states} in {node.log_path}")
    return stamp


def fetch_view(addr: str, *, secret: str | None = SECRET, timeout_s: float = 5.0) -> dict[str, Any]:
    """The status view of the node at ``addr``, fetched in-process (fast enough to poll)."""
    import trio

    from hetmesh.discovery.status import fetch_status

    async def go() -> dict[str, Any]:
        view: dict[str, Any] = await fetch_status(addr, mesh_secret=secret, timeout_s=timeout_s)
        return view

    return trio.run(go)


def health_map(view: dict[str, Any]) -> dict[str, str]:
    return {str(p["peer_id"]): str(p["health"]) for p in view["peers"]}


def status_json(addr: str, *, secret: str | None = SECRET, timeout_s: float = 20) -> dict[str, Any]:
    argv = [sys.executable, "-m", "hetmesh", "status", "--mesh", addr, "--json"]
    if secret is not None:
        argv += ["--mesh-secret", secret]
    out = subprocess.run(
        argv, capture_output=True, env=node_env(), cwd=str(REPO), timeout=timeout_s, check=True
    )
    view: dict[str, Any] = json.loads(out.stdout)
    return view


def run_status(
    argv_tail: Sequence[str], *, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "hetmesh", "status", *argv_tail]
    return subprocess.run(
        argv, capture_output=True, text=True, env=node_env(), cwd=str(REPO), timeout=timeout_s
    )


def in_process_config(tmp_path: Path, name: str, *bootstrap: str) -> NodeConfig:
    """A daemon for one trio run on loopback, discovery alone (a serving node would
    publish its own stages and plan)."""
    return NodeConfig(
        listen=("/ip4/127.0.0.1/tcp/0",),
        bootstrap=bootstrap,
        mesh_secret="in-process",
        mdns=False,
        data_dir=tmp_path / name,
        benchmark_budget_s=0.2,
        serving=None,
    )
