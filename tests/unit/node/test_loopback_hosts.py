"""Peers on one host: the records name it, and their links' drift moves no plan.

A link's RTT between two processes of one machine, under CPU load, is the CPU's wait
(the exactness run of 2026-12-12 re-planned a float32 cut on it): the snapshot a
coordinator plans on carries each peer's announced host, and drift on a link whose
ends share one is not drift.
"""

from __future__ import annotations

import dataclasses

from hetmesh.discovery.wire import Announcement, Load
from hetmesh.node.plan_follower import (
    HOST_KEY,
    MAX_HOST_CHARS,
    loopback_floors,
    record_host,
    snapshot,
)
from hetmesh.node.serving import announced_host
from hetmesh.resources import LinkProfile
from hetmesh.scheduler.replan import MeshSnapshot, should_replan
from tests.unit.scheduler.sched_helpers import cpu_device

PEERS = ("a", "b", "c", "d", "e")


def _record(peer: str, plane: object, rtt_s: float = 2e-4) -> Announcement:
    return Announcement(
        version="1",
        peer_id=peer,
        boot_id=1,
        seq=1,
        addrs=(),
        devices=(cpu_device(peer),),
        links=tuple(
            LinkProfile(src=peer, dst=q, rtt_s=rtt_s, bandwidth_bps=1e9) for q in PEERS if q != peer
        ),
        data_plane=plane,  # type: ignore[arg-type]
        load=Load(),
    )


def _planes() -> dict[str, object]:
    return {
        "a": {"backends": ["shm", "tcp"], HOST_KEY: "h1"},
        "b": {"backends": ["tcp"], HOST_KEY: "h1"},
        "c": {"backends": ["tcp"], HOST_KEY: "h2"},
        "d": {HOST_KEY: "h1" + "x" * MAX_HOST_CHARS},  # too long: no host
        "e": {HOST_KEY: 7},  # not a string: no host
    }


def test_the_snapshot_carries_each_peers_announced_host_within_bounds() -> None:
    planes = _planes()
    records = [_record(p, planes[p]) for p in PEERS]
    mesh, _ = snapshot(records)
    assert mesh.hosts == (("a", "h1"), ("b", "h1"), ("c", "h2"))
    assert mesh.colocated("a", "b")
    assert not mesh.colocated("a", "c")
    assert not mesh.colocated("d", "a")  # an oversized name is no claim
    assert record_host(records[4]) == ""  # a number is no claim either
    assert record_host(_record("f", {})) == ""
    assert record_host(_record("g", "not a map")) == ""


def test_drift_on_loopback_links_alone_moves_no_plan() -> None:
    planes = {p: v for p, v in _planes().items() if p in ("a", "b", "c")}
    quiet, _ = snapshot([_record(p, planes[p]) for p in ("a", "b", "c")])

    def loaded(slow: set[str]) -> list[Announcement]:
        return [_record(p, planes[p], rtt_s=2e-3 if p in slow else 2e-4) for p in ("a", "b", "c")]

    # a and b (one host) read their probes 10x longer: both their links to each other
    # and to c drift; only the loopback pair is discounted
    both, _ = snapshot(loaded({"a", "b"}))
    verdict = should_replan(quiet, both)
    assert verdict.drift
    assert "-> c" in verdict.reason  # a -> c or b -> c: a wire between hosts
    # only loopback figures moved: no drift
    loop_only = dataclasses.replace(
        both,
        links=tuple(
            x
            if both.colocated(x.src, x.dst)
            else next(y for y in quiet.links if (y.src, y.dst) == (x.src, x.dst))
            for x in both.links
        ),
    )
    assert any(x.rtt_s == 2e-3 for x in loop_only.links)
    assert not should_replan(quiet, loop_only).act


def test_this_process_announces_a_stable_short_host() -> None:
    host = announced_host()
    assert host == announced_host()
    assert len(host) == 32
    assert int(host, 16) >= 0
    assert len(host) <= MAX_HOST_CHARS


def test_a_loopback_link_is_planned_on_its_best_measurement() -> None:
    planes = {p: v for p, v in _planes().items() if p in ("a", "b", "c")}

    def mesh_at(rtt_s: float, peers: tuple[str, ...] = ("a", "b", "c")) -> MeshSnapshot:
        return snapshot([_record(p, planes[p], rtt_s=rtt_s) for p in peers])[0]

    quiet, floors = loopback_floors(mesh_at(2e-4), {})
    assert set(floors) == {("a", "b"), ("b", "a")}  # the loopback pair only
    assert quiet == mesh_at(2e-4)  # nothing better seen yet: as measured
    # under load every probe reads 10x longer: the loopback pair keeps its best, the
    # links to the other host carry what they measure (a wire's drift is the wire's)
    loaded, floors = loopback_floors(mesh_at(2e-3), floors)
    rtts = {(x.src, x.dst): x.rtt_s for x in loaded.links}
    assert rtts[("a", "b")] == rtts[("b", "a")] == 2e-4
    assert rtts[("a", "c")] == rtts[("c", "b")] == 2e-3
    assert should_replan(quiet, loaded).reason.startswith("drift: link a -> c rtt")
    # a better measurement is the new best
    better, floors = loopback_floors(mesh_at(1e-4), floors)
    assert {(x.src, x.dst): x.rtt_s for x in better.links}[("a", "b")] == 1e-4
    assert floors[("a", "b")].rtt_s == 1e-4
    # b leaves: its links' bests go with it (bounded by the links measured now)
    alone, floors = loopback_floors(mesh_at(2e-3, ("a", "c")), floors)
    assert floors == {}
    assert alone == mesh_at(2e-3, ("a", "c"))
