"""The admission queue and migrations per stage reach `hetmesh status` and /metrics.

A real KVManager (over the unit tests' block pool) refuses sessions that keep
their place in line; its counters, as a stage announces them, are rendered by
the status table and exported by /metrics (pure: records in, text out).
"""

from __future__ import annotations

import pytest
from rich.console import Console

from hetmesh.cli.status_view import kv_table, summarize
from hetmesh.errors import Rejected
from hetmesh.node.api_metrics import ApiMetrics, MeshGauges
from hetmesh.node.kvcache import KVLimits, KVManager, Stamp, kv_counters
from tests.unit.node.test_kvcache import Cache, Clock, Pool


def waiting_stage() -> tuple[KVManager[Cache], Clock]:
    clock = Clock()
    pool = Pool(10)
    kv = KVManager(
        KVLimits(8, 160, 1000, 300.0, reserve_blocks=1),
        pool=pool,
        factory=lambda: Cache(pool),
        clock=clock,
        wall=clock,
    )
    kv.open("a", 144, prompt_tokens=144)  # 9 of 10 blocks: the others wait
    for i in range(3):
        with pytest.raises(Rejected):
            kv.open(f"w{i}.0", 64, prompt_tokens=64, stamp=Stamp(float(i), f"w{i}"))
    kv.note_migration_in(3 * 2**20)
    kv.note_migration_out()
    return kv, clock


def test_the_counters_count_the_waiters_still_in_line():
    kv, clock = waiting_stage()
    counters = kv_counters(kv.statistics())
    assert counters["kv_waiting"] == 3
    assert (counters["kv_migrations"], counters["kv_migrated_bytes"]) == (1, 3 * 2**20)
    assert counters["kv_migrations_out"] == 1
    clock.now += 6.0  # their gateways stopped retrying: no longer waiting
    assert kv_counters(kv.statistics())["kv_waiting"] == 0


def test_status_shows_waiting_and_migrated_bytes_per_stage():
    kv, _ = waiting_stage()
    stage = {"start": 0, "end": 11} | kv_counters(kv.statistics())
    view = {
        "peers": [
            {"peer_id": "12D3KooWaaaa", "health": "self", "record": {"extra": {}}},
            {
                "peer_id": "12D3KooWbbbb",
                "health": "alive",
                "record": {"extra": {"stage_servers": [stage]}},
            },
        ]
    }
    (row,) = summarize(view)["kv"]
    assert (row["waiting"], row["migrations"], row["migrated_bytes"]) == (3, 1, 3 * 2**20)
    console = Console(width=200, record=True)
    console.print(kv_table(summarize(view)))
    text = console.export_text()
    assert "waiting" in text
    assert "1 (3.0 MiB)" in text


class Backend:
    def __init__(self, counters: dict[str, float]) -> None:
        self.counters = counters

    def gauges(self) -> MeshGauges:
        return MeshGauges(stages_kv=(("0-11", self.counters),))


def test_metrics_export_waiting_and_migrations_both_ways():
    kv, _ = waiting_stage()
    text = ApiMetrics(Backend(kv_counters(kv.statistics()))).render().decode()
    assert 'hetmesh_kv_waiting{stage="0-11"} 3.0' in text
    assert 'hetmesh_kv_migrations_total{stage="0-11"} 1.0' in text
    assert 'hetmesh_kv_migrated_bytes_total{stage="0-11"} 3.145728e+06' in text
    assert 'hetmesh_kv_migrations_out_total{stage="0-11"} 1.0' in text
    assert 'hetmesh_kv_blocks{stage="0-11",state="in_use"} 9.0' in text
