"""A three-node loopback mesh serving the default model, the first node with the HTTP API.

Builds on the discovery tests' process helpers (``NodeFactory``: real
processes, reaped whatever happens).
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.integration.discovery.discovery_nodes import SECRET, NodeFactory, NodeProc, wait_for
from tests.integration.node.inprocess_mesh import free_port

# Each node offers this much memory: the model (~0.54 GB of fp32 weights plus the
# KV budget) needs all three, so the planner splits it three ways. The nodes hold
# float32 for that reason, not the default (the default model's own int4 fits two;
# tests/integration/node/test_mesh_weights.py serves the compact formats).
NODE_MEMORY = "500MiB"
WEIGHTS = "float32"


def serve_args(max_sessions: int = 4, memory: str = NODE_MEMORY) -> tuple[str, ...]:
    return (
        "--serve",  # after the helper's --no-serve: the last one wins
        "--no-mdns",
        "--max-memory",
        memory,
        "--max-sessions",
        str(max_sessions),
        "--weights",
        WEIGHTS,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        # announce a block step rather than calibrate (~1.2 CPU-s a node): nothing the
        # shared mesh's tests assert reads it, and three nodes of 500 MiB split the
        # model three ways whatever the step
        "--block-step-ms",
        "2",
    )


@dataclass
class Mesh:
    nodes: list[NodeProc]
    api_url: str

    @property
    def addr(self) -> str:
        return self.nodes[0].addr

    def logs(self) -> str:
        return "\n".join(f"--- {n.log_path.name}\n{n.log()[-4000:]}" for n in self.nodes)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running_mesh(
    tmp_path: Path, *, count: int = 3, max_sessions: int = 4, memory: str = NODE_MEMORY
) -> Iterator[Mesh]:
    """``count`` serving nodes; the first serves the API. Yields once /health is ready."""
    factory = NodeFactory(tmp_path)
    try:
        port = free_port()
        args = serve_args(max_sessions, memory)
        first = factory.start(*args, "--api-port", str(port)).wait_ready(120)
        others = [factory.start(*args, "--bootstrap", first.addr) for _ in range(count - 1)]
        nodes = [first, *(n.wait_ready(120) for n in others)]
        mesh = Mesh(nodes, f"http://127.0.0.1:{port}")
        try:
            wait_for(lambda: _healthy(mesh.api_url), 120, "a ready pipeline", every_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{mesh.logs()}") from None
        yield mesh
    finally:
        factory.close()


__all__ = ["SECRET", "WEIGHTS", "Mesh", "free_port", "running_mesh", "serve_args", "wait_for"]
