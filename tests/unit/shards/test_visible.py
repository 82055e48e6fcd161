"""Shards are visible: status shows units on disk and fetches per peer, /metrics counts bytes."""

from __future__ import annotations

from hetmesh.cli.status import render_status
from hetmesh.cli.status_view import summarize
from hetmesh.node.api_metrics import ApiMetrics, MeshGauges
from hetmesh.scheduler.announcement import ServingAnnouncement, serving_extra

MANIFEST = "ab" * 32


def _peer(pid: str, state: ServingAnnouncement) -> dict[str, object]:
    return {
        "peer_id": pid,
        "health": "alive",
        "record": {"peer_id": pid, "extra": serving_extra(state)},
    }


def test_status_shows_units_held_and_the_fetch_in_progress() -> None:
    holder = ServingAnnouncement(model="m", manifest=MANIFEST, units_held=((0, 32),))
    joiner = ServingAnnouncement(
        model="m",
        manifest=MANIFEST,
        units_held=((0, 1), (5, 9)),
        shards={
            "fetching": 1.0,
            "fetch_done_bytes": 10 * 2**20,
            "fetch_total_bytes": 40 * 2**20,
            "fetch_rate_bps": 2.5 * 2**20,
        },
    )
    idle = ServingAnnouncement(model="m", manifest=MANIFEST, shards={"fetching": 0.0})
    view = {
        "self": "A",
        "peers": [_peer("A", holder), _peer("B", joiner), _peer("C", idle)],
        "links": [],
    }
    peers = {p["peer_id"]: p for p in summarize(view)["load"]["peers"]}
    assert peers["A"]["units_held"] == [[0, 32]]
    assert peers["A"]["fetch"] is None
    assert peers["B"]["units_held"] == [[0, 1], [5, 9]]
    assert peers["B"]["fetch"] == {
        "done_bytes": 10 * 2**20,
        "total_bytes": 40 * 2**20,
        "rate_bps": 2.5 * 2**20,
    }
    assert peers["C"]["fetch"] is None
    text = render_status(view, width=260)
    assert "units on disk" in text
    assert "0-31" in text
    assert "0, 5-8" in text
    assert "10/40 MiB at 2.5 MiB/s" in text


class _Gauges:
    def gauges(self) -> MeshGauges:
        return MeshGauges(
            shard_bytes_fetched=1234, shard_bytes_served=99, shard_verification_failures=2
        )


def test_metrics_count_shard_bytes_and_verification_failures() -> None:
    text = ApiMetrics(_Gauges()).render().decode()
    assert "hetmesh_shard_bytes_fetched_total 1234.0" in text
    assert "hetmesh_shard_bytes_served_total 99.0" in text
    assert "hetmesh_shard_verification_failures_total 2.0" in text


def test_status_says_which_units_no_peer_holds() -> None:
    verdict = "no live peer holds units [5, 9) of m (ModelNotFound): start a node that has it"
    joiner = ServingAnnouncement(model="m", manifest=MANIFEST, insufficient=verdict)
    view = {"self": "A", "peers": [_peer("A", joiner)], "links": []}
    assert summarize(view)["insufficient"] == verdict
    assert "no live peer holds units [5, 9) of m" in render_status(view, width=260)
