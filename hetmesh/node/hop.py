"""One stage of a session's route: which peer serves which units (pure).

The gateway runs a session over a tuple of hops, the router's choice turned
into peers; migration pairs an old route's hops with a new one's, and the
routing inputs count the hops of the sessions running now.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetmesh.resources import PeerId


@dataclass(frozen=True, slots=True)
class Hop:
    """One stage of a pipeline: which peer serves which units."""

    peer_id: PeerId
    start: int
    end: int


__all__ = ["Hop"]
