"""``route(plan, load, request) -> Pipeline``: which replica serves a request.

Pure. The gateway calls it with the current plan, what it knows of each
pipeline's load and of peer health, and the request.

- **Affinity**: a session already bound to a pipeline stays there while every
  peer of that pipeline is healthy (its KV cache lives there).
- **Health**: a pipeline with any unhealthy peer is skipped.
- **Cache** (like SGLang's cache-aware router): among the healthy pipelines,
  the one whose every stage holds the longest leading run of the request's
  prefix blocks (``cached``: pipeline key -> blocks, from the stages'
  announced summaries and the gateway's own memory of where it sent what,
  :class:`RouteMemory`) is chosen, unless the load is imbalanced: its
  sessions exceed the least loaded pipeline's by more than
  :attr:`CachePolicy.balance_abs` and by a factor over
  :attr:`CachePolicy.balance_rel`. A conversation's next turn starts with its
  earlier turns' blocks, so it goes back where its cache is.
- **Least expected completion time** otherwise. With ``q`` sessions sharing a
  pipeline (the new one included), micro-batches of ``t`` tokens keep its stages
  busy, so each session gets a token every
  ``max(decode_latency, (1 + r × (ceil(q / t) - 1)) × bottleneck)`` seconds; the
  request completes after its prefill plus ``max_new_tokens`` such periods.
  ``r`` (``row_costs``, per pipeline) is what each further row of a round adds
  as a fraction of a one-row step, as its stages measured it (a CPU streams the
  weights once for the whole round: ~0.1 there); unmeasured, 1: linear.
- **Shared cores** (``hosts``): peers announcing the same host key compute on
  the same cores. When the busy ones there (the new request's pipeline counted)
  keep more cores busy than the host has, each runs that many times slower; a
  pipeline is charged its own slowdown and the time it adds to the sessions it
  slows. Several nodes started on one machine then pack their sessions into
  bigger rounds on as many replicas as there are cores, not time-slice them.
- **Local first**: a pipeline held wholly by the gateway's own node (``local``)
  spares every token two data-plane hops, which the plan's step times do not
  see; it is taken while its expected completion is within
  :attr:`CachePolicy.local_slack` of the best.
- **Away first, for a fed stage**: a pipeline of one stage, which the gateway
  feeds several tokens a step (``fed``, see ``OpenSession.feed_steps``), needs
  a round trip once a feed, not once a token. On the gateway's own node the
  gateway's per-token work (the client's stream, the text) would share the
  stage's interpreter lock and slow its forwards (0.89 of the reference there
  against 0.95 elsewhere, docs/benchmarks.md). So such a pipeline on another
  node is taken while within the same slack of the best.

Raises :class:`~hetmesh.errors.NoRoute` when no pipeline is healthy; the gateway
turns it into a ``Rejected`` for the client or retries after the next plan.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetmesh.errors import NoRoute
from hetmesh.scheduler.announcement import Host
from hetmesh.scheduler.prefix_summary import matched_blocks
from hetmesh.scheduler.records import MeshLoad, Pipeline, PipelineLoad, Plan, RouteRequest, Stage


@dataclass(frozen=True, slots=True, kw_only=True)
class CachePolicy:
    """When a cached prefix outweighs load (SGLang's two thresholds)."""

    balance_abs: int = 4  # sessions more than the least loaded pipeline, at most ...
    balance_rel: float = 1.5  # ... or at most this many times its sessions
    min_blocks: int = 1  # a shorter cached prefix is not worth a detour
    # a pipeline all on the gateway's node wins while it is at most this much slower
    local_slack: float = 0.1

    def imbalanced(self, sessions: int, least: int) -> bool:
        return sessions - least > self.balance_abs and sessions > least * self.balance_rel


DEFAULT_POLICY = CachePolicy()


def token_period_s(
    pipeline: Pipeline, sharing: int, micro_batch_tokens: int = 1, row_cost: float = 1.0
) -> float:
    """Seconds between a session's tokens with ``sharing`` sessions on ``pipeline``."""
    batches = math.ceil(max(1, sharing) / max(1, micro_batch_tokens))
    rounds = 1.0 + row_cost * (batches - 1)
    return max(pipeline.decode_latency_s, rounds * pipeline.bottleneck_s)


def expected_completion_s(
    pipeline: Pipeline,
    load: PipelineLoad,
    request: RouteRequest,
    micro_batch_tokens: int = 1,
    row_cost: float = 1.0,
    slowdown: float = 1.0,
) -> float:
    """Predicted seconds until ``request`` finishes on ``pipeline`` under ``load``
    (``row_cost``: see the module docstring; ``slowdown``: its shared cores' factor)."""
    sharing = load.active_sessions + load.queued_requests + 1
    period = token_period_s(pipeline, sharing, micro_batch_tokens, row_cost)
    prefill = pipeline.prefill_s_per_1k * request.prompt_tokens / 1000.0
    return (prefill * (1 + load.queued_requests) + request.max_new_tokens * period) * slowdown


class _Cores:
    """Which hosts' cores the busy pipelines keep busy, and what one more would cost."""

    def __init__(
        self,
        hosts: Mapping[str, Host],
        busy: Sequence[tuple[Pipeline, int, float]],  # (pipeline, sessions, token period)
    ) -> None:
        self.hosts = hosts
        self.busy = busy
        self.peers = frozenset(peer for p, _, _ in busy for peer in p.peers)

    def _demand(self, peers: frozenset[str]) -> dict[str, float]:
        demand: dict[str, float] = {}
        for peer in peers:
            host = self.hosts.get(peer)
            if host is not None:
                demand[host.key] = demand.get(host.key, 0.0) + host.share
        return demand

    def _factor(self, pipeline: Pipeline, demand: Mapping[str, float]) -> float:
        factor = 1.0
        for peer in pipeline.peers:
            host = self.hosts.get(peer)
            if host is not None:
                factor = max(factor, demand.get(host.key, 0.0) / max(host.cores, 1e-9))
        return factor

    def cost(self, pipeline: Pipeline, tokens: int) -> tuple[float, float]:
        """(the slowdown ``pipeline`` runs at once busy too, the seconds its slowing the
        busy pipelines adds to their sessions over ``tokens`` tokens each)"""
        if not self.hosts:
            return 1.0, 0.0
        before = self._demand(self.peers)
        after = self._demand(self.peers | pipeline.peers)
        added = 0.0
        for other, sessions, period in self.busy:
            if other.key != pipeline.key:
                rise = self._factor(other, after) - self._factor(other, before)
                added += sessions * tokens * period * rise
        return self._factor(pipeline, after), added


def healthy(pipeline: Pipeline, unhealthy: frozenset[str]) -> bool:
    return not (pipeline.peers & unhealthy)


def cached_blocks(
    pipeline: Pipeline, hashes: Sequence[int], summary: Callable[[Stage], frozenset[int]]
) -> int:
    """Leading blocks of ``hashes`` every stage of ``pipeline`` holds, by the stages'
    summaries (the prefill starts at the fewest any stage holds)."""
    if not hashes:
        return 0
    return min(matched_blocks(hashes, summary(stage)) for stage in pipeline.stages)


class RouteMemory:
    """Where this gateway recently sent which prefix blocks: block hash -> pipeline key.

    Known at once, where an announced summary arrives seconds later; bounded
    (least recently routed hashes forgotten first). A hint like the summaries.
    """

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._where: OrderedDict[int, str] = OrderedDict()

    def remember(self, hashes: Sequence[int], pipeline_key: str) -> None:
        for h in hashes:
            self._where[h] = pipeline_key
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def matched(self, hashes: Sequence[int], pipeline_key: str) -> int:
        """Leading blocks of ``hashes`` last sent to ``pipeline_key``."""
        count = 0
        for h in hashes:
            if self._where.get(h) != pipeline_key:
                break
            count += 1
        return count

    def __len__(self) -> int:
        return len(self._where)


def route(
    plan: Plan,
    load: MeshLoad,
    request: RouteRequest,
    cached: Mapping[str, int] | None = None,
    policy: CachePolicy = DEFAULT_POLICY,
    local: str = "",
    fed: bool = False,
    row_costs: Mapping[str, float] | None = None,
    hosts: Mapping[str, Host] | None = None,
) -> Pipeline:
    """The pipeline that should serve ``request``; ``cached`` maps a pipeline key to the
    leading blocks of the request its stages hold (absent: none); ``local``: the
    gateway's peer id (its own pipelines come first, see the module docstring);
    ``fed``: the gateway feeds a pipeline of one stage several tokens a step (then
    such a pipeline of its own comes last); ``row_costs``: pipeline key -> what a
    further row of a round costs (absent: 1); ``hosts``: peer id -> the cores it
    shares (absent: its own)."""
    unhealthy = frozenset(load.unhealthy_peers)
    row_costs = row_costs or {}
    t = plan.constraints.micro_batch_tokens

    def sharing(pipeline: Pipeline) -> int:
        state = load.pipelines.get(pipeline.key, PipelineLoad())
        return state.active_sessions + state.queued_requests

    cores = _Cores(
        hosts or {},
        [
            (p, n, token_period_s(p, n, t, row_costs.get(p.key, 1.0)))
            for p in plan.pipelines
            if (n := sharing(p)) > 0
        ],
    )
    if request.session_id:
        bound = load.sessions.get(request.session_id)
        if bound is not None:
            for pipeline in plan.pipelines:
                if pipeline.key == bound and healthy(pipeline, unhealthy):
                    return pipeline
    best: tuple[float, int] | None = None
    local_best: tuple[float, int] | None = None  # the best of the gateway's own
    away_best: tuple[float, int] | None = None  # the best fed stage elsewhere
    cache_best: tuple[int, float, int] | None = None  # (-blocks, when, index)
    sessions: dict[int, int] = {}
    for index, pipeline in enumerate(plan.pipelines):
        if not healthy(pipeline, unhealthy):
            continue
        state = load.pipelines.get(pipeline.key, PipelineLoad())
        sessions[index] = sharing(pipeline)
        slowdown, added = cores.cost(pipeline, request.max_new_tokens)
        when = added + expected_completion_s(
            pipeline, state, request, t, row_costs.get(pipeline.key, 1.0), slowdown
        )
        if best is None or (when, index) < best:
            best = (when, index)
        home = bool(local) and pipeline.peers == {local}
        lone = fed and len(pipeline.stages) == 1
        if home and not lone and (local_best is None or (when, index) < local_best):
            local_best = (when, index)
        if lone and not home and (away_best is None or (when, index) < away_best):
            away_best = (when, index)
        blocks = (cached or {}).get(pipeline.key, 0)
        if blocks >= policy.min_blocks and (
            cache_best is None or (-blocks, when, index) < cache_best
        ):
            cache_best = (-blocks, when, index)
    if cache_best is not None and not policy.imbalanced(
        sessions[cache_best[2]], min(sessions.values())
    ):
        return plan.pipelines[cache_best[2]]
    if best is None:
        down = ", ".join(sorted(unhealthy)) or "none"
        raise NoRoute(
            f"no healthy pipeline among {len(plan.pipelines)} of plan epoch {plan.epoch} "
            f"(unhealthy peers: {down})"
        )
    for preferred in (local_best, away_best):
        if preferred is not None and preferred[0] <= best[0] * (1.0 + policy.local_slack):
            return plan.pipelines[preferred[1]]
    return plan.pipelines[best[1]]


__all__ = [
    "DEFAULT_POLICY",
    "CachePolicy",
    "RouteMemory",
    "cached_blocks",
    "expected_completion_s",
    "healthy",
    "route",
    "token_period_s",
]
