"""The demand signal of several models: which one a joining ``--model mesh`` node serves."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hetmesh.discovery.wire import Announcement, Load
from hetmesh.scheduler.announcement import ServingAnnouncement, serving_extra
from hetmesh.scheduler.demand import MemberLoad, demand_per_member, neediest
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
