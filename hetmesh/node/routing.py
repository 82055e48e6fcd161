"""What the router weighs, from the peer view: pure routing inputs.

The router (:func:`hetmesh.scheduler.router.route`) picks a pipeline for a
request from the loads, row costs, hosts and cached prefixes; this module
computes those from a :class:`~hetmesh.node.peer_view.PeerView` and the
gateway's own sessions, and chooses a split prefill's helper
(:mod:`hetmesh.node.split`). Pure: no I/O, no trio; the node's
:class:`~hetmesh.node.route_chooser.RouteChooser` gathers the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hetmesh.node.hop import Hop
from hetmesh.node.peer_view import PeerView
from hetmesh.node.split import Replica, choose_helper
from hetmesh.partition.blocks import BLOCK_TOKENS
from hetmesh.resources import PeerId
from hetmesh.scheduler.announcement import Host, ServingAnnouncement
from hetmesh.scheduler.prefix_summary import decode_summary
from hetmesh.scheduler.records import Pipeline, PipelineLoad, Plan, Stage
from hetmesh.scheduler.router import cached_blocks

Summary = Callable[[Stage], frozenset[int]]


def _key(hops: Sequence[Hop]) -> tuple[tuple[PeerId, int, int], ...]:
    return tuple((h.peer_id, h.start, h.end) for h in hops)


def sample_windows(view: PeerView, interval_s: float) -> dict[PeerId, tuple[float, float]]:
    """When each peer's announced load was sampled: a plan tick before it was sent."""
    return {
        p.peer_id: (p.record.sent_at_s - interval_s, p.record.sent_at_s)
        for p in view.peers
        if p.record is not None
    }


def pipeline_loads(
    plan: Plan,
    view: PeerView,
    *,
    me: PeerId,
    routes: Sequence[Sequence[Hop]],
    local_sessions: int,
    local_queue: int,
    counted: Mapping[PeerId, int],
) -> dict[str, PipelineLoad]:
    """Each pipeline's sessions: those this gateway runs on it now (``routes``), plus
    the most any of its stages serves for other gateways. Ours are counted now
    (``local_sessions`` held by our stages); another peer's are its announcement less
    the sessions of ours that ran there while its load was sampled (``counted``): it
    lags, and a stream of ours that has ended since must not linger there."""
    ours_here = sum(1 for hops in routes if any(h.peer_id == me for h in hops))
    others: dict[PeerId, tuple[int, int]] = {me: (max(0, local_sessions - ours_here), local_queue)}
    for peer in view.peers:
        if peer.record is None:
            continue
        load = peer.record.load
        others[peer.peer_id] = (
            max(0, load.active_sessions - counted.get(peer.peer_id, 0)),
            load.queue_depth,
        )
    keys = [_key(r) for r in routes]
    loads = {}
    for p in plan.pipelines:
        route = tuple((s.peer_id, s.start, s.end) for s in p.stages)
        loads[p.key] = PipelineLoad(
            active_sessions=sum(1 for k in keys if k == route)
            + max(others.get(s.peer_id, (0, 0))[0] for s in p.stages),
            queued_requests=max(others.get(s.peer_id, (0, 0))[1] for s in p.stages),
        )
    return loads


def _states(
    view: PeerView, me: PeerId, mine: ServingAnnouncement
) -> dict[PeerId, ServingAnnouncement]:
    states = {p.peer_id: p.serving for p in view.peers}
    states[me] = mine
    return states


def sharing(
    plan: Plan, view: PeerView, me: PeerId, mine: ServingAnnouncement
) -> tuple[dict[str, float], dict[PeerId, Host]]:
    """What the router weighs besides load: each pipeline's cost of a further row of
    a round (its dearest stage's, as announced; 1 where unmeasured) and the cores
    each peer announces it computes on (``mine``: this node's announcement)."""
    states = _states(view, me, mine)

    def row_cost(peer: PeerId) -> float:
        state = states.get(peer)
        calibration = state.calibration if state is not None else None
        return calibration.row_cost if calibration is not None else 1.0

    hosts = {peer: state.host for peer, state in states.items() if state.host is not None}
    costs = {p.key: max(row_cost(s.peer_id) for s in p.stages) for p in plan.pipelines}
    return costs, hosts


def summaries(view: PeerView, me: PeerId, mine: Mapping[tuple[int, int], str]) -> Summary:
    """A stage's announced prefix summary (``mine``: our own stages', from their pools)."""
    read: dict[tuple[str, int, int], frozenset[int]] = {}

    def summary(stage: Stage) -> frozenset[int]:
        key = (stage.peer_id, stage.start, stage.end)
        if key not in read:
            if stage.peer_id == me:
                read[key] = decode_summary(mine.get((stage.start, stage.end)))
            else:
                read[key] = view.prefix_summary(stage)
        return read[key]

    return summary


def chunk_costs(
    hops: Sequence[Hop], view: PeerView, me: PeerId, mine: ServingAnnouncement
) -> list[float | None]:
    """Each hop's announced prefill chunk cost (None: not measured or not known)."""
    costs: list[float | None] = []
    for hop in hops:
        calibration = mine.calibration if hop.peer_id == me else view.calibration(hop.peer_id)
        cost = calibration.prefill_chunk_cost if calibration is not None else 0.0
        costs.append(cost if cost > 0 else None)
    return costs


def split_helper(
    plan: Plan,
    hops: Sequence[Hop],
    *,
    view: PeerView,
    me: PeerId,
    mine: ServingAnnouncement,
    weights: str,
    unhealthy: frozenset[PeerId],
    loads: Mapping[str, PipelineLoad],
    row_costs: Mapping[str, float],
    hashes: Sequence[int] = (),
    summary: Summary | None = None,
) -> tuple[Replica, int, int] | None:
    """An idle, ready replica of a one-stage route's units in its format to split a
    long prefill with, the unit where to cut, and the prompt tokens the route's
    stage is expected to hold cached; None when there is none. ``weights``: this
    node's format; ``summary``: the stages' announced prefix summaries."""
    if len(hops) != 1:
        return None
    states = _states(view, me, mine)

    def weights_of(peer: PeerId) -> str:
        if peer == me:
            return weights
        state = states.get(peer)
        return state.weights if state is not None else ""

    def block_s(peer: PeerId) -> float:
        state = states.get(peer)
        calibration = state.calibration if state is not None else None
        return calibration.block_step_s if calibration is not None else 0.0

    def cached(pipeline: Pipeline) -> int:
        # as held (announced summaries), not the router's memory: that has just
        # noted this very prompt on the chosen route
        return cached_blocks(pipeline, hashes, summary) * BLOCK_TOKENS if summary else 0

    replicas = [
        Replica(
            peer_id=p.stages[0].peer_id,
            start=p.stages[0].start,
            end=p.stages[0].end,
            weights=weights_of(p.stages[0].peer_id),
            busy=bool(loads[p.key].active_sessions or loads[p.key].queued_requests),
            row_cost=row_costs.get(p.key, 1.0),
            cached_tokens=cached(p),
            block_step_s=block_s(p.stages[0].peer_id),
        )
        for p in plan.pipelines
        if len(p.stages) == 1
    ]
    main = next((r for r in replicas if r.peer_id == hops[0].peer_id), None)
    if main is None:
        return None
    found = choose_helper(main, replicas, unhealthy)
    if found is None:
        return None
    helper, unit = found
    return helper, unit, main.cached_tokens


__all__ = [
    "Summary",
    "chunk_costs",
    "pipeline_loads",
    "sample_windows",
    "sharing",
    "split_helper",
    "summaries",
]
