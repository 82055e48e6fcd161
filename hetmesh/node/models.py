"""Several models served from one node process: one mesh member per model.

``hetmesh node start --model A --model B`` runs :func:`run_models`: a
:class:`ModelMembers` starts one :func:`~hetmesh.node.daemon.run_node` per
model, each with its own identity (``DATA_DIR/models/<model>/``), a share of
the node's memory (:func:`memory_shares`), listening beside the first member
and bootstrapped from it. Each model is planned by the members that serve it,
as a single-model mesh is (a member's peer view and its coordinator only see
members of its model), so the mesh follows one signed plan per model and this
machine holds stages of each. One HTTP API serves them all through a
:class:`~hetmesh.node.backend.ModelsBackend`, which routes a request by its
``model``. Removing a model stops its member alone (its sessions move away
first); the other members' plans and streams never saw it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from hetmesh.errors import InvalidRequest, ModelNotFound
from hetmesh.node.api_forward import API_KEY, api_entry
from hetmesh.node.backend import ModelsBackend, NodeBackend
from hetmesh.node.daemon import NODE_INFO_FILE, run_node
from hetmesh.node.runtime import Node, NodeConfig

if TYPE_CHECKING:
    from pathlib import Path

    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

MIN_SHARE_BYTES = 64 << 20  # below this a member could hold nothing of any model


def memory_shares(total: int, models: Sequence[str], given: Mapping[str, int]) -> dict[str, int]:
    """Each model's memory: ``given`` ones their size, the rest of ``total`` split evenly
    among the others. Refuses unknown names, duplicates, and shares that do not fit."""
    if len(set(models)) != len(models):
        raise InvalidRequest(f"a model is named twice in {', '.join(models)}")
    unknown = sorted(set(given) - set(models))
    if unknown:
        raise InvalidRequest(f"--model-memory names {', '.join(unknown)}, not a --model")
    rest = [m for m in models if m not in given]
    left = total - sum(given.values())
    shares = dict(given)
    for model in rest:
        shares[model] = left // len(rest)
    small = [m for m in models if shares[m] < MIN_SHARE_BYTES]
    if small:
        raise InvalidRequest(
            f"{total} bytes leave {', '.join(small)} less than {MIN_SHARE_BYTES} bytes; "
            "raise --max-memory or lower a --model-memory"
        )
    return {m: shares[m] for m in models}


def model_slug(model: str) -> str:
    """A directory name for ``model`` (a name, a folder or a file)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_.") or "model"


def _port_zero(addr: str) -> str:
    return re.sub(r"/(tcp|udp)/\d+", r"/\1/0", addr)


def member_config(
    config: NodeConfig, model: str, memory_bytes: int, first: str | None
) -> NodeConfig:
    """The :class:`NodeConfig` of ``model``'s member: ``config``'s settings, its own data
    directory and memory, no API; after the first member (``first``: its address), any
    free port, bootstrapped from it."""
    assert config.serving is not None
    return dataclasses.replace(
        config,
        data_dir=config.data_dir / "models" / model_slug(model),
        max_memory_bytes=memory_bytes,
        serving=dataclasses.replace(config.serving, model=model),
        api_port=None,
        listen=config.listen if first is None else tuple(_port_zero(a) for a in config.listen),
        bootstrap=config.bootstrap if first is None else (first, *config.bootstrap),
    )


class ModelMembers:
    """The members of one node process, one per model, in ``nursery``.

    ``nodes``: the running members by the name each model is served under (its
    ``model_key``, what requests name).
    """

    def __init__(self, config: NodeConfig, nursery: trio.Nursery) -> None:
        self.config = config
        self.nursery = nursery
        self.nodes: dict[str, Node] = {}
        self._stopped: dict[str, trio.Event] = {}
        self.stop_requested = trio.Event()
        self.api: dict[str, object] | None = None  # where the API listens, once it does

    def backends(self) -> dict[str, NodeBackend]:
        return {key: NodeBackend(n.discovery, n.serving) for key, n in self.nodes.items()}

    def backend(self) -> ModelsBackend:
        """The API's backend over the members running at each call."""
        return ModelsBackend(self.backends, announce=self.announce_api)

    def announce_api(self, host: str, port: int) -> None:
        """Every member (and each added later) announces the process's API."""
        self.api = api_entry(host, port)
        for node in self.nodes.values():
            node.discovery.set_extra(API_KEY, self.api)

    def _first_addr(self) -> str | None:
        for node in self.nodes.values():
            return str(node.discovery.addrs[0])
        return None

    async def add(self, model: str, memory_bytes: int) -> Node:
        """Start ``model``'s member; returns once it serves (is planned with its peers)."""
        config = member_config(self.config, model, memory_bytes, self._first_addr())
        stopped = trio.Event()

        async def member(*, task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await run_node(config, task_status=task_status)
            finally:
                stopped.set()

        node: Node = await self.nursery.start(member)
        key = str(node.serving.model_key)
        if key in self.nodes:
            node.request_stop()
            raise InvalidRequest(f"{model} is served already (as {key})")
        self.nodes[key] = node
        self._stopped[key] = stopped
        if self.api is not None:
            node.discovery.set_extra(API_KEY, self.api)
        log.info("serving %s as member %s", key, node.peer_id)
        return node

    async def remove(self, key: str) -> None:
        """Stop the member serving ``key`` (its sessions move away first); returns once
        it has left the mesh."""
        node = self.nodes.pop(key, None)
        if node is None:
            raise ModelNotFound(f"this node does not serve {key!r}")
        node.request_stop()
        await self._stopped.pop(key).wait()
        log.info("stopped serving %s", key)

    async def add_model(self, model: str, memory_bytes: int) -> str:
        """:meth:`add`, for the API (``POST /v1/hetmesh/models``): the model's name."""
        node = await self.add(model, memory_bytes)
        return str(node.serving.model_key)

    async def remove_model(self, key: str) -> None:
        """:meth:`remove`, for the API (``DELETE /v1/hetmesh/models/{key}``); the last
        model cannot go (the node would serve nothing: stop it instead)."""
        if key in self.nodes and len(self.nodes) == 1:
            raise InvalidRequest(f"{key} is this node's last model; stop the node instead")
        await self.remove(key)

    def request_stop(self) -> None:
        """Ask :func:`run_models` to stop every member and return."""
        self.stop_requested.set()

    async def stop_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for key in list(self.nodes):
                nursery.start_soon(self.remove, key)


def _total_memory(config: NodeConfig) -> int:
    if config.max_memory_bytes is not None:
        return config.max_memory_bytes
    import psutil

    return int(psutil.virtual_memory().total)


def _write_info(config: NodeConfig, members: ModelMembers) -> None:
    """The process's ``node.json``: its first member's, with every member's peer id."""
    first = next(iter(members.nodes.values()))
    info = {
        "peer_id": first.peer_id,
        "addrs": list(first.discovery.addrs),
        "pid": os.getpid(),
        "members": {key: n.peer_id for key, n in members.nodes.items()},
    }
    path: Path = config.data_dir / NODE_INFO_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


async def run_models(
    config: NodeConfig,
    models: Sequence[str],
    model_memory: Mapping[str, int] | None = None,
    *,
    task_status: TaskStatus[ModelMembers] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``models`` from this process (one member each, see the module docstring)
    until ``members.request_stop()`` (every member drains, then leaves); reports the
    :class:`ModelMembers`."""
    if config.serving is None:
        raise InvalidRequest("several models need serving on (drop --no-serve)")
    shares = memory_shares(_total_memory(config), models, model_memory or {})
    async with trio.open_nursery() as nursery:
        members = ModelMembers(config, nursery)
        for model in models:
            await members.add(model, shares[model])
        if config.api_port is not None:
            from hetmesh.node.api import serve_api

            await nursery.start(
                functools.partial(
                    serve_api,
                    members.backend(),
                    config.api_port,
                    host=config.api_host,
                    api_key=config.api_key,
                    models=members,  # POST/DELETE /v1/hetmesh/models
                )
            )
        _write_info(config, members)
        log.info("node ready: %s", ", ".join(members.nodes))
        task_status.started(members)
        await members.stop_requested.wait()
        # graceful: each member's sessions move away and it says goodbye; a cancellation
        # (a second signal) instead cancels every member at once (each still says goodbye)
        await members.stop_all()
        nursery.cancel_scope.cancel()


__all__ = [
    "ModelMembers",
    "member_config",
    "memory_shares",
    "model_slug",
    "run_models",
]
