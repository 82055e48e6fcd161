"""KV figures per stage reach `hetmesh status` and /metrics (pure: records in, text out)."""

from __future__ import annotations

from rich.console import Console

from hetmesh.cli.status_view import kv_table, summarize
from hetmesh.node.api_metrics import ApiMetrics, MeshGauges
from hetmesh.node.kvcache import KVStatistics, kv_counters

STATS = KVStatistics(
    sessions=2,
    bytes_used=0,
    bytes_reserved=0,
    budget_bytes=0,
    rejected_busy=0,
    expired=0,
    blocks_total=100,
    blocks_free=70,
    preempted=3,
    blocks_cached=12,
    prefix_queried_tokens=400,
    prefix_hit_tokens=300,
)


def test_kv_counters_name_every_figure_the_issue_asks_for():
    counters = kv_counters(STATS)
    assert counters["kv_blocks_in_use"] == 30
    assert counters["kv_blocks_free"] == 70
    assert counters["kv_blocks_cached"] == 12
    assert counters["kv_prefix_hit_rate"] == 0.75
    assert counters["kv_preempted"] == 3
    assert counters["kv_migrations"] == 0  # not built yet


def test_status_shows_each_stage_pool_and_ignores_junk():
    stage = {"start": 0, "end": 11, "rounds": 5} | kv_counters(STATS)
    junk = {"start": 11, "end": 32, "kv_blocks_free": "lots", "kv_preempted": True}
    view = {
        "peers": [
            {
                "peer_id": "12D3KooWaaaa",
                "health": "self",
                "record": {"extra": {"stage_servers": [stage]}},
            },
            {
                "peer_id": "12D3KooWbbbb",
                "health": "alive",
                "record": {"extra": {"stage_servers": [junk]}},
            },
        ]
    }
    rows = summarize(view)["kv"]
    assert [(r["start"], r["blocks_in_use"], r["blocks_free"]) for r in rows] == [
        (0, 30, 70),
        (11, 0, 0),
    ]
    assert rows[0]["prefix_hit_rate"] == 0.75
    console = Console(width=160, record=True)
    console.print(kv_table(summarize(view)))
    text = console.export_text()
    assert "[0, 11)" in text
    assert "75 %" in text


class Backend:
    def gauges(self) -> MeshGauges:
        return MeshGauges(stages_kv=(("0-11", kv_counters(STATS)),))


def test_metrics_export_blocks_hit_rate_and_preemptions_per_stage():
    text = ApiMetrics(Backend()).render().decode()
    assert 'hetmesh_kv_blocks{stage="0-11",state="in_use"} 30.0' in text
    assert 'hetmesh_kv_blocks{stage="0-11",state="cached"} 12.0' in text
    assert 'hetmesh_prefix_cache_hit_rate{stage="0-11"} 0.75' in text
    assert 'hetmesh_kv_preemptions_total{stage="0-11"} 3.0' in text
    assert 'hetmesh_kv_migrations_total{stage="0-11"} 0.0' in text
