"""Whether a plan's pipelines can serve: decided here, once, for every caller.

A stage is *ready* when a live peer announces it loaded and not retiring
(``(peer_id, start, end)``); a pipeline is ready when every one of its stages
is. The node's routing (:meth:`~hetmesh.node.serving.Serving.ready`, its
router input) and the tools that read a status view (:mod:`hetmesh.node.local`)
ask these functions. Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from hetmesh.resources import PeerId
from hetmesh.scheduler.records import Pipeline, Plan

StageKey = tuple[PeerId, int, int]  # (peer, first unit, end unit)


def pipeline_ready(pipeline: Pipeline, ready: Set[StageKey]) -> bool:
    """Every stage of ``pipeline`` is ready."""
    return all((s.peer_id, s.start, s.end) in ready for s in pipeline.stages)


def ready_pipelines(plan: Plan | None, ready: Set[StageKey]) -> tuple[Pipeline, ...]:
    """The pipelines of ``plan`` whose every stage is ready (none without a plan)."""
    if plan is None:
        return ()
    return tuple(p for p in plan.pipelines if pipeline_ready(p, ready))


def unready_peers(plan: Plan, ready: Set[StageKey]) -> frozenset[PeerId]:
    """Peers holding a stage of ``plan`` that is not ready: the router avoids them."""
    return frozenset(
        s.peer_id
        for p in plan.pipelines
        for s in p.stages
        if (s.peer_id, s.start, s.end) not in ready
    )


def ready_stages_in_view(view: Mapping[str, Any]) -> set[StageKey]:
    """The ready stages a status view shows (its own and its live peers'), as its
    :class:`~hetmesh.node.peer_view.PeerView` decides them."""
    from hetmesh.node.peer_view import PeerView

    return PeerView.of_status(view).ready_stages()


def ready_pipelines_in_view(view: Mapping[str, Any]) -> tuple[Pipeline, ...]:
    """The pipelines of a status view's newest plan whose every stage is ready."""
    from hetmesh.node.peer_view import PeerView
    from hetmesh.scheduler.announcement import parse_plan

    peers = PeerView.of_status(view, plan_of=parse_plan)
    return ready_pipelines(peers.newest_plan(), peers.ready_stages())


__all__ = [
    "StageKey",
    "pipeline_ready",
    "ready_pipelines",
    "ready_pipelines_in_view",
    "ready_stages_in_view",
    "unready_peers",
]
