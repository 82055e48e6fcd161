"""Where a node serving several models puts its spare memory (pure): by demand.

A node started with several ``--model``s runs one mesh member per model
(:mod:`hetmesh.node.models`), each with a share of the node's memory; what no
share takes is the node's pool. A *replica member* is one more member of a
model, with that model's share, taken from the pool: the model's planner then
has one more member to place pipelines on (under ``--objective throughput`` a
model that fits a member gets a replica, i.e. one more pipeline; under
``latency`` the member is a spare its plan may use).

:func:`place` chooses one move a round from each model's :class:`ModelState`
(its demand: requests this node's API routed to it lately, plus the sessions,
queued requests and other nodes' recent requests its members across the mesh
announce, per member of the mesh), so the node's memory follows demand a step at a time:

1. a model with fewer members here than its minimum (``--min-replicas``) gets
   one, when it fits;
2. the model in most demand per member, at or above ``grow_at``, gets one when
   it fits; when it does not, an idle model's replica above its minimum goes,
   and a later round adds;
3. a model idle for ``shrink_after`` rounds gives one replica back (never below
   its minimum, never its first member).

A model's other members, and every other model, are untouched by a move: each
model is planned by its own members only.

Growth by demand is decided for the whole mesh by one node, the *placement
leader* (:func:`leader`: the least node id among the nodes that place, each
announcing a :class:`NodePool`): it picks the model (rule 2) and the node that
adds the replica (:func:`grower`: the one with the most free memory that fits
the model's share), so two nodes reading the same demand do not both add one.
Minimums (rule 1) and giving back (rule 3) stay each node's own: they concern
only its memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeGuard


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """When :func:`place` moves memory; ``interval_s``: between rounds; ``window_s``:
    how long a request counts as recent."""

    grow_at: float = 4.0  # demand per member of the mesh that asks for one more here
    shrink_after: int = 12  # idle rounds before a replica goes back to the pool
    interval_s: float = 5.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.grow_at <= 0 or self.shrink_after < 1:
            raise ValueError("grow_at must be > 0 and shrink_after >= 1")
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("interval_s and window_s must be > 0")


@dataclass(frozen=True, slots=True)
class ModelState:
    """One model as this node sees it in a round."""

    name: str
    member_bytes: int  # the memory one member of it takes here (its share)
    local_members: int  # members of it in this process, the first included
    mesh_members: int  # live members of it in the mesh, these included
    recent_requests: int = 0  # routed to it by this node's API within the window
    # sessions running + requests queued, its members' announcements, and the recent
    # requests other nodes' APIs routed to it (hetmesh.scheduler.demand.DEMAND_KEY)
    load: int = 0
    min_members: int = 1  # members of it this node keeps at least (--min-replicas)
    idle_rounds: int = 0  # consecutive rounds with no demand at all

    @property
    def demand(self) -> float:
        """Recent requests and announced load per member of the mesh."""
        return (self.recent_requests + self.load) / max(1, self.mesh_members)

    @property
    def spare(self) -> bool:
        """It has a replica here it could give back (above its minimum and first)."""
        return self.local_members > max(1, self.min_members)


Reason = Literal["minimum", "demand", "room", "idle"]


@dataclass(frozen=True, slots=True)
class Move:
    """Start (``add``) or stop (``remove``) one replica member of ``model``; ``reason``:
    which rule chose it (a minimum, demand, room for a needy model, idleness)."""

    kind: Literal["add", "remove"]
    model: str
    why: str
    reason: Reason


@dataclass(frozen=True, slots=True)
class NodePool:
    """A node that places, as its members announce it: its free memory and one
    member's share of each model it serves."""

    node: str  # the node's id (its first member's peer id)
    free_bytes: int
    shares: Mapping[str, int] = field(default_factory=dict)


def leader(pools: Sequence[NodePool]) -> str | None:
    """The node that decides growth for the mesh: the least id (every node agrees)."""
    return min((p.node for p in pools), default=None)


def grower(pools: Sequence[NodePool], model: str) -> str | None:
    """The node to add a replica of ``model``: of those serving it whose free memory
    fits its share, the most free, then the least id."""
    fits = [p for p in pools if model in p.shares and p.shares[model] <= p.free_bytes]
    if not fits:
        return None
    return min(fits, key=lambda p: (-p.free_bytes, p.node)).node


def wanted(models: Sequence[ModelState], policy: PlacementPolicy) -> ModelState | None:
    """The model demand asks one more member for (rule 2): the most demand per member,
    at or above ``grow_at``; ties go to the first name."""
    needy = [m for m in sorted(models, key=lambda m: m.name) if m.demand >= policy.grow_at]
    return max(needy, key=lambda m: m.demand) if needy else None


def place(models: Sequence[ModelState], free_bytes: int, policy: PlacementPolicy) -> Move | None:
    """This round's move, if any (see the module docstring); ties go to the first name."""
    ordered = sorted(models, key=lambda m: m.name)
    short = [m for m in ordered if m.local_members < m.min_members]
    for m in sorted(short, key=lambda m: m.local_members - m.min_members):
        if m.member_bytes <= free_bytes:
            why = f"{m.local_members} of at least {m.min_members} members"
            return Move("add", m.name, why, "minimum")
    top = wanted(models, policy)
    if top is not None:
        why = f"demand {top.demand:.1f} per member (grows at {policy.grow_at:g})"
        if top.member_bytes <= free_bytes:
            return Move("add", top.name, why, "demand")
        idle = [m for m in ordered if m.spare and m.demand == 0 and m.name != top.name]
        if idle:
            why = f"idle; {top.name} needs the memory ({why})"
            return Move("remove", idle[0].name, why, "room")
    for m in ordered:
        if m.spare and m.idle_rounds >= policy.shrink_after:
            return Move("remove", m.name, f"idle for {m.idle_rounds} rounds", "idle")
    return None


PLACEMENT_KEY = "placement"  # a record's extra: its node's Placement (as_extra)


@dataclass(frozen=True, slots=True)
class Order:
    """The leader's ``seq``-th growth: ``node`` adds a replica member of ``model``."""

    seq: int
    node: str
    model: str


@dataclass(frozen=True, slots=True)
class Placement:
    """What a node that places announces on every member: its pool, the growth it
    ordered (as leader), and the last order of ``leader`` it carried out (``done``)."""

    pool: NodePool
    order: Order | None = None
    done_leader: str = ""
    done_seq: int = 0

    def as_extra(self) -> dict[str, object]:
        order = self.order
        return {
            "node": self.pool.node,
            "free": self.pool.free_bytes,
            "shares": dict(self.pool.shares),
            "order": None if order is None else [order.seq, order.node, order.model],
            "done": [self.done_leader, self.done_seq],
        }

    @classmethod
    def read(cls, extra: object) -> Placement | None:
        """A peer's announced placement; None when absent or malformed."""
        if not isinstance(extra, dict):
            return None
        node, free, shares = extra.get("node"), extra.get("free"), extra.get("shares")
        order, done = extra.get("order"), extra.get("done")
        if not (isinstance(node, str) and node and _count(free) and isinstance(shares, dict)):
            return None
        if not all(isinstance(k, str) and _count(v) for k, v in shares.items()):
            return None
        parsed: Order | None = None
        if isinstance(order, list) and len(order) == 3:
            seq, target, model = order
            if _count(seq) and isinstance(target, str) and isinstance(model, str):
                parsed = Order(seq, target, model)
        leader_, seq_ = done if isinstance(done, list) and len(done) == 2 else ("", 0)
        if not (isinstance(leader_, str) and _count(seq_)):
            leader_, seq_ = "", 0
        return cls(NodePool(node, free, shares), parsed, leader_, seq_)


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = [
    "PLACEMENT_KEY",
    "ModelState",
    "Move",
    "NodePool",
    "Order",
    "Placement",
    "PlacementPolicy",
    "grower",
    "leader",
    "place",
    "wanted",
]
