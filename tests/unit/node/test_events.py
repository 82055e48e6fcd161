"""The dashboard feed: events derived from two status views, the series, bounded clients."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from hetmesh.errors import Rejected
from hetmesh.node.events import Feed, PlanCache, Series, newest_plan, view_events

A, B, C = "12D3KooWAAAAAAAAAAAA", "12D3KooWBBBBBBBBBBBB", "12D3KooWCCCCCCCCCCCC"


def _plan() -> dict[str, Any]:
    from hetmesh.scheduler.records import Pipeline, Plan, Stage

    def stage(pid: str, start: int, end: int) -> Stage:
        return Stage(
            peer_id=pid,
            device="cpu",
            start=start,
            end=end,
            decode_step_s=0.01,
            batch_step_s=0.01,
            prefill_s_per_1k=0.5,
            link_out_s=0.001,
            memory_bytes=1 << 20,
        )

    pipe = Pipeline(
        stages=(stage(A, 0, 4), stage(B, 4, 8)),
        decode_latency_s=0.02,
        prefill_s_per_1k=1.0,
        bottleneck_s=0.01,
        throughput_tps=50.0,
    )
    plan = Plan(
        epoch=3,
        model_name="m",
        objective="latency",
        strategy="exact",
        pipelines=(pipe,),
        objective_value=0.02,
        decode_latency_s=0.02,
        prefill_s_per_1k=1.0,
        throughput_tps=50.0,
    )
    return plan.to_wire()


PLAN = _plan()


def peer(pid: str, health: str, *, stages: Any = (), plan: Any = None, **gateway: int) -> Any:
    extra: dict[str, Any] = {"gateway": gateway} if gateway else {}
    if plan is not None:
        extra["plan"] = plan
    record = {"stages": [dict(s) for s in stages], "extra": extra}
    return {"peer_id": pid, "health": health, "record": record}


def view(*peers: Any) -> dict[str, Any]:
    return {"self": A, "peers": list(peers)}


def kinds(before: Any, after: Any) -> list[tuple[str, str | None]]:
    return [(e["kind"], e.get("peer_id")) for e in view_events(before, after)]


def test_the_first_view_is_state_not_events() -> None:
    assert view_events(None, view(peer(A, "self"), peer(B, "alive"))) == []


@pytest.mark.parametrize(
    ("was", "now", "expected"),
    [
        (None, "alive", [("joined", B)]),
        (None, "joining", [("joined", B)]),
        ("joining", "alive", [("alive", B)]),
        ("alive", "suspect", [("suspect", B)]),
        ("suspect", "dead", [("dead", B)]),
        ("alive", "left", [("left", B)]),
        ("dead", "alive", [("joined", B)]),
        ("suspect", "alive", [("alive", B)]),
        ("alive", "alive", []),
        ("alive", None, [("left", B)]),
    ],
)
def test_health_changes_are_events(was: str | None, now: str | None, expected: Any) -> None:
    before = view(peer(A, "self"), *([peer(B, was)] if was else []))
    after = view(peer(A, "self"), *([peer(B, now)] if now else []))
    assert kinds(before, after) == expected


def test_a_dead_peer_is_an_error_and_a_suspect_a_warning() -> None:
    before = view(peer(A, "self"), peer(B, "alive"), peer(C, "alive"))
    after = view(peer(A, "self"), peer(B, "dead"), peer(C, "suspect"))
    levels = {e["peer_id"]: e["level"] for e in view_events(before, after)}
    assert levels == {B: "error", C: "warn"}
    assert "is dead (was alive)" in view_events(before, after)[0]["message"]


def test_a_new_plan_loaded_stages_and_recoveries_are_events() -> None:
    stage = {"model": "m", "start": 0, "end": 4, "ready": False}
    before = view(peer(A, "self", stages=[stage], recoveries=1), peer(B, "alive"))
    after = view(
        peer(A, "self", stages=[dict(stage, ready=True)], plan=PLAN, recoveries=3),
        peer(B, "alive"),
    )
    events = view_events(before, after)
    assert [e["kind"] for e in events] == ["plan", "stage", "recovery"]
    assert events[0]["epoch"] == 3
    assert events[0]["strategy"] == "exact"
    assert (events[1]["start"], events[1]["end"]) == (0, 4)
    assert events[2]["sessions"] == 2
    assert view_events(after, after) == []  # nothing changed, nothing said


def test_the_series_derives_tokens_per_s_and_averages_latencies() -> None:
    series = Series(length=3)
    first = series.sample(view(peer(A, "self", tokens_out=10), peer(B, "alive")), 100.0)
    assert first["tokens_per_s"] is None
    assert first["ttft_s"] is None
    series.observe(0.2, 0.05)
    series.observe(0.4, None)
    second = series.sample(view(peer(A, "self", tokens_out=30), peer(B, "alive")), 102.0)
    assert second["tokens_per_s"] == pytest.approx(10.0)
    assert second["ttft_s"] == pytest.approx(0.3)
    assert second["tpot_s"] == pytest.approx(0.05)
    # a restarted peer's counter falls back to 0: never a negative rate
    third = series.sample(view(peer(A, "self", tokens_out=2), peer(B, "alive")), 103.0)
    assert third["tokens_per_s"] == 0.0
    assert third["ttft_s"] is None
    series.sample(view(peer(A, "self")), 104.0)
    assert len(series.samples) == 3  # bounded


async def test_a_slow_client_is_dropped_not_buffered() -> None:
    health = {"B": "alive"}

    def current() -> dict[str, Any]:
        return view(peer(A, "self"), peer(B, health["B"]))

    feed = Feed(current, queue=4, backlog=2, max_clients=2)
    fast, slow = feed.subscribe(), feed.subscribe()
    with pytest.raises(Rejected, match="busy"):
        feed.subscribe()
    with fast as fast_rx, slow as slow_rx:
        for i in range(10):
            health["B"] = ("alive", "suspect")[i % 2]
            feed.tick(float(i))
            while True:  # the fast client reads everything as it comes
                try:
                    fast_rx.receive_nowait()
                except trio.WouldBlock:
                    break
        assert feed.dropped_clients == 1
        assert feed.clients == 1
        buffered = [slow_rx.receive_nowait() for _ in range(4)]  # what fit in its buffer
        assert all(m.startswith("event: ") for m in buffered)
        with pytest.raises(trio.EndOfChannel):  # ... and then the end: it reconnects
            slow_rx.receive_nowait()
    assert feed.clients == 0
    assert len(feed.events) == 2  # the backlog is bounded too
    assert '"kind": "alive"' in feed.hello() or '"kind": "suspect"' in feed.hello()


def test_the_plan_cache_picks_the_newest_valid_plan_as_the_scheduler_does() -> None:
    from hetmesh.scheduler.replan import newest_in_view

    newer = dict(PLAN, epoch=4)
    broken = dict(PLAN, epoch=9, pipelines="not a list")
    current = view(
        peer(A, "self", plan=PLAN), peer(B, "alive", plan=newer), peer(C, "alive", plan=broken)
    )
    cache = PlanCache(size=2)
    for _ in range(3):  # cached answers stay right
        chosen = cache.newest(current)
        assert chosen is not None
        assert chosen["epoch"] == 4
    expected = newest_in_view(current)
    assert expected is not None
    assert chosen == expected.to_wire() == newest_plan(current)
    assert cache.newest(view(peer(A, "self"))) is None


def test_hostile_records_never_break_the_status_readers() -> None:
    """A stage entry with ``"start": "x"`` (and its kin) reads as absent in every
    reader /health, the status view and the dashboard use."""
    from hetmesh.cli.status_view import summarize
    from hetmesh.node.peer_view import ready_stages_in_view

    bad_plan = {**PLAN, "pipelines": [{"stages": [{"peer_id": B, "start": "x", "end": 4}]}]}
    hostile = [
        {"model": "m", "start": "x", "end": 4, "ready": True},
        {"model": "m", "start": 0, "end": float("nan"), "ready": True},
        {"model": "m", "start": 2**64, "end": 2**65, "ready": True},
        "junk",
        None,
    ]
    good = peer(A, "self", stages=[{"model": "m", "start": 0, "end": 4, "ready": True}], plan=PLAN)
    bad = peer(B, "alive", plan=bad_plan)
    bad["record"]["stages"] = hostile
    bad["record"]["extra"]["gateway"] = {"tokens_out": float("nan"), "x": "y"}
    before, after = view(good), view(good, bad)
    assert ready_stages_in_view(after) == {(A, 0, 4)}
    assert newest_plan(after) == PLAN
    view_events(before, after)  # no exception
    summary = summarize(after)
    assert summary["plan"]["epoch"] == 3
