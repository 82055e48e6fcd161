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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


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


@dataclass(frozen=True, slots=True)
class Move:
    """Start (``add``) or stop (``remove``) one replica member of ``model``."""

    kind: Literal["add", "remove"]
    model: str
    why: str


def place(models: Sequence[ModelState], free_bytes: int, policy: PlacementPolicy) -> Move | None:
    """This round's move, if any (see the module docstring); ties go to the first name."""
    ordered = sorted(models, key=lambda m: m.name)
    short = [m for m in ordered if m.local_members < m.min_members]
    for m in sorted(short, key=lambda m: m.local_members - m.min_members):
        if m.member_bytes <= free_bytes:
            return Move("add", m.name, f"{m.local_members} of at least {m.min_members} members")
    needy = [m for m in ordered if m.demand >= policy.grow_at]
    if needy:
        top = max(needy, key=lambda m: m.demand)
        why = f"demand {top.demand:.1f} per member (grows at {policy.grow_at:g})"
        if top.member_bytes <= free_bytes:
            return Move("add", top.name, why)
        idle = [m for m in ordered if m.spare and m.demand == 0 and m.name != top.name]
        if idle:
            return Move("remove", idle[0].name, f"idle; {top.name} needs the memory ({why})")
    for m in ordered:
        if m.spare and m.idle_rounds >= policy.shrink_after:
            return Move("remove", m.name, f"idle for {m.idle_rounds} rounds")
    return None


__all__ = ["ModelState", "Move", "PlacementPolicy", "place"]
