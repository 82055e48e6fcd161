"""Whether a request waiting for a route can still get one: the pure decision, as a table."""

from __future__ import annotations

import pytest
import trio

from hetmesh.errors import InsufficientCapacity, NoRoute
from hetmesh.node.route_wait import hopeless, lost_units, mesh_verdict
from hetmesh.scheduler.records import Plan
from tests.unit.scheduler.sched_helpers import hand_pipeline, hand_plan, hand_stage

VERDICT = "m (int4 weights) does not fit on these 3 device(s): 0.10 GiB more free memory"


_pipeline, _plan = hand_pipeline, hand_plan


# a four-stage cut, and the same with a standby replica of its third stage on E
CUT = _plan(
    _pipeline(
        hand_stage("A", 0, 2), hand_stage("B", 2, 4), hand_stage("C", 4, 6), hand_stage("D", 6, 8)
    )
)
BACKED = _plan(
    CUT.pipelines[0],
    _pipeline(
        hand_stage("A", 0, 2), hand_stage("B", 2, 4), hand_stage("E", 4, 6), hand_stage("D", 6, 8)
    ),
)


@pytest.mark.parametrize(
    ("plan", "live", "verdict", "hopeless_"),
    [
        # the coordinator has not said it cannot place the model: wait
        (CUT, {"A", "B", "D"}, "", False),
        (None, {"A"}, "", False),
        # it said so and no plan is followed: refuse
        (None, {"A"}, VERDICT, True),
        # it said so, and the plan followed lost a peer: refuse
        (CUT, {"A", "B", "D"}, VERDICT, True),
        # a pipeline of live peers remains (a standby replica): it may still serve
        (BACKED, {"A", "B", "D", "E"}, VERDICT, False),
        (BACKED, {"A", "B", "D"}, VERDICT, True),
        # every peer of the plan alive (loading, or a stale verdict): wait
        (CUT, {"A", "B", "C", "D"}, VERDICT, False),
    ],
)
def test_waiting_is_hopeless_only_when_the_mesh_says_so_and_no_pipeline_lives(
    plan: Plan | None, live: set[str], verdict: str, hopeless_: bool
) -> None:
    assert bool(hopeless(plan, live, verdict)) == hopeless_


def test_the_refusal_names_the_memory_and_the_units_that_lost_their_host() -> None:
    why = hopeless(BACKED, {"A", "D"}, VERDICT)
    assert why.startswith(VERDICT)
    assert "units [2,4) (their host B left)" in why
    assert "units [4,6) (their host C left)" in why
    assert "units [4,6) (their host E left)" in why
    assert "[0,2)" not in why
    assert lost_units(CUT, {"A", "B", "C", "D"}) == []


@pytest.mark.parametrize(
    ("boss", "own", "announced", "verdict"),
    [
        ("A", VERDICT, {"B": ""}, VERDICT),  # we coordinate: our own verdict
        ("A", "", {"B": VERDICT}, ""),  # we coordinate and can place it: a peer's is stale
        ("B", VERDICT, {"B": ""}, ""),  # ours is from when we coordinated: stale
        ("B", "", {"B": VERDICT, "C": ""}, VERDICT),  # the coordinator's announced verdict
        ("C", "", {"B": VERDICT}, ""),  # the coordinator (not live here) said nothing
        (None, "", {"B": "", "C": VERDICT}, VERDICT),  # no coordinator known: any verdict
        (None, VERDICT, {}, VERDICT),
    ],
)
def test_only_the_coordinators_verdict_counts(
    boss: str | None, own: str, announced: dict[str, str], verdict: str
) -> None:
    assert mesh_verdict("A", boss, own, announced) == verdict


# -- the wait itself (RouteChooser.choose), on trio's virtual clock -------------------


class _Follower:
    def __init__(self, plan: Plan | None, insufficient: str = "", boss: str | None = "B") -> None:
        self.plan = plan
        self.insufficient = insufficient
        self.boss = boss


class _View:
    """Live members; ``verdicts``: what some of them announce they cannot place."""

    def __init__(self, live: set[str], verdicts: dict[str, str] | None = None) -> None:
        from hetmesh.node.peer_view import PeerState
        from hetmesh.scheduler.announcement import ServingAnnouncement

        said = verdicts or {}
        self.members = tuple(
            PeerState(p, ServingAnnouncement(insufficient=said.get(p, ""))) for p in sorted(live)
        )


def _chooser(follower: _Follower, view: _View, routes: list[tuple[object, ...]]) -> object:
    """A RouteChooser over fakes: ``routes`` pops one route per look (empty: none)."""
    from hetmesh.node.route_chooser import RouteChooser

    chooser = RouteChooser.__new__(RouteChooser)
    chooser.me, chooser.model_key, chooser.route_wait_s = "A", "m", 30.0
    chooser.follower = follower  # type: ignore[assignment]
    chooser._view = lambda: view  # type: ignore[assignment,return-value]
    chooser._changed = trio.Event()
    chooser.route = lambda *_: routes.pop(0) if routes else ()  # type: ignore[method-assign]
    return chooser


def _run(body: object) -> object:
    from trio.testing import MockClock

    return trio.run(body, clock=MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_a_hopeless_wait_is_refused_at_once() -> None:
    chooser = _chooser(_Follower(CUT), _View({"A", "B", "D"}, {"B": VERDICT}), [])

    async def body() -> float:
        with pytest.raises(InsufficientCapacity, match=r"units \[4,6\) \(their host C left\)"):
            await chooser.choose("s", frozenset())  # type: ignore[attr-defined]
        return trio.current_time()

    assert _run(body) == 0.0


def test_a_wait_without_a_verdict_ends_in_no_route_after_the_route_wait() -> None:
    chooser = _chooser(_Follower(CUT), _View({"A", "B", "D"}), [])

    async def body() -> float:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_tick, chooser, 100)
            with pytest.raises(NoRoute):
                await chooser.choose("s", frozenset())  # type: ignore[attr-defined]
            nursery.cancel_scope.cancel()
        return trio.current_time()

    assert _run(body) == pytest.approx(30.0, abs=1.0)


def test_a_new_plan_counts_the_route_wait_afresh() -> None:
    """A re-plan adopted 20 s into the wait: its stages load for up to another 30 s."""
    follower = _Follower(CUT)
    chooser = _chooser(follower, _View({"A", "B", "D"}), [])
    replanned = _plan(
        _pipeline(hand_stage("A", 0, 3), hand_stage("B", 3, 6), hand_stage("D", 6, 8))
    )

    async def body() -> tuple[object, float]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_tick, chooser, 100)

            async def replan() -> None:
                await trio.sleep(20)
                follower.plan = replanned
                await trio.sleep(25)  # ready 45 s into the wait
                chooser.route = lambda *_: ("hops",)  # type: ignore[attr-defined]

            nursery.start_soon(replan)
            hops = await chooser.choose("s", frozenset())  # type: ignore[attr-defined]
            nursery.cancel_scope.cancel()
        return hops, trio.current_time()

    hops, when = _run(body)  # type: ignore[misc]
    assert hops == ("hops",)
    assert when == pytest.approx(45.0, abs=1.0)


async def _tick(chooser: object, times: int) -> None:
    """The plan loop's once-a-second ``changed()``."""
    for _ in range(times):
        await trio.sleep(1)
        chooser.changed()  # type: ignore[attr-defined]
