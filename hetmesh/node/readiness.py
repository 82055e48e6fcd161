"""Whether a plan's pipelines can serve: decided here, once, for every caller.

A stage is *ready* when a live peer announces it loaded and not retiring
(``(peer_id, start, end)``); a pipeline is ready when every one of its stages
is. The node's routing (:meth:`~hetmesh.node.serving.Serving.ready`, its
router input) and the tools that read a status view (:mod:`hetmesh.testbed.local_mesh`)
ask these functions. Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Set

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


__all__ = [
    "StageKey",
    "pipeline_ready",
    "ready_pipelines",
    "unready_peers",
]
