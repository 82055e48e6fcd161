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
from hetmesh.node.placer import PlacerState, RecentRequests, place_forever
from hetmesh.node.runtime import Node, NodeConfig
from hetmesh.scheduler.model_placement import PlacementPolicy

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


def check_min_replicas(
    models: Sequence[str], shares: Mapping[str, int], given: Mapping[str, int], total: int
) -> dict[str, int]:
    """``--min-replicas NAME=N``, checked: each NAME a ``--model``, N >= 1, and every
    model's minimum of members fitting in ``total`` bytes."""
    unknown = sorted(set(given) - set(models))
    if unknown:
        raise InvalidRequest(f"--min-replicas names {', '.join(unknown)}, not a --model")
    if any(n < 1 for n in given.values()):
        raise InvalidRequest("--min-replicas counts members: each at least 1")
    need = sum(shares[m] * given.get(m, 1) for m in models)
    if need > total:
        raise InvalidRequest(
            f"--min-replicas needs {need} bytes of members' shares; the node offers {total} "
            "(give those models a smaller --model-memory, or raise --max-memory)"
        )
    return dict(given)


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
    ``model_key``, what requests name); ``replicas``: more members of a model, from
    the node's memory pool (:mod:`hetmesh.node.placer` places them by demand).
    """

    def __init__(
        self, config: NodeConfig, nursery: trio.Nursery, requests: RecentRequests | None = None
    ) -> None:
        self.config = config
        self.nursery = nursery
        self.nodes: dict[str, Node] = {}
        self.replicas: dict[str, list[Node]] = {}
        self.sources: dict[str, tuple[str, int]] = {}  # key -> (--model given, its share)
        self._stopped: dict[str, trio.Event] = {}  # by peer id
        self.stop_requested = trio.Event()
        self.api: dict[str, object] | None = None  # where the API listens, once it does
        # what the API routed to each model lately
        self.requests = requests if requests is not None else RecentRequests()
        self.placer = PlacerState()  # the placer's rounds (hetmesh.node.placer)

    def backends(self) -> dict[str, NodeBackend]:
        return {key: NodeBackend(n.discovery, n.serving) for key, n in self.nodes.items()}

    def backend(self) -> ModelsBackend:
        """The API's backend over the members running at each call."""
        return ModelsBackend(self.backends, announce=self.announce_api, seen=self.requests.add)

    def announce_api(self, host: str, port: int) -> None:
        """Every member (and each added later) announces the process's API."""
        self.api = api_entry(host, port)
        for node in self.nodes.values():
            node.discovery.set_extra(API_KEY, self.api)

    def _first_addr(self) -> str | None:
        for node in self.nodes.values():
            return str(node.discovery.addrs[0])
        return None

    async def _start(self, config: NodeConfig) -> tuple[Node, trio.Event]:
        stopped = trio.Event()

        async def member(*, task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await run_node(config, task_status=task_status)
            finally:
                stopped.set()

        node: Node = await self.nursery.start(member)
        self._stopped[node.peer_id] = stopped
        if self.api is not None:
            node.discovery.set_extra(API_KEY, self.api)
        return node, stopped

    async def _stop(self, node: Node) -> None:
        node.request_stop()
        await self._stopped.pop(node.peer_id).wait()

    async def add(self, model: str, memory_bytes: int) -> Node:
        """Start ``model``'s member; returns once it serves (is planned with its peers)."""
        config = member_config(self.config, model, memory_bytes, self._first_addr())
        node, _ = await self._start(config)
        key = str(node.serving.model_key)
        if key in self.nodes:
            await self._stop(node)
            raise InvalidRequest(f"{model} is served already (as {key})")
        self.nodes[key] = node
        self.sources[key] = (model, memory_bytes)
        log.info("serving %s as member %s", key, node.peer_id)
        return node

    async def add_replica(self, key: str) -> Node:
        """One more member of ``key`` (its own identity, the model's share of memory);
        returns once it serves."""
        model, memory_bytes = self.sources[key]
        config = member_config(self.config, model, memory_bytes, self._first_addr())
        number = len(self.replicas.get(key, ())) + 1
        node, _ = await self._start(
            dataclasses.replace(config, data_dir=config.data_dir / f"replica-{number}")
        )
        if key not in self.nodes:  # the model was removed meanwhile
            await self._stop(node)
            raise ModelNotFound(f"{key} stopped being served while its replica started")
        self.replicas.setdefault(key, []).append(node)
        log.info("serving %s with a replica member %s", key, node.peer_id)
        return node

    async def remove_replica(self, key: str) -> None:
        """Stop ``key``'s newest replica member (its sessions move away first)."""
        node = self.replicas[key].pop()
        await self._stop(node)
        log.info("replica member %s of %s stopped", node.peer_id, key)

    def members_of(self, key: str) -> int:
        """Members of ``key`` in this process (0: not served)."""
        return (key in self.nodes) + len(self.replicas.get(key, ()))

    def used_bytes(self) -> int:
        """The memory every running member takes (its model's share each)."""
        return sum(self.sources[k][1] * self.members_of(k) for k in self.nodes)

    async def remove(self, key: str) -> None:
        """Stop the members serving ``key`` (their sessions move away first); returns
        once they have left the mesh."""
        node = self.nodes.pop(key, None)
        if node is None:
            raise ModelNotFound(f"this node does not serve {key!r}")
        async with trio.open_nursery() as nursery:
            for replica in self.replicas.pop(key, []):
                nursery.start_soon(self._stop, replica)
            nursery.start_soon(self._stop, node)
        self.sources.pop(key, None)
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
    min_replicas: Mapping[str, int] | None = None,
    placement: PlacementPolicy | None = None,
    requests: RecentRequests | None = None,
    task_status: TaskStatus[ModelMembers] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``models`` from this process (one member each, see the module docstring)
    until ``members.request_stop()`` (every member drains, then leaves); reports the
    :class:`ModelMembers`. ``min_replicas``: members of a model (as named in
    ``models``) kept here at least; the memory no share takes is placed by demand
    (:mod:`hetmesh.node.placer`, under ``placement``; ``requests``: where the API's
    recent requests are counted, by default on the monotonic clock)."""
    if config.serving is None:
        raise InvalidRequest("several models need serving on (drop --no-serve)")
    total = _total_memory(config)
    shares = memory_shares(total, models, model_memory or {})
    wanted = check_min_replicas(models, shares, min_replicas or {}, total)
    async with trio.open_nursery() as nursery:
        members = ModelMembers(config, nursery, requests)
        for model in models:
            await members.add(model, shares[model])
        minimum = {key: wanted.get(spec, 1) for key, (spec, _) in members.sources.items()}
        for key, count in minimum.items():
            while members.members_of(key) < count:
                await members.add_replica(key)
        placing = trio.CancelScope()

        async def placer() -> None:
            with placing:
                await place_forever(members, total, placement or PlacementPolicy(), minimum)

        nursery.start_soon(placer)
        if config.api_port is not None:
            from hetmesh.node.api_serve import serve_api

            await nursery.start(
                functools.partial(
                    serve_api,
                    members.backend(),
                    config.api_port,
                    host=config.api_host,
                    api_key=config.api_key,
                    mesh_secret=config.mesh_secret,
                    models=members,  # POST/DELETE /v1/hetmesh/models
                )
            )
        _write_info(config, members)
        log.info("node ready: %s", ", ".join(members.nodes))
        task_status.started(members)
        await members.stop_requested.wait()
        placing.cancel()  # no member starts while they all stop
        # graceful: each member's sessions move away and it says goodbye; a cancellation
        # (a second signal) instead cancels every member at once (each still says goodbye)
        await members.stop_all()
        nursery.cancel_scope.cancel()


__all__ = [
    "ModelMembers",
    "check_min_replicas",
    "member_config",
    "memory_shares",
    "model_slug",
    "run_models",
]
