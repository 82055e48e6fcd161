"""``route(plan, load, request) -> Pipeline``: which replica serves a request.

Pure. The gateway calls it with the current plan, what it knows of each
pipeline's load and of peer health, and the request.

- **Affinity**: a session already bound to a pipeline stays there while every
  peer of that pipeline is healthy (its KV cache lives there).
- **Health**: a pipeline with any unhealthy peer is skipped.
- **Least expected completion time** otherwise. With ``q`` sessions sharing a
  pipeline (the new one included), micro-batches of ``t`` tokens keep its stages
  busy, so each session gets a token every
  ``max(decode_latency, ceil(q / t) × bottleneck)`` seconds; the request
  completes after its prefill plus ``max_new_tokens`` such periods.

Raises :class:`~hetmesh.errors.NoRoute` when no pipeline is healthy; the gateway
turns it into a ``Rejected`` for the client or retries after the next plan.
"""

from __future__ import annotations

import math

from hetmesh.errors import NoRoute
from hetmesh.scheduler.records import MeshLoad, Pipeline, PipelineLoad, Plan, RouteRequest


def expected_completion_s(
    pipeline: Pipeline, load: PipelineLoad, request: RouteRequest, micro_batch_tokens: int = 1
) -> float:
    """Predicted seconds until ``request`` finishes on ``pipeline`` under ``load``."""
    sharing = load.active_sessions + load.queued_requests + 1
    batches = math.ceil(sharing / max(1, micro_batch_tokens))
    period = max(pipeline.decode_latency_s, batches * pipeline.bottleneck_s)
    prefill = pipeline.prefill_s_per_1k * request.prompt_tokens / 1000.0
    return prefill * (1 + load.queued_requests) + request.max_new_tokens * period


def healthy(pipeline: Pipeline, unhealthy: frozenset[str]) -> bool:
    return not (pipeline.peers & unhealthy)


def route(plan: Plan, load: MeshLoad, request: RouteRequest) -> Pipeline:
    """The pipeline that should serve ``request``."""
    unhealthy = frozenset(load.unhealthy_peers)
    if request.session_id:
        bound = load.sessions.get(request.session_id)
        if bound is not None:
            for pipeline in plan.pipelines:
                if pipeline.key == bound and healthy(pipeline, unhealthy):
                    return pipeline
    best: tuple[float, int] | None = None
    for index, pipeline in enumerate(plan.pipelines):
        if not healthy(pipeline, unhealthy):
            continue
        state = load.pipelines.get(pipeline.key, PipelineLoad())
        when = expected_completion_s(pipeline, state, request, plan.constraints.micro_batch_tokens)
        if best is None or (when, index) < best:
            best = (when, index)
    if best is None:
        down = ", ".join(sorted(unhealthy)) or "none"
        raise NoRoute(
            f"no healthy pipeline among {len(plan.pipelines)} of plan epoch {plan.epoch} "
            f"(unhealthy peers: {down})"
        )
    return plan.pipelines[best[1]]


__all__ = ["expected_completion_s", "healthy", "route"]
