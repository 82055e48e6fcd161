"""Real ``hetmesh node start`` processes on the NAT testbed (:mod:`hetmesh.testbed.nat`).

:func:`open_nat_mesh` builds the public host and the homes, and gives a
:class:`NatMesh` that starts a node in any of them (listening on the host's
own address: a home node's is private, behind its router), reads
``hetmesh status --json`` from inside a host, and tears everything down —
node processes killed by PID, then the namespaces — also on failure.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import subprocess
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetmesh.testbed.agent import HostAgent, HostAgents
from hetmesh.testbed.local_mesh import node_argv
from hetmesh.testbed.mesh import PORT, REPO, MeshNode, child_env, launch, plan_of, wait_for
from hetmesh.testbed.nat import NatHost, NatTestbed, open_nat_testbed
from hetmesh.testbed.netns import Spawn

if TYPE_CHECKING:
    from hetmesh.scheduler.records import Plan


@dataclass
class NatMesh:
    bed: NatTestbed
    workdir: Path
    secret: str
    nodes: list[MeshNode] = field(default_factory=list)
    agents: HostAgents | None = None
    spawn: Spawn | None = None  # how a node starts on a host (as MeshTestbed.spawn)

    def start_node(self, host: NatHost, *args: str, bootstrap: str | None = None) -> MeshNode:
        """``hetmesh node start`` in ``host`` (not waited for: see ``MeshNode.wait_up``)."""
        index = self.bed.hosts.index(host)
        data_dir = self.workdir / host.name
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "node.json").unlink(missing_ok=True)
        argv = node_argv(
            data_dir,
            f"/ip4/{host.ip}/tcp/{PORT}",
            *("--mesh-secret", self.secret),
            # the testbed's hosts share this machine's cores (and OMP_NUM_THREADS)
            *("--threads", "1", *args),
        )
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        log_path = self.workdir / f"{host.name}.log"
        place = self.bed.placement(host) if self.spawn else None  # only a spawn asks
        popen = functools.partial(self.bed.popen, host)
        proc = launch(argv, log_path, place, popen, self.spawn)
        node = MeshNode(proc, data_dir, log_path, host=index)
        self.nodes.append(node)
        return node

    def agent(self, host: NatHost) -> HostAgent:
        """The long-lived helper that asks the mesh from inside ``host``."""
        if self.agents is None:
            self.agents = HostAgents(self.bed.argv, env=child_env(), cwd=REPO)
        return self.agents(host, host.name)

    def status(self, host: NatHost, node: MeshNode, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """``hetmesh status --json`` of ``node``, asked from inside ``host``."""
        return self.agent(host).status(node.addr, self.secret, timeout_s=timeout_s)

    def generate(
        self,
        host: NatHost,
        node: MeshNode,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        timeout_s: float = 300.0,
    ) -> dict[str, Any]:
        """One greedy generation entering at ``node``, from inside ``host``
        (``hetmesh/testbed/client.py``): ``tokens``, ``times_s``... or ``error``."""
        try:
            (result,) = self.agent(host).generate(
                node.addr, self.secret, prompt_ids, max_new_tokens, timeout_s=timeout_s
            )
        except RuntimeError as exc:
            return {"error": str(exc)}
        return result

    def wait_serving(
        self, host: NatHost, node: MeshNode, *, timeout_s: float = 300.0
    ) -> tuple[Plan, dict[str, Any]]:
        """Until ``node``'s view holds a plan whose every stage is ready: the plan, the view."""

        def ready() -> tuple[Plan, dict[str, Any]] | None:
            view = self.status(host, node)
            plan = plan_of(view)
            if plan is None:
                return None
            served = {
                (str(p["peer_id"]), int(st["start"]), int(st["end"]))
                for p in view["peers"]
                for st in (p.get("record") or {}).get("stages") or ()
                if st.get("ready")
            }
            stages = {(s.peer_id, s.start, s.end) for s in plan.pipelines[0].stages}
            return (plan, view) if stages <= served else None

        return wait_for(ready, timeout_s, "the mesh to serve", every_s=2.0)


@contextlib.contextmanager
def open_nat_mesh(
    workdir: Path, homes: int = 2, *, symmetric: Collection[int] = (), rate: str | None = None
) -> Iterator[NatMesh]:
    """A NAT testbed (see :func:`open_nat_testbed`) to start nodes on; all torn down after."""
    with open_nat_testbed(homes, symmetric=symmetric, rate=rate) as bed:
        mesh = NatMesh(bed, workdir, f"nat-{secrets.token_hex(4)}")
        try:
            yield mesh
        finally:
            if mesh.agents is not None:
                mesh.agents.close()
            for node in mesh.nodes:  # started by a spawn hook, the testbed does not know them
                if node.proc.poll() is None:
                    node.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(timeout=10)


__all__ = ["NatMesh", "open_nat_mesh"]
