"""Serving daemons run inside a test's own trio run (``run_node``), for the node tests.

Real libp2p hosts, the real data plane and the real default model, but no
process per node: settings the CLI does not expose (the gateway's admission
wait, the idle-session limit) can be set short, and the test reads each
node's statistics directly. ``open_mesh(..., model=tiny_model_dir)`` serves the
tiny test model instead (tests/tiny_model.py), where the test is about a
mechanism rather than the default model's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from hetmesh.errors import MeshError
from hetmesh.node.config import ServingConfig
from hetmesh.node.control import OpenSession
from hetmesh.node.daemon import Node, NodeConfig, run_node
from hetmesh.protocol.generate import SamplingParams
from hetmesh.testbed.local_mesh import ready_pipelines

SECRET = "in-process-mesh"
# Neither node alone can hold the weights (~0.54 GB) with its reserve and KV budget:
# two of them must split the model.
NODE_MEMORY_BYTES = 500 << 20


def split_memory_bytes(model: Path, serving: ServingConfig, nodes: int = 2) -> int:
    """Each node's memory so that ``nodes`` of them must split ``model`` served with
    ``serving``'s format, context and sessions (hetmesh.scheduler.caps): the tiny model's
    share of memory depends on them (one session of 512 tokens fits it on one node)."""
    from hetmesh.node.config import PLANNED_SESSIONS
    from hetmesh.node.weights import weight_bytes
    from hetmesh.partition.checkpoint import settle_weights
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir
    from hetmesh.scheduler.caps import node_memory_cap

    config = check_model_dir(model)
    fmt = settle_weights(serving.weights, model, "cpu")
    return node_memory_cap(
        model_profile(config, name=model.name),
        weight_bytes(config, fmt.value if fmt is not None else "float32", name=model.name),
        nodes,
        max_context_tokens=serving.max_context_tokens,
        max_sessions=serving.max_sessions or PLANNED_SESSIONS,
        reserve_bytes=serving.reserve_bytes,
    )


PROMPT_IDS = [1, 504, 3458, 282, 1029, 314, 253]  # arbitrary in-vocabulary ids


# below Linux's ephemeral range (32768-60999): a port found free here is not handed to
# an outgoing connection or a ``tcp/0`` listener before the node binds it (CI-like saw
# "Address already in use" for a port taken from bind(("127.0.0.1", 0)))
_FREE_PORTS = range(20_000, 32_700)


def free_port() -> int:
    """A loopback TCP port free now, outside the range the kernel picks ports from."""
    pick = random.Random()
    for _ in range(200):
        port = pick.choice(_FREE_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def node_config(
    tmp_path: Path,
    name: str,
    serving: ServingConfig,
    *,
    memory_bytes: int = NODE_MEMORY_BYTES,
    **extra: Any,
) -> NodeConfig:
    return NodeConfig(
        listen=("/ip4/127.0.0.1/tcp/0",),
        mesh_secret=SECRET,
        mdns=False,
        data_dir=tmp_path / name,
        max_memory_bytes=memory_bytes,
        benchmark_budget_s=0.2,
        serving=serving,
        **extra,
    )


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        while True:
            value = predicate()
            if value:
                return value
            await trio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def wait_ready(node: Node, pipelines: int = 1, timeout_s: float = 180) -> dict[str, Any]:
    """The status view of ``node`` once it sees ``pipelines`` fully ready pipelines."""
    from hetmesh.discovery.status import fetch_status

    view: dict[str, Any] = {}
    with trio.move_on_after(timeout_s):
        while True:
            with contextlib.suppress(MeshError):  # a handshake can time out under load
                view = await fetch_status(node.discovery.addrs[0], mesh_secret=SECRET)
                if ready_pipelines(view) >= pipelines:
                    return view
            await trio.sleep(0.5)
    raise AssertionError(f"no {pipelines} ready pipeline(s) in {timeout_s} s: {view}")


class InProcessMesh:
    """Serving daemons of one nursery; more can join with :meth:`join`."""

    def __init__(
        self,
        tmp_path: Path,
        serving: ServingConfig,
        nursery: trio.Nursery,
        memory_bytes: int = NODE_MEMORY_BYTES,
    ) -> None:
        self.tmp_path = tmp_path
        self.serving = serving
        self.nursery = nursery
        self.memory_bytes = memory_bytes
        self.nodes: list[Node] = []

    async def join(self, **extra: Any) -> Node:
        bootstrap = (self.nodes[0].discovery.addrs[0],) if self.nodes else ()
        name = f"n{len(self.nodes)}"
        config = node_config(
            self.tmp_path,
            name,
            self.serving,
            memory_bytes=self.memory_bytes,
            bootstrap=bootstrap,
            **extra,
        )
        node: Node = await self.nursery.start(run_node, config)
        self.nodes.append(node)
        return node

    @property
    def addr(self) -> str:
        return str(self.nodes[0].discovery.addrs[0])


@contextlib.asynccontextmanager
async def open_mesh(
    tmp_path: Path,
    serving: ServingConfig,
    count: int,
    *,
    first: dict[str, Any] | None = None,
    model: Path | None = None,
    memory_bytes: int | None = None,
) -> AsyncIterator[InProcessMesh]:
    """``count`` serving daemons bootstrapped from the first, serving; stopped on exit.

    ``model``: the tiny test model's folder (the ``tiny_model_dir`` fixture) to serve
    instead of the default model, with a node memory that makes two nodes split it.
    ``memory_bytes``: each node's memory (None: one that makes two nodes split it).
    """
    memory_bytes = memory_bytes or NODE_MEMORY_BYTES
    if model is not None:
        memory_bytes = split_memory_bytes(model, serving)
        serving = dataclasses.replace(serving, model=str(model))
    async with trio.open_nursery() as nursery:
        mesh = InProcessMesh(tmp_path, serving, nursery, memory_bytes)
        try:
            await mesh.join(**(first or {}))
            for _ in range(count - 1):
                await mesh.join()
            await wait_ready(mesh.nodes[0])
            yield mesh
        finally:
            for node in mesh.nodes:
                node.request_stop()


@contextlib.asynccontextmanager
async def open_replicas(tmp_path: Path) -> AsyncIterator[InProcessMesh]:
    """Two serving daemons each holding the whole default model, once both follow a plan
    of two single-stage pipelines (two replicas)."""
    # Under the throughput objective one two-stage pipeline of these nodes does about as
    # many tokens/s as two whole replicas (each stage half the work, the head included:
    # the calibration scales every unit alike), so at a long block step the choice was
    # a coin toss on the nodes' measured flops and bandwidth. What a pipeline pays twice
    # is the per-stage overhead of the cost model (4 ms); at a 0.5 ms block step that
    # makes two replicas ~19 % ahead whatever the nodes measure (a 2-device sweep over
    # 3x bandwidth and 10x flops gaps plans two replicas every time).
    serving = ServingConfig(objective="throughput", max_context_tokens=512, block_step_s=0.0005)
    async with open_mesh(tmp_path, serving, 2, memory_bytes=2 << 30) as mesh:
        await wait_ready(mesh.nodes[0], pipelines=2)
        await until(
            lambda: all(n.serving.plan and len(n.serving.plan.pipelines) == 2 for n in mesh.nodes),
            120,
            "both nodes on the two-pipeline plan",
        )
        yield mesh


def stage_servers(nodes: Sequence[Node]) -> list[Any]:
    """Every StageServer of ``nodes``, the first stage first."""
    found = [s for n in nodes for s in n.serving.stages.servers().values()]
    return sorted(found, key=lambda s: s.stage.start)


async def generate(
    addr: str, max_new_tokens: int, prompt_ids: Sequence[int] = PROMPT_IDS
) -> list[int]:
    """Greedy token ids through the node at ``addr``, over the SDK's libp2p protocol."""
    from hetmesh.client.mesh import TokenEvent, open_mesh_client

    out: list[int] = []
    async with open_mesh_client(addr, mesh_secret=SECRET) as client:
        request = {"prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens}
        async for event in client.stream(**request):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                out.append(event.token_id)
    return out


def hold_a_slot(server: Any, session_id: str) -> None:
    """Open a session by hand on ``server`` (as a gateway would) and leave it unused."""
    reply = server.handle(
        OpenSession(
            session_id=session_id,
            start=server.stage.start,
            end=server.stage.end,
            next_peer="nobody",
            gateway="nobody",
            max_tokens=16,
            sampling=SamplingParams(),
        )
    )
    assert reply.ok, reply
