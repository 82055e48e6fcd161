"""``hetmesh status``: the plan, bottleneck and load summary and its rendering (pure)."""

from __future__ import annotations

import copy
from typing import Any

from hetmesh.cli.status import render_status
from hetmesh.cli.status_view import summarize

A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaa1111"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBbbbb2222"


def _stage(peer: str, start: int, end: int, step_s: float) -> dict[str, Any]:
    return {
        "peer_id": peer,
        "device": "cpu",
        "start": start,
        "end": end,
        "decode_step_s": step_s,
        "batch_step_s": step_s,
        "prefill_s_per_1k": 1.0,
        "link_out_s": 0.0,
        "memory_bytes": 1,
    }


PLAN = {
    "epoch": 3,
    "model_name": "smollm2",
    "objective": "latency",
    "strategy": "exact",
    "pipelines": [
        {
            "stages": [_stage(A, 0, 10, 0.004), _stage(B, 10, 32, 0.009)],
            "decode_latency_s": 0.015,
            "prefill_s_per_1k": 1.0,
            "bottleneck_s": 0.009,
            "throughput_tps": 66.0,
        }
    ],
    "objective_value": 0.015,
    "decode_latency_s": 0.015,
    "prefill_s_per_1k": 1.0,
    "throughput_tps": 66.0,
}


def _peer(pid: str, health: str, *, recent: list[float], tokens: int, sessions: int) -> Any:
    return {
        "peer_id": pid,
        "health": health,
        "record": {
            "peer_id": pid,
            "addrs": [],
            "devices": [],
            "stages": [
                {
                    "model": "smollm2",
                    "start": 0 if pid == A else 10,
                    "end": 10 if pid == A else 32,
                    "ready": True,
                }
            ],
            "load": {
                "active_sessions": sessions,
                "queue_depth": 1,
                "kv_bytes_used": 3 << 20,
                "recent_step_s": recent,
            },
            "extra": {"gateway": {"tokens_out": tokens}, **({"plan": PLAN} if pid == A else {})},
        },
    }


VIEW = {
    "self": A,
    "peers": [
        _peer(A, "self", recent=[0.020, 0.030, 0.025], tokens=100, sessions=2),
        _peer(B, "alive", recent=[0.010], tokens=0, sessions=2),
    ],
    "links": [],
}


def test_summary_marks_the_measured_bottleneck() -> None:
    summary = summarize(VIEW)
    plan = summary["plan"]
    assert plan["epoch"] == 3
    stages = plan["pipelines"][0]["stages"]
    assert [s["measured_step_s"] for s in stages] == [0.025, 0.010]
    # predicted says B is slower, measured says A: measurements win
    assert [s["bottleneck"] for s in stages] == [True, False]
    assert plan["pipelines"][0]["ready"] is True


def test_summary_falls_back_to_predictions_without_measurements() -> None:
    view = copy.deepcopy(VIEW)
    for peer in view["peers"]:
        peer["record"]["load"]["recent_step_s"] = []
    stages = summarize(view)["plan"]["pipelines"][0]["stages"]
    assert [s["bottleneck"] for s in stages] == [False, True]
    assert stages[0]["measured_step_s"] is None


def test_summary_tokens_per_second_from_two_views() -> None:
    later = copy.deepcopy(VIEW)
    later["peers"][0]["record"]["extra"]["gateway"]["tokens_out"] = 150
    load = summarize(later, VIEW, 2.0)["load"]
    assert load["tokens_per_s"] == 25.0
    assert load["sessions"] == 4
    assert load["queue"] == 2
    assert summarize(VIEW)["load"]["tokens_per_s"] is None


def test_summary_picks_the_newest_plan_and_copes_without_one() -> None:
    view = copy.deepcopy(VIEW)
    newer = copy.deepcopy(PLAN)
    newer["epoch"] = 9
    view["peers"][1]["record"]["extra"]["plan"] = newer
    assert summarize(view)["plan"]["epoch"] == 9
    assert summarize({"peers": []})["plan"] is None


def test_render_shows_plan_bottleneck_and_load() -> None:
    later = copy.deepcopy(VIEW)
    later["peers"][0]["record"]["extra"]["gateway"]["tokens_out"] = 130
    text = render_status({**later, "summary": summarize(later, VIEW, 1.0)}, width=220)
    assert "plan epoch 3 (exact, latency)" in text
    assert "predicted 15.0 ms/token" in text
    assert "[0, 10)" in text
    assert "[10, 32)" in text
    assert "25.0 ms" in text  # A's measured median
    assert "9.0 ms" in text  # B's prediction
    assert text.count("bottleneck") == 1
    assert "load: 4 sessions, queue 2, 30.0 tokens/s" in text
    assert "memory used" in text


def test_render_without_a_plan_says_so() -> None:
    text = render_status({"self": A, "peers": [], "links": []})
    assert "no plan published yet" in text


def test_a_dead_peers_stage_is_not_ready_as_the_router_sees_it() -> None:
    """Readiness is the peer view's (ready_stages_in_view): a stage a dead peer still
    announces loaded is out of every route, and status says so."""
    view = copy.deepcopy(VIEW)
    view["peers"][1]["health"] = "dead"
    pipeline = summarize(view)["plan"]["pipelines"][0]
    assert [s["ready"] for s in pipeline["stages"]] == [True, False]
    assert pipeline["ready"] is False
    text = render_status({**view, "summary": summarize(view)}, width=220)
    assert "unreachable, dead" in text
    assert "ready, self" in text
