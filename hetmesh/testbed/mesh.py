"""A mesh of real ``hetmesh node start`` processes on emulated heterogeneous hosts.

Built on :func:`hetmesh.testbed.netns.open_testbed` (namespaces on a bridge, ``tc tbf`` per
link, a CPU quota and memory limit per host in cgroup v1 or v2). :func:`open_mesh_testbed`
starts one serving node per host (the first listens first, the others
bootstrap to it), and gives a :class:`MeshTestbed` to wait for the plan, read
the status view and run generations from inside a host's namespace (the
nodes listen on the bridge's private subnet, unreachable from outside).

Used by the pytest fixtures in ``tests/integration/testbed/`` and by
``bench/testbed.py`` and ``bench/hetero.py``. Everything is torn down on exit,
also on failure: node processes (killed by PID), cgroups, namespaces.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hetmesh.testbed.agent import HostAgent, HostAgents
from hetmesh.testbed.cgroups import CPU, MEMORY
from hetmesh.testbed.local_mesh import LocalNode, node_argv
from hetmesh.testbed.netns import NetnsTestbed, Spawn, open_testbed, unavailable_reason

if TYPE_CHECKING:
    from hetmesh.scheduler.records import Plan

T = TypeVar("T")

# the folder holding this hetmesh package: node processes get it first on PYTHONPATH, so
# they run the very code that started them (a checkout's, not an installed copy's)
REPO = Path(__file__).resolve().parents[2]
PORT = 4001
SECRET = "testbed-secret"
CPU_PERIOD_US = 100_000


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One emulated host: CPU share (1.0 = one core), memory, link rate, node flags."""

    cpu: float | None = None  # cgroup quota as a fraction of one core; None: no quota
    memory_limit_bytes: int | None = None  # cgroup memory limit; None: no limit
    rate: str | None = None  # tc tbf rate of its access link, e.g. "50mbit"
    delay_s: float | None = None  # what each frame waits on its access link, each way
    max_memory: str | None = None  # --max-memory: what the node offers to the planner
    args: tuple[str, ...] = ()
    # the node's data-plane backends in preference order; empty: the node's default, so
    # links negotiate as between real hosts (direct TCP to the peer's bridge address,
    # through each host's shaped link); ("libp2p",) for a test that wants the fallback
    backends: tuple[str, ...] = ()


def why_no_testbed() -> str | None:
    """Why this machine cannot run the testbed (for ``pytest.skip``), or None."""
    return unavailable_reason(need_cgroups=True, need_tc=True, cgroup_needs=(CPU, MEMORY))


def wait_for(
    predicate: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.25
) -> T:
    """Poll ``predicate`` until truthy; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def launch(
    argv: Sequence[str],
    log_path: Path,
    placement: Any,
    popen: Callable[..., subprocess.Popen[Any]],
    spawn: Spawn | None,
) -> Any:
    """Start a node process in a testbed host, its output appended to ``log_path``:
    through ``spawn`` where one is given and takes it, else ``popen`` (the host's)."""
    with log_path.open("ab") as log_file:
        kwargs: dict[str, Any] = {
            "stdout": log_file,
            "stderr": subprocess.STDOUT,
            "env": child_env(),
            "cwd": str(REPO),
        }
        proc = spawn(argv, placement, kwargs) if spawn else None
        return proc if proc is not None else popen(argv, **kwargs)


def child_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("HETMESH_MESH_SECRET", None)
    env["OMP_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


@dataclass
class MeshNode(LocalNode):
    host: int = -1  # the testbed host (namespace) it runs in

    def wait_up(self, timeout_s: float) -> MeshNode:
        """Until ``node.json`` appears (listening, profiled, serving started)."""
        info_file = self.data_dir / "node.json"

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"node on host {self.host} exited with {self.proc.returncode}:\n"
                    + self.log()[-4000:]
                )
            return info_file.exists()

        wait_for(up, timeout_s, f"the node on host {self.host} to start")
        self.info = json.loads(info_file.read_text())
        return self


@dataclass
class MeshTestbed:
    """Running nodes on a :class:`~hetmesh.testbed.netns.NetnsTestbed`; see the module doc."""

    net: NetnsTestbed
    specs: tuple[HostSpec, ...]
    workdir: Path
    secret: str
    nodes: list[MeshNode] = field(default_factory=list)
    agents: HostAgents | None = None
    # how a node starts on a host (None: ``nsenter`` and a new interpreter, as users do;
    # the tests fork theirs from a server that has done the imports)
    spawn: Spawn | None = None

    # -- processes ----------------------------------------------------------------

    def start_node(self, host: int, *args: str, bootstrap: str | None = None) -> MeshNode:
        spec = self.specs[host]
        data_dir = self.workdir / f"h{host}"
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "node.json").unlink(missing_ok=True)
        config = data_dir / "node.toml"
        # the node's data plane listens on its --listen address (the bridge's subnet),
        # which every other host reaches: only the backends a spec asks for are forced
        config.write_text(
            f"backends = {json.dumps(list(spec.backends))}\n" if spec.backends else ""
        )
        argv = node_argv(
            data_dir,
            f"/ip4/{self.net.hosts[host].ip}/tcp/{PORT}",
            *("--config", str(config), "--mesh-secret", self.secret),
            # the testbed's hosts share this machine's cores (and OMP_NUM_THREADS)
            *("--threads", "1"),
        )
        if spec.max_memory:
            argv += ["--max-memory", spec.max_memory]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        argv += [*spec.args, *args]
        log_path = self.workdir / f"h{host}.log"
        place = self.net.placement(host) if self.spawn else None  # only a spawn asks
        popen = functools.partial(self.net.popen, host)
        proc = launch(argv, log_path, place, popen, self.spawn)
        node = MeshNode(proc, data_dir, log_path, host=host)
        self.nodes.append(node)
        return node

    def start_all(self, *args: str, timeout_s: float = 120.0) -> list[MeshNode]:
        """One node per host; host 0 first (the others bootstrap to it)."""
        first = self.start_node(0, *args).wait_up(timeout_s)
        rest = [
            self.start_node(h, *args, bootstrap=f"{first.addr}") for h in range(1, len(self.specs))
        ]
        for node in rest:
            node.wait_up(timeout_s)
        return [first, *rest]

    def stop_nodes(self) -> None:
        """Kill every node (by PID) and forget them: the hosts stay for a new mesh."""
        for node in self.nodes:
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        self.nodes.clear()

    # -- talking to the mesh from inside a host -----------------------------------

    def agent(self, host: int) -> HostAgent:
        """The long-lived helper that asks the mesh from inside host ``host``."""
        if self.agents is None:
            self.agents = HostAgents(self.net.argv, env=child_env(), cwd=REPO)
        return self.agents(host, f"host {host}")

    def status(self, node: int = 0, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """``hetmesh status --json`` as seen by node ``node``, asked from inside its host."""
        target = self.nodes[node]
        return self.agent(target.host).status(target.addr, self.secret, timeout_s=timeout_s)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        node: int = 0,
        repeat: int = 1,
        timeout_s: float = 300.0,
    ) -> list[dict[str, Any]]:
        """Greedy generations entering at node ``node``; see ``hetmesh/testbed/client.py``."""
        target = self.nodes[node]
        return self.agent(target.host).generate(
            target.addr,
            self.secret,
            prompt_ids,
            max_new_tokens,
            repeat=repeat,
            timeout_s=timeout_s,
        )

    def wait_serving(self, timeout_s: float = 240.0) -> dict[str, Any]:
        """Until a plan is adopted and every stage of it is ready; its status view."""
        from hetmesh.scheduler.records import Plan

        def ready() -> dict[str, Any] | None:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(
                        f"node on host {node.host} exited with {node.proc.returncode}:\n"
                        + node.log()[-4000:]
                    )
            try:
                view = self.status()
            except (RuntimeError, subprocess.TimeoutExpired, ValueError):
                return None
            plan = plan_of(view)
            if plan is None:
                return None
            ready_stages = {
                (p["peer_id"], int(st["start"]), int(st["end"]))
                for p in view["peers"]
                for st in (p.get("record") or {}).get("stages") or ()
                if st.get("ready")
            }
            want = {(s.peer_id, s.start, s.end) for s in plan.pipelines[0].stages}
            return view if want <= ready_stages else None

        view: dict[str, Any] = wait_for(ready, timeout_s, "the mesh to serve", every_s=1.0)
        assert isinstance(plan_of(view), Plan)
        return view

    def peer_host(self) -> dict[str, int]:
        """peer id -> host index."""
        return {n.peer_id: n.host for n in self.nodes}


MakeTestbed = Callable[[Sequence[HostSpec]], MeshTestbed]  # the ``mesh_testbed`` fixture


def plan_of(view: dict[str, Any]) -> Plan | None:
    """The newest plan followed in a status view (a ``Plan``), or None."""
    from hetmesh.scheduler.replan import newest_in_view

    return newest_in_view(view)


def devices_of(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """peer id -> its CPU device record (measured FLOP/s, memory) in a status view."""
    out = {}
    for peer in view.get("peers", []):
        devices = (peer.get("record") or {}).get("devices") or []
        if devices:
            out[str(peer["peer_id"])] = devices[0]
    return out


@contextlib.contextmanager
def open_mesh_testbed(
    workdir: Path, specs: Sequence[HostSpec], *, secret: str | None = None
) -> Iterator[MeshTestbed]:
    """Hosts per ``specs`` (no nodes yet: call ``start_all``); all torn down after."""
    rates = {i: s.rate for i, s in enumerate(specs) if s.rate}
    quotas = {i: int(s.cpu * CPU_PERIOD_US) for i, s in enumerate(specs) if s.cpu}
    mems = {i: s.memory_limit_bytes for i, s in enumerate(specs) if s.memory_limit_bytes}
    delays = {i: s.delay_s for i, s in enumerate(specs) if s.delay_s}
    with open_testbed(
        len(specs), rates=rates, cpu_quota_us=quotas, memory_limit_bytes=mems, delays_s=delays
    ) as net:
        bed = MeshTestbed(net, tuple(specs), workdir, secret or f"{SECRET}-{secrets.token_hex(4)}")
        try:
            yield bed
        finally:
            if bed.agents is not None:
                bed.agents.close()
            bed.stop_nodes()


__all__ = [
    "HostSpec",
    "MakeTestbed",
    "MeshNode",
    "MeshTestbed",
    "child_env",
    "devices_of",
    "open_mesh_testbed",
    "plan_of",
    "wait_for",
    "why_no_testbed",
]
