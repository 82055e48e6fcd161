"""Placement by demand inside a running node serving several models.

Each round (:class:`~hetmesh.scheduler.model_placement.PlacementPolicy`'s
``interval_s``) :func:`place_forever` reads each model's demand: the requests
this node's API routed to it within ``window_s`` (:class:`RecentRequests`) and
the sessions and queued requests its members across the mesh announce in their
records; :func:`choose_move` then picks at most one move, which
:class:`~hetmesh.node.models.ModelMembers` carries out: start a replica member of
a model from the node's memory pool (the model's planner re-plans with one more
member) or stop one (its sessions move away first). Another model's members are
never touched, so its plan and streams are not either.

Growth by demand is ordered by the placement leader only (the least id among the
nodes that place, :mod:`hetmesh.scheduler.model_placement`): every node announces
its pool, the order it gave (as the leader) and the last order it carried out
(``PLACEMENT_KEY``) on each member; the leader gives its next order once the last
one's member is in the mesh, or its node left, or the order lapsed: after
``ORDER_EXPIRES_ROUNDS`` when its node has not taken it up, and after
``ORDER_CARRIED_S`` of wall time when it has (starting a member loads a model, which
can take minutes on a big model or a busy machine; ordering another node meanwhile
would add two). A node's own rules cover its minimums and giving back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from hetmesh.errors import MeshError
from hetmesh.scheduler.announcement import read_serving
from hetmesh.scheduler.demand import DEMAND_KEY, MemberLoad, split_recent
from hetmesh.scheduler.model_placement import (
    PLACEMENT_KEY,
    ModelState,
    Move,
    NodePool,
    Order,
    Placement,
    PlacementPolicy,
    grower,
    leader,
    place,
    wanted,
)

if TYPE_CHECKING:
    from hetmesh.node.runtime import Node


class Members(Protocol):
    """What placement reads and does of :class:`hetmesh.node.models.ModelMembers`
    (a protocol: models.py starts the placer, so the placer does not import it)."""

    nodes: dict[str, Node]
    replicas: dict[str, list[Node]]
    sources: dict[str, tuple[str, int]]
    requests: RecentRequests
    placer: PlacerState

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


@dataclass
class PlacerState:
    """What a node's placer carries from round to round."""

    idle_rounds: dict[str, int] = field(default_factory=dict)
    order: Order | None = None  # the last growth this node ordered as the leader
    members_before: int = 0  # the ordered model's mesh members when it was ordered
    order_rounds: int = 0  # rounds since that order
    order_at: float = 0.0  # when it was ordered (time.monotonic)
    done: dict[str, int] = field(default_factory=dict)  # leader -> its last order done here
    rounds: int = 0  # rounds run


ORDER_EXPIRES_ROUNDS = 60  # an order its node has not taken up by then is given up
ORDER_CARRIED_S = 600.0  # one it took up (a member starting) is given up after this


def my_id(members: Members) -> str:
    """This node's id among the nodes that place: its first member's peer id."""
    return next(iter(members.nodes.values())).peer_id


def peer_placements(members: Members, me: str) -> dict[str, Placement]:
    """Each other placing node's announcement (the newest order and done of its
    members' records), from the first member's view of the mesh."""
    found: dict[str, Placement] = {}
    first = next(iter(members.nodes.values()))
    for entry in first.discovery.alive():
        if entry.record is None:
            continue
        placement = Placement.read(entry.record.extra.get(PLACEMENT_KEY))
        if placement is None or placement.pool.node == me:
            continue
        seen = found.get(placement.pool.node)
        if seen is None or _seq(placement) > _seq(seen):
            found[placement.pool.node] = placement
    return found


def unserved_states(members: Members) -> list[ModelState]:
    """The models of the mesh this node does not serve, as their members announce them
    (the leader orders growth for every model)."""
    return [
        ModelState(
            name=model,
            member_bytes=0,
            local_members=0,
            mesh_members=len(loads),
            load=sum(m.total for m in loads),
        )
        for model, loads in sorted(mesh_loads(members).items())
        if model not in members.nodes
    ]


def _seq(placement: Placement) -> int:
    return placement.order.seq if placement.order is not None else 0


def _order_growth(
    state: PlacerState,
    states: list[ModelState],
    pools: list[NodePool],
    others: dict[str, Placement],
    me: str,
    policy: PlacementPolicy,
    now: float,
) -> None:
    """As the leader: order one more member of the model in most demand from the node
    with the most room, once the last order is seen through (its member in the mesh)
    or has lapsed (see the module's docstring); ``now``: ``time.monotonic()``."""
    order = state.order
    if order is not None:
        state.order_rounds += 1
        if order.node == me:
            done = state.done.get(me, 0)
        else:
            peer = others.get(order.node)
            done = peer.done_seq if peer is not None and peer.done_leader == me else 0
        mesh = {m.name: m.mesh_members for m in states}
        through = done >= order.seq and mesh.get(order.model, 0) > state.members_before
        alive = order.node == me or order.node in others
        taken_up = done >= order.seq
        lapsed = (
            now - state.order_at >= ORDER_CARRIED_S
            if taken_up
            else state.order_rounds >= ORDER_EXPIRES_ROUNDS
        )
        if alive and not through and not lapsed:
            return
    top = wanted(states, policy)
    target = grower(pools, top.name) if top is not None else None
    if top is None or target is None:
        return
    seq = order.seq + 1 if order is not None else 1
    state.order = Order(seq, target, top.name)
    state.members_before, state.order_rounds, state.order_at = top.mesh_members, 0, now
    log.info("placement: %s is to add a replica of %s (order %d)", target, top.name, seq)


def choose_move(
    members: Members,
    state: PlacerState,
    states: list[ModelState],
    free: int,
    policy: PlacementPolicy,
) -> Move | None:
    """This round's move of this node: an order of the leader addressed to it, else
    its own rules (a minimum, giving back), never growth by demand on its own."""
    me = my_id(members)
    others = peer_placements(members, me)
    shares = {key: members.sources[key][1] for key in members.nodes}
    pools = [NodePool(me, free, shares), *(p.pool for p in others.values())]
    boss = leader(pools) or me
    if boss == me:
        every = [*states, *unserved_states(members)]
        _order_growth(state, every, pools, others, me, policy, time.monotonic())
        order = state.order
    else:
        order = others[boss].order
    done_seq = state.done.get(boss, 0)
    move: Move | None = None
    if order is not None and order.node == me and order.seq > done_seq:
        state.done[boss] = done_seq = order.seq  # carried out once, even if it fails
        if order.model in members.nodes:
            move = Move("add", order.model, f"ordered by {boss} (order {order.seq})", "demand")
    else:
        move = place(states, free, policy)
        if move is not None and move.reason == "demand":
            move = None  # growth is the leader's to order
        top = wanted(states, policy)
        needed = move is not None and move.reason == "room" and top is not None
        if needed and top is not None and grower(pools, top.name) is not None:
            move = None  # another node has room for it: nothing need go
    placement = Placement(pools[0], state.order if boss == me else None, boss, done_seq)
    for node in _own(members):
        node.discovery.set_extra(PLACEMENT_KEY, placement.as_extra())
    return move


async def place_once(
    members: Members,
    total_bytes: int,
    policy: PlacementPolicy,
    min_members: Mapping[str, int],
    state: PlacerState,
) -> None:
    """One round: read the demand, make at most one move (a failure is logged)."""
    idle_rounds = state.idle_rounds
    states = model_states(members, policy, min_members, idle_rounds)
    announce_demand(members, {s.name: s.recent_requests for s in states})
    for s in states:
        idle_rounds[s.name] = 0 if s.demand > 0 else idle_rounds.get(s.name, 0) + 1
    move = choose_move(members, state, states, total_bytes - members.used_bytes(), policy)
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
    while True:
        await place_once(members, total_bytes, policy, min_members, members.placer)
        members.placer.rounds += 1
        await trio.sleep(policy.interval_s)


__all__ = [
    "PlacerState",
    "RecentRequests",
    "announce_demand",
    "choose_move",
    "mesh_loads",
    "model_states",
    "place_forever",
    "place_once",
]
