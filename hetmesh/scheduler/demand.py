"""Which model a mesh needs most (pure): the demand signal of several models.

Each model's demand is what its members announce in their records: sessions
running and requests queued (the record's load), and the requests their node's
API routed to the model lately (``DEMAND_KEY``, set by a node serving several
models, :mod:`hetmesh.node.placer`: a node's count is split over its members of
the model, so summing the members counts each request once). :func:`neediest`
ranks models by that
demand per member (a model whose few members are busy needs a new member more
than one whose many members are idle); a node started with ``--model mesh`` on
a mesh serving several models joins the neediest
(:func:`hetmesh.shards.fetch.join_from_mesh`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEMAND_KEY = "demand"  # a record's extra: {"recent": requests routed to its model lately}


@dataclass(frozen=True, slots=True)
class MemberLoad:
    """What one member of a model announces: sessions running, requests queued, and
    its part of the requests its node's API routed to the model lately."""

    sessions: int = 0
    queued: int = 0
    recent: int = 0

    @property
    def total(self) -> int:
        return self.sessions + self.queued + self.recent

    @classmethod
    def of(cls, record: Any) -> MemberLoad:
        """The load a member's record (:class:`~hetmesh.discovery.wire.Announcement`)
        announces; a malformed demand entry counts as none."""
        entry = record.extra.get(DEMAND_KEY)
        recent = entry.get("recent") if isinstance(entry, dict) else None
        if not isinstance(recent, int) or isinstance(recent, bool) or recent < 0:
            recent = 0
        return cls(record.load.active_sessions, record.load.queue_depth, recent)


def demand_per_member(members: Sequence[MemberLoad]) -> float:
    """A model's sessions, queued and recent requests per member (0 with no member)."""
    if not members:
        return 0.0
    return sum(m.total for m in members) / len(members)


def split_recent(count: int, members: int) -> list[int]:
    """``count`` requests announced over ``members`` members (the first ones get the
    remainder): they add up to ``count``."""
    if members < 1:
        return []
    share, rest = divmod(count, members)
    return [share + (i < rest) for i in range(members)]


def neediest(models: Mapping[str, Sequence[MemberLoad]]) -> str:
    """The model that needs another member most: the most demand per member, then the
    fewest members, then the first name (every node picks the same one)."""
    if not models:
        raise ValueError("no model to choose from")
    return min(
        models,
        key=lambda name: (-demand_per_member(models[name]), len(models[name]), name),
    )


__all__ = ["DEMAND_KEY", "MemberLoad", "demand_per_member", "neediest", "split_recent"]
