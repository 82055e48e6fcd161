"""Real node processes serving the default model, for the node daemon's tests.

Builds on the discovery tests' process helpers (reaped in ``finally``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hetmesh.partition.sampling import SamplingParams
from hetmesh.testbed.local_mesh import ready_pipelines
from tests.integration.discovery.discovery_nodes import (
    SECRET,
    NodeFactory,
    NodeProc,
    fetch_view,
    wait_for,
)

# Each node may offer this much memory: the model (~0.54 GB of fp32 weights plus
# KV budget) needs three of them, so the planner must split it.
NODE_MEMORY = "500MiB"
SERVE_ARGS = (
    "--serve",
    "--no-mdns",
    "--max-memory",
    NODE_MEMORY,
    "--max-sessions",
    "4",
    "--listen",
    "/ip4/127.0.0.1/tcp/0",
)


def serve_args(model: Path | None = None) -> tuple[str, ...]:
    """:data:`SERVE_ARGS` for the default model, or for ``model`` (the tiny test model:
    its ``--model`` path and a node memory that splits it as NODE_MEMORY does the default)."""
    if model is None:
        return SERVE_ARGS
    from tests.tiny_model import TINY_NODE_MEMORY

    args = list(SERVE_ARGS)
    args[args.index("--max-memory") + 1] = TINY_NODE_MEMORY
    return ("--model", str(model), *args)


@contextlib.contextmanager
def running_mesh(
    tmp_path: Path, count: int, *extra: str, model: Path | None = None
) -> Iterator[list[NodeProc]]:
    """``count`` serving nodes bootstrapped from the first; all reaped on exit.

    ``model``: serve this folder instead of the default model (see :func:`serve_args`);
    pass the ``tiny_model_dir`` fixture where the test is about a mechanism.
    """
    factory = NodeFactory(tmp_path)
    args = serve_args(model)
    try:
        first = factory.start(*args, *extra).wait_ready(90)
        others = [factory.start(*args, *extra, "--bootstrap", first.addr) for _ in range(count - 1)]
        nodes = [first, *(n.wait_ready(90) for n in others)]
        yield nodes
    finally:
        factory.close()


CUT_CONTEXT, CUT_SESSIONS = 512, 4  # a cut mesh's nodes (cut_memory_cap, cut_mesh)


def cut_memory_cap(model_dir: Path, stages: int) -> str:
    """``--max-memory`` that makes the model (native weights) need ``stages`` nodes of
    :func:`cut_mesh`."""
    from hetmesh.node.config import ServingConfig
    from hetmesh.node.weights import weight_bytes
    from hetmesh.partition.checkpoint import settle_weights
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir
    from hetmesh.scheduler.caps import node_memory_cap

    config = check_model_dir(model_dir)
    fmt = settle_weights("native", model_dir, "cpu")
    assert fmt is not None
    cap = node_memory_cap(
        model_profile(config, name=model_dir.name),
        weight_bytes(config, fmt.value, name=model_dir.name),
        stages,
        max_context_tokens=CUT_CONTEXT,
        max_sessions=CUT_SESSIONS,
        reserve_bytes=ServingConfig().reserve_bytes,
    )
    return str(cap)


@contextlib.contextmanager
def cut_mesh(tmp_path: Path, count: int, *args: str) -> Iterator[list[NodeProc]]:
    """``count`` equal serving nodes of the default model (one given speed: no
    calibration), bootstrapped from the first; ``args`` (e.g. ``--max-memory`` from
    :func:`cut_memory_cap`) decide how it is cut. All reaped on exit."""
    common = (
        *("--serve", "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0"),
        *("--max-sessions", str(CUT_SESSIONS), "--max-context", str(CUT_CONTEXT)),
        *("--block-step-ms", "3"),
        *args,
    )
    factory = NodeFactory(tmp_path)
    try:
        first = factory.start(*common).wait_ready(90)
        others = [factory.start(*common, "--bootstrap", first.addr) for _ in range(count - 1)]
        yield [first, *(n.wait_ready(90) for n in others)]
    finally:
        factory.close()


def wait_serving(node: NodeProc, pipelines: int = 1, timeout_s: float = 90) -> dict[str, Any]:
    """Block until ``node`` sees ``pipelines`` fully ready pipelines; its view then.

    Each poll dials the node afresh; a node starved of CPU can answer that handshake
    too late (``AuthenticationFailed``/``ConnectTimeout``), which is polled again, not
    taken as the answer. A node that exits fails the wait at once.
    """
    from hetmesh.errors import TransportError

    dial_failures: list[str] = []

    def serving() -> dict[str, Any] | None:
        if node.proc.poll() is not None:
            raise AssertionError(f"the node exited ({node.proc.returncode}):\n{node.log()[-3000:]}")
        try:
            view = fetch_view(node.addr)
        except TransportError as exc:
            dial_failures.append(repr(exc))
            return None
        return view if ready_pipelines(view) >= pipelines else None

    try:
        return wait_for(serving, timeout_s, f"{pipelines} ready pipeline(s)", every_s=0.5)
    except AssertionError as exc:
        tail = f" ({len(dial_failures)} polls failed to dial, the last: {dial_failures[-1]})"
        raise AssertionError(f"{exc}{tail if dial_failures else ''}") from None


async def view_of(node: NodeProc) -> dict[str, Any]:
    """The node's status view, from inside a trio test."""
    from hetmesh.discovery.status import fetch_status

    return await fetch_status(node.addr, mesh_secret=SECRET, timeout_s=10)


async def generate_ids(addr: str, prompt_ids: Sequence[int], **sampling: Any) -> list[int]:
    """Greedy (by default) token ids for ``prompt_ids``, through the node at ``addr``."""
    from hetmesh.client.mesh import TokenEvent, open_mesh_client

    out: list[int] = []
    async with open_mesh_client(addr, mesh_secret=SECRET) as mesh:
        async for event in mesh.stream(prompt_ids=list(prompt_ids), **sampling):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                out.append(event.token_id)
    return out


_REFERENCE: dict[str, Any] = {}


def reference_ids(
    model_dir: Path, prompt_ids: Sequence[int], max_new_tokens: int, weights: str = "native"
) -> list[int]:
    """The single-process greedy reference (Foundation's LocalPipeline), holding the
    model in ``weights`` (the default: the checkpoint's own format, as a node does)."""
    from hetmesh.partition.generate import LocalPipeline

    torch.set_num_threads(1)
    key = f"{model_dir}:{weights}"
    pipeline = _REFERENCE.get(key)
    if pipeline is None:
        pipeline = _REFERENCE[key] = LocalPipeline.load(model_dir, 1, weights=weights)
    return list(
        pipeline.generate_ids(list(prompt_ids), SamplingParams(max_new_tokens=max_new_tokens))
    )


def encode(model_dir: Path, prompt: str, *, chat: bool = False) -> list[int]:
    from hetmesh.partition.text import encode_prompt, load_tokenizer

    tokenizer = _REFERENCE.get(f"tok:{model_dir}")
    if tokenizer is None:
        tokenizer = _REFERENCE[f"tok:{model_dir}"] = load_tokenizer(model_dir)
    return encode_prompt(tokenizer, prompt, chat=chat)


__all__ = [
    "SECRET",
    "NodeProc",
    "encode",
    "fetch_view",
    "generate_ids",
    "open_probe_peer",
    "reference_ids",
    "running_mesh",
    "serve_args",
    "view_of",
    "wait_for",
    "wait_serving",
]


class ProbePeer:
    """A hand-driven mesh member for tests: it talks to stages directly.

    It opens data-plane links and control RPCs the way a gateway does, so a
    test can send a stage malformed or unexpected frames and read what comes
    back.
    """

    def __init__(self, host: Any, pool: Any, inbox: Any) -> None:
        self.host = host
        self.pool = pool
        self.inbox = inbox
        self.peer_id = str(host.get_id())

    async def dial(self, view_peer: dict[str, Any]) -> None:
        from hetmesh.discovery.host import dial, parse_peer_addr

        await dial(self.host, parse_peer_addr(view_peer["record"]["addrs"][0]), timeout_s=5)

    async def control(self, peer: str, request: dict[str, Any]) -> dict[str, Any]:
        from hetmesh.discovery.rpc import call
        from hetmesh.node.control import SESSION_PROTOCOL

        return await call(self.host, peer, SESSION_PROTOCOL, request, timeout_s=5)


@contextlib.asynccontextmanager
async def open_probe_peer() -> Any:
    import trio
    from libp2p import generate_new_ed25519_identity

    from hetmesh.discovery.host import derive_psk, open_host
    from hetmesh.node.link_pool import LinkPool
    from hetmesh.transport import DataPlaneConfig, open_data_plane

    send, receive = trio.open_memory_channel[Any](100)
    async with (
        open_host(
            generate_new_ed25519_identity(),
            psk=derive_psk(SECRET),
            listen=["/ip4/127.0.0.1/tcp/0"],
        ) as host,
        open_data_plane(DataPlaneConfig(peer_id=str(host.get_id()))) as plane,
        trio.open_nursery() as nursery,
    ):

        def dispatch(peer: str, link: Any, frame: Any) -> None:
            send.send_nowait(frame)
            link.release(frame)

        pool = LinkPool(host=host, plane=plane, dispatch=dispatch, nursery=nursery)
        yield ProbePeer(host, pool, receive)
        nursery.cancel_scope.cancel()
