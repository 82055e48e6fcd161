"""Cost model, planner, router and replanning policy: pure functions, no I/O.

What the node daemon calls:

- :func:`plan` (coordinator) → a :class:`Plan` of one or more :class:`Pipeline`;
- :func:`route` (gateway) → the :class:`Pipeline` that serves a request;
- :func:`decide` (every node's plan loop: a :class:`MeshView` and the
  :class:`CoordinatorState` in, the :class:`Step` to take out), built on
  :func:`replan`, :func:`should_replan`, :func:`should_adopt`, :func:`coordinator`,
  :func:`newest`, :func:`supersedes`;
- :func:`read_serving` / :func:`serving_extra` (what nodes announce of their
  serving state: :class:`ServingAnnouncement`);
- :data:`BASELINES` (benchmarks and ``hetmesh plan``).

This package imports no trio, libp2p or torch (a test enforces it).
"""

from hetmesh.scheduler.announcement import ServingAnnouncement, read_serving, serving_extra
from hetmesh.scheduler.baselines import BASELINES, even_split, greedy_fill, memory_proportional
from hetmesh.scheduler.coordination import (
    CoordinatorConfig,
    CoordinatorState,
    MeshView,
    Step,
    decide,
)
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
    "CoordinatorConfig",
    "CoordinatorState",
    "CostModel",
    "MeshLoad",
    "MeshSnapshot",
    "MeshView",
    "Objective",
    "Pipeline",
    "PipelineLoad",
    "Plan",
    "PlanConstraints",
    "ReplanOutcome",
    "RouteRequest",
    "SearchOptions",
    "ServingAnnouncement",
    "Stage",
    "Step",
    "Verdict",
    "coordinator",
    "decide",
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
    "read_serving",
    "replan",
    "route",
    "serving_extra",
    "should_adopt",
    "should_replan",
    "supersedes",
]
