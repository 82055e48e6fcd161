"""Where this node's gateway sends a request: the router over the node's inputs.

The gateway asks :meth:`RouteChooser.choose` for a route (waiting, up to
``route_wait_s``, for a ready pipeline), :meth:`~RouteChooser.helper` for a
split prefill's helper and :meth:`~RouteChooser.chunk_costs` for its hops'
prefill chunk costs. The inputs are computed by the pure
:mod:`hetmesh.node.routing` from the peer view, the stages here and the
gateway's own sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from hetmesh.discovery.wire import Load
from hetmesh.errors import InsufficientCapacity, NoRoute
from hetmesh.node import routing
from hetmesh.node.hop import Hop
from hetmesh.node.peer_view import PeerView
from hetmesh.node.readiness import StageKey, ready_pipelines, unready_peers
from hetmesh.node.route_wait import hopeless, mesh_verdict
from hetmesh.partition.prefix import scoped
from hetmesh.resources import PeerId
from hetmesh.scheduler.announcement import ServingAnnouncement
from hetmesh.scheduler.prefix_summary import salted
from hetmesh.scheduler.records import MeshLoad, PipelineLoad, Plan, RouteRequest
from hetmesh.scheduler.router import RouteMemory, cached_blocks, route

if TYPE_CHECKING:
    from hetmesh.node.gateway import Gateway
    from hetmesh.node.plan_follower import PlanFollower
    from hetmesh.node.stage_host import StageHost


class RouteChooser:
    """Routes this node's requests; see the module docstring.

    ``view``: the peer view now; ``mine``: this node's announcement; ``local``:
    this node's announced load; ``weights``: the format its stages are held in.
    """

    def __init__(
        self,
        *,
        me: PeerId,
        model_key: str,
        route_wait_s: float,
        plan_interval_s: float,
        follower: PlanFollower,
        stages: StageHost,
        view: Callable[[], PeerView],
        mine: Callable[[], ServingAnnouncement],
        local: Callable[[], Load],
    ) -> None:
        self.me = me
        self.summary_salt = b""  # the mesh-private key of announced prefix names (serving)
        self.model_key = model_key
        self.route_wait_s = route_wait_s
        self.plan_interval_s = plan_interval_s
        self.follower = follower
        self.stages = stages
        self.gateway: Gateway | None = None
        self._view = view
        self._mine = mine
        self._local = local
        self._memory = RouteMemory()  # prefix blocks this gateway sent where (cache routing)
        self._changed = trio.Event()

    def changed(self) -> None:
        """The mesh may have changed: a request waiting for a route looks again."""
        self._changed.set()
        self._changed = trio.Event()

    def ready_stages(self) -> set[StageKey]:
        """The ready stages: ours not retiring, and those live members announce."""
        ready = {(self.me, a, b) for a, b in self.stages.serving()}
        return ready | self._view().ready_stages()

    def ready(self) -> bool:
        """Whether a pipeline of the followed plan is fully ready (requests can enter)."""
        return bool(ready_pipelines(self.follower.plan, self.ready_stages()))

    def loads(self, plan: Plan) -> dict[str, PipelineLoad]:
        """Each pipeline's sessions (:func:`hetmesh.node.routing.pipeline_loads`)."""
        gateway = self.gateway
        view = self._view()
        routes = gateway.routes() if gateway is not None else []
        sampled = routing.sample_windows(view, self.plan_interval_s)
        counted = gateway.sessions_during(sampled) if gateway is not None else {}
        return routing.pipeline_loads(
            plan,
            view,
            me=self.me,
            routes=routes,
            local_sessions=self.stages.sessions(),
            local_queue=self._local().queue_depth,
            counted=counted,
        )

    def summary_of(self) -> routing.Summary:
        """A stage's announced prefix summary (our own stages': read from their pools)."""
        return routing.summaries(self._view(), self.me, self.stages.prefix_summaries())

    def summary_names(self, hashes: Sequence[int]) -> list[int]:
        """What stages announce for blocks of our sessions' ``hashes`` (scoped to us as
        their gateway, salted with the mesh's key: ``scheduler.prefix_summary``)."""
        return salted(scoped(hashes, self.me), self.summary_salt)

    def route(
        self, session_id: str, avoid: frozenset[PeerId], hashes: Sequence[int] = ()
    ) -> tuple[Hop, ...]:
        """The route for a request now (none: no pipeline is ready and healthy)."""
        plan = self.follower.plan
        if plan is None:
            return ()
        # ready_stages holds live peers' stages only: a dead peer's stages are unready
        unhealthy = set(avoid) | unready_peers(plan, self.ready_stages())
        # one pipeline: nothing to choose between, so no cache or load to weigh
        several = len(plan.pipelines) > 1
        cached: dict[str, int] = {}
        if hashes and several:
            summary = self.summary_of()
            names = self.summary_names(hashes)
            cached = {
                p.key: max(cached_blocks(p, names, summary), self._memory.matched(hashes, p.key))
                for p in plan.pipelines
            }
        loads = self.loads(plan) if several else {}
        view = self._view()
        row_costs, hosts = (
            routing.sharing(plan, view, self.me, self._mine()) if several else ({}, {})
        )
        try:
            chosen = route(
                plan,
                MeshLoad(pipelines=loads, unhealthy_peers=tuple(sorted(unhealthy))),
                RouteRequest(session_id=session_id),
                cached,
                local=self.me,
                fed=self.gateway is not None and self.gateway.feed_steps > 1,
                row_costs=row_costs,
                hosts=hosts,
            )
        except NoRoute:
            return ()
        if several:
            self._memory.remember(hashes, chosen.key)
        return tuple(Hop(s.peer_id, s.start, s.end) for s in chosen.stages)

    def helper(
        self, hops: Sequence[Hop], avoid: frozenset[PeerId], hashes: Sequence[int] = ()
    ) -> tuple[Hop, int, int] | None:
        """An idle, ready replica to split a one-stage route's long prefill with, the
        unit where to cut, and the prompt tokens the route's stage is expected to hold
        cached (:func:`hetmesh.node.routing.split_helper`); None when there is none."""
        plan = self.follower.plan
        if plan is None or len(hops) != 1:
            return None
        view = self._view()
        mine = self._mine()
        costs, _ = routing.sharing(plan, view, self.me, mine)
        found = routing.split_helper(
            plan,
            hops,
            view=view,
            me=self.me,
            mine=mine,
            weights=self.stages.weights,
            unhealthy=frozenset(avoid) | unready_peers(plan, self.ready_stages()),
            loads=self.loads(plan),
            row_costs=costs,
            hashes=self.summary_names(hashes),  # as the stages announce them
            summary=self.summary_of() if hashes else None,
        )
        if found is None:
            return None
        helper, unit, cached = found
        return Hop(helper.peer_id, helper.start, helper.end), unit, cached

    def chunk_costs(self, hops: Sequence[Hop]) -> list[float | None]:
        """Each hop's announced prefill chunk cost (None: not measured or not known)."""
        return routing.chunk_costs(hops, self._view(), self.me, self._mine())

    async def choose(
        self, session_id: str, avoid: frozenset[PeerId], hashes: Sequence[int] = ()
    ) -> Sequence[Hop]:
        """A route, waiting up to ``route_wait_s`` for one (counted afresh when a new plan
        is adopted: a re-plan after a peer left loads stages); ``InsufficientCapacity`` at
        once when the coordinator cannot place the model on the live members and no
        pipeline of the plan followed can serve (:func:`~hetmesh.node.route_wait.hopeless`),
        else ``NoRoute``."""
        waited_on = self.follower.plan
        with trio.CancelScope(deadline=trio.current_time() + self.route_wait_s) as scope:
            while True:
                hops = self.route(session_id, avoid, hashes)
                if hops:
                    return hops
                view = self._view()
                announced = {m.peer_id: m.serving.insufficient for m in view.members}
                verdict = mesh_verdict(
                    self.me, self.follower.boss, self.follower.insufficient, announced
                )
                live = {self.me} | announced.keys()
                why = hopeless(self.follower.plan, live, verdict)
                if why:  # it cannot place it on who is left: say so now
                    raise InsufficientCapacity(f"cannot serve {self.model_key}: {why}")
                if self.follower.plan is not waited_on:  # a new plan: its stages load
                    waited_on = self.follower.plan
                    scope.deadline = trio.current_time() + self.route_wait_s
                await self._changed.wait()
        if self.follower.plan is None:
            why = self.follower.insufficient or "no plan yet (is the coordinator up?)"
        else:
            why = "no pipeline of the current plan is fully ready and healthy"
        raise NoRoute(f"no route for {self.model_key}: {why}")


__all__ = ["RouteChooser"]
