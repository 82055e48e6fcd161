"""The demand signal of several models: which one a joining ``--model mesh`` node serves."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from hetmesh.discovery.wire import Announcement, Load
from hetmesh.scheduler.announcement import ServingAnnouncement, serving_extra
from hetmesh.scheduler.demand import (
    DEMAND_KEY,
    MemberLoad,
    demand_per_member,
    neediest,
    split_recent,
)
from hetmesh.shards.fetch import announced_manifests, manifest_loads

A, B = "a" * 64, "b" * 64  # two manifest ids


def test_the_busiest_model_per_member_is_the_neediest() -> None:
    busy_few = [MemberLoad(sessions=3, queued=1)]
    busy_many = [MemberLoad(sessions=3, queued=1), MemberLoad(), MemberLoad()]
    assert demand_per_member(busy_few) == 4
    assert demand_per_member(busy_many) == pytest.approx(4 / 3)
    assert demand_per_member([]) == 0
    assert neediest({"big": busy_many, "small": busy_few}) == "small"
    # no demand anywhere: the model with the fewest members, then the first name
    assert neediest({"b": [MemberLoad()], "a": [MemberLoad(), MemberLoad()]}) == "b"
    assert neediest({"b": [MemberLoad()], "a": [MemberLoad()]}) == "a"
    with pytest.raises(ValueError, match="no model"):
        neediest({})


@dataclass
class Entry:
    peer_id: str
    record: Announcement | None


class Discovery:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries

    def alive(self) -> list[Entry]:
        return self.entries


def _member(peer: str, manifest: str, sessions: int, queued: int) -> Entry:
    extra = serving_extra(ServingAnnouncement(model=f"m-{manifest[0]}", manifest=manifest))
    load = Load(active_sessions=sessions, queue_depth=queued)
    record = Announcement(
        version="1", peer_id=peer, boot_id=1, seq=1, addrs=(), load=load, extra=extra
    )
    return Entry(peer, record)


def test_a_mesh_node_reads_each_models_load_from_its_members_records() -> None:
    discovery = Discovery(
        [
            _member("p1", A, 0, 0),
            _member("p2", A, 1, 0),
            _member("p3", B, 2, 3),
            Entry("p4", None),  # no record yet: not counted
        ]
    )
    seen = announced_manifests(discovery)
    assert seen == {A: ["p1", "p2"], B: ["p3"]}
    loads = manifest_loads(discovery, seen)
    assert loads == {A: [MemberLoad(0, 0), MemberLoad(1, 0)], B: [MemberLoad(2, 3)]}
    assert neediest(loads) == B


def _with_demand(entry: Entry, demand: object) -> Entry:
    assert entry.record is not None
    extra = {**entry.record.extra, DEMAND_KEY: demand}
    return Entry(entry.peer_id, dataclasses.replace(entry.record, extra=extra))


def test_recent_requests_a_node_announces_count_as_demand() -> None:
    # A's members are busy; B's node announces 6 recent requests over its 2 members
    discovery = Discovery(
        [
            _member("p1", A, 2, 0),
            _with_demand(_member("p2", B, 0, 0), {"recent": 3}),
            _with_demand(_member("p3", B, 0, 0), {"recent": 3}),
        ]
    )
    loads = manifest_loads(discovery, announced_manifests(discovery))
    assert loads[B] == [MemberLoad(0, 0, 3), MemberLoad(0, 0, 3)]
    assert demand_per_member(loads[B]) == 3
    assert neediest(loads) == B  # 3 per member against A's 2


@pytest.mark.parametrize("demand", [{"recent": -1}, {"recent": True}, {"recent": "9"}, [9], None])
def test_a_malformed_demand_entry_counts_as_none(demand: object) -> None:
    entry = _with_demand(_member("p1", A, 1, 2), demand)
    assert MemberLoad.of(entry.record) == MemberLoad(1, 2, 0)


def test_split_recent_adds_up() -> None:
    assert split_recent(7, 3) == [3, 2, 2]
    assert split_recent(1, 2) == [1, 0]
    assert split_recent(0, 1) == [0]
    assert split_recent(5, 0) == []
    for count in range(12):
        for members in range(1, 5):
            assert sum(split_recent(count, members)) == count
