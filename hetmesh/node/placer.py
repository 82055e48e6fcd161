"""Placement by demand inside a running node serving several models.

Each round (:class:`~hetmesh.scheduler.model_placement.PlacementPolicy`'s
``interval_s``) :func:`place_forever` reads each model's demand: the requests
this node's API routed to it within ``window_s`` (:class:`RecentRequests`) and
the sessions and queued requests its members across the mesh announce in their
records; :func:`~hetmesh.scheduler.model_placement.place` then picks at most one move,
which :class:`~hetmesh.node.models.ModelMembers` carries out: start a replica
member of a model from the node's memory pool (the model's planner re-plans with
one more member) or stop one (its sessions move away first). Another model's
members are never touched, so its plan and streams are not either.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import trio

from hetmesh.errors import MeshError
from hetmesh.scheduler.announcement import read_serving
from hetmesh.scheduler.demand import DEMAND_KEY, MemberLoad, split_recent
from hetmesh.scheduler.model_placement import ModelState, PlacementPolicy, place

if TYPE_CHECKING:
    from hetmesh.node.runtime import Node


class Members(Protocol):
    """What placement reads and does of :class:`hetmesh.node.models.ModelMembers`
    (a protocol: models.py starts the placer, so the placer does not import it)."""

    nodes: dict[str, Node]
    replicas: dict[str, list[Node]]
    sources: dict[str, tuple[str, int]]
    requests: RecentRequests

    def members_of(self, key: str) -> int: ...

    def used_bytes(self) -> int: ...

    async def add_replica(self, key: str) -> object: ...

    async def remove_replica(self, key: str) -> None: ...


log = logging.getLogger(__name__)


class RecentRequests:
    """When the API routed requests to each model (only the newest ``keep`` each)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, keep: int = 4096) -> None:
        self._clock = clock
        self._keep = keep
        self._seen: dict[str, deque[float]] = {}

    def add(self, model: str) -> None:
        self._seen.setdefault(model, deque(maxlen=self._keep)).append(self._clock())

    def count(self, model: str, window_s: float) -> int:
        """Requests for ``model`` within the last ``window_s`` seconds."""
        seen = self._seen.get(model)
        if not seen:
            return 0
        since = self._clock() - window_s
        while seen and seen[0] < since:
            seen.popleft()
        return len(seen)


def _own(members: Members) -> list[Node]:
    """Every member of this process, replicas included."""
    return [*members.nodes.values(), *(n for nodes in members.replicas.values() for n in nodes)]


def mesh_loads(members: Members) -> dict[str, list[MemberLoad]]:
    """Model -> each live member's announced load over the mesh (this process's
    members read from their own records, the rest from the first member's view of
    its peers). This process's members count no recent requests: the API's own
    count (``members.requests``) stands for them."""
    records = {n.peer_id: n.discovery.local_record(advance=False) for n in _own(members)}
    own = set(records)
    first = next(iter(members.nodes.values()), None)
    if first is not None:
        for entry in first.discovery.alive():
            if entry.record is not None:
                records.setdefault(entry.peer_id, entry.record)
    loads: dict[str, list[MemberLoad]] = {}
    for peer, record in records.items():
        model = read_serving(record.extra, (), plan_of=None).model
        if model:
            load = MemberLoad.of(record)
            if peer in own:
                load = MemberLoad(load.sessions, load.queued)
            loads.setdefault(model, []).append(load)
    return loads


def announce_demand(members: Members, recent: Mapping[str, int]) -> None:
    """Each member of this process announces its part of the requests the API routed
    to its model lately (:data:`~hetmesh.scheduler.demand.DEMAND_KEY`), so other
    nodes' placers and a ``--model mesh`` node joining see this node's demand."""
    for key, first in members.nodes.items():
        nodes = [first, *members.replicas.get(key, ())]
        for node, part in zip(nodes, split_recent(recent.get(key, 0), len(nodes)), strict=True):
            node.discovery.set_extra(DEMAND_KEY, {"recent": part})


def model_states(
    members: Members,
    policy: PlacementPolicy,
    min_members: Mapping[str, int],
    idle_rounds: Mapping[str, int],
) -> list[ModelState]:
    loads = mesh_loads(members)
    return [
        ModelState(
            name=key,
            member_bytes=members.sources[key][1],
            local_members=members.members_of(key),
            mesh_members=max(len(loads.get(key, ())), members.members_of(key)),
            recent_requests=members.requests.count(key, policy.window_s),
            load=sum(m.total for m in loads.get(key, ())),
            min_members=min_members.get(key, 1),
            idle_rounds=idle_rounds.get(key, 0),
        )
        for key in members.nodes
    ]


async def place_once(
    members: Members,
    total_bytes: int,
    policy: PlacementPolicy,
    min_members: Mapping[str, int],
    idle_rounds: dict[str, int],
) -> None:
    """One round: read the demand, make at most one move (a failure is logged)."""
    states = model_states(members, policy, min_members, idle_rounds)
    announce_demand(members, {state.name: state.recent_requests for state in states})
    for state in states:
        idle_rounds[state.name] = 0 if state.demand > 0 else idle_rounds.get(state.name, 0) + 1
    move = place(states, total_bytes - members.used_bytes(), policy)
    if move is None:
        return
    log.info("placement: %s a replica member of %s (%s)", move.kind, move.model, move.why)
    try:
        if move.kind == "add":
            await members.add_replica(move.model)
        else:
            await members.remove_replica(move.model)
            idle_rounds[move.model] = 0
    except MeshError as exc:  # e.g. the member could not be planned: try again later
        log.warning("placement: %s of %s failed: %s", move.kind, move.model, exc)


async def place_forever(
    members: Members,
    total_bytes: int,
    policy: PlacementPolicy,
    min_members: Mapping[str, int],
) -> None:
    """:func:`place_once` every ``policy.interval_s``, until cancelled."""
    idle_rounds: dict[str, int] = {}
    while True:
        await place_once(members, total_bytes, policy, min_members, idle_rounds)
        await trio.sleep(policy.interval_s)


__all__ = [
    "RecentRequests",
    "announce_demand",
    "mesh_loads",
    "model_states",
    "place_forever",
    "place_once",
]
