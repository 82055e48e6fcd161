"""Cost model, planner, router and replanning policy: pure functions, no I/O.

What the node daemon calls:

- :func:`plan` (coordinator) → a :class:`Plan` of one or more :class:`Pipeline`;
- :func:`route` (gateway) → the :class:`Pipeline` that serves a request;
- :func:`replan`, :func:`should_replan`, :func:`should_adopt`, :func:`coordinator`,
  :func:`newest`, :func:`supersedes` (coordinator service and every peer);
- :data:`BASELINES` (benchmarks and ``hetmesh plan``).

This package imports no trio, libp2p or torch (a test enforces it).
"""

from hetmesh.scheduler.baselines import BASELINES, even_split, greedy_fill, memory_proportional
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.heuristic import SearchOptions
from hetmesh.scheduler.planner import evaluate, placement, plan
from hetmesh.scheduler.records import (
    MeshLoad,
    Objective,
    Pipeline,
    PipelineLoad,
    Plan,
    PlanConstraints,
    RouteRequest,
    Stage,
    device_key,
)
from hetmesh.scheduler.replan import (
    MeshSnapshot,
    ReplanOutcome,
    Verdict,
    coordinator,
    newest,
    newest_in_view,
    replan,
    should_adopt,
    should_replan,
    supersedes,
)
from hetmesh.scheduler.router import expected_completion_s, route

__all__ = [
    "BASELINES",
    "CostModel",
    "MeshLoad",
    "MeshSnapshot",
    "Objective",
    "Pipeline",
    "PipelineLoad",
    "Plan",
    "PlanConstraints",
    "ReplanOutcome",
    "RouteRequest",
    "SearchOptions",
    "Stage",
    "Verdict",
    "coordinator",
    "device_key",
    "evaluate",
    "even_split",
    "expected_completion_s",
    "greedy_fill",
    "memory_proportional",
    "newest",
    "newest_in_view",
    "placement",
    "plan",
    "replan",
    "route",
    "should_adopt",
    "should_replan",
    "supersedes",
]
