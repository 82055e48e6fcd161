"""Which model a mesh needs most (pure): the demand signal of several models.

Each model's demand is what its members announce in their records' load:
sessions running and requests queued. :func:`neediest` ranks models by that
demand per member (a model whose few members are busy needs a new member more
than one whose many members are idle); a node started with ``--model mesh`` on
a mesh serving several models joins the neediest
(:func:`hetmesh.shards.fetch.join_from_mesh`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemberLoad:
    """What one member of a model announces: sessions running, requests queued."""

    sessions: int = 0
    queued: int = 0


def demand_per_member(members: Sequence[MemberLoad]) -> float:
    """A model's sessions and queued requests per member (0 with no member)."""
    if not members:
        return 0.0
    return sum(m.sessions + m.queued for m in members) / len(members)


def neediest(models: Mapping[str, Sequence[MemberLoad]]) -> str:
    """The model that needs another member most: the most demand per member, then the
    fewest members, then the first name (every node picks the same one)."""
    if not models:
        raise ValueError("no model to choose from")
    return min(
        models,
        key=lambda name: (-demand_per_member(models[name]), len(models[name]), name),
    )


__all__ = ["MemberLoad", "demand_per_member", "neediest"]
