"""Copy-on-write member tables: the simulator's shared start equals a real join."""

from __future__ import annotations

import random

import pytest

from hetmesh.discovery.cow import CowDict, CowList, CowSet
from hetmesh.discovery.membership import Membership, converged_view
from hetmesh.discovery.simnet import SimNet
from hetmesh.discovery.table import Health, PeerEntry
from hetmesh.discovery.wire import Announcement


def _record(peer: str, boot: int) -> Announcement:
    return Announcement(version="t", peer_id=peer, boot_id=boot, seq=1, addrs=(f"/sim/{peer}",))


def test_cow_dict_copies_entries_it_reads_and_leaves_the_base_alone() -> None:
    base = {"a": PeerEntry(peer_id="a"), "b": PeerEntry(peer_id="b")}
    d: CowDict[str, PeerEntry] = CowDict(base)
    d["a"].refusals = 3  # changed in place, as the protocol does
    assert base["a"].refusals == 0
    assert d["a"].refusals == 3
    del d["b"]
    d["c"] = PeerEntry(peer_id="c")
    assert "b" not in d
    assert "b" in base
    assert d.get("b") is None
    assert len(d) == 2
    assert sorted(d) == ["a", "c"]
    d["b"] = PeerEntry(peer_id="b", refusals=1)  # back again
    assert len(d) == 3
    assert d["b"].refusals == 1
    del d["c"]
    assert len(d) == 2
    with pytest.raises(KeyError):
        del d["c"]


def test_cow_list_matches_a_list_under_the_live_list_operations() -> None:
    rng = random.Random(4)
    base = list(range(50))
    plain, cow = list(base), CowList(base)
    for _ in range(500):
        op = rng.randrange(3)
        if op == 0:
            plain.append(v := rng.randrange(1000))
            cow.append(v)
        elif op == 1 and plain:
            assert plain.pop() == cow.pop()
        elif plain:
            i = rng.randrange(len(plain))
            plain[i] = cow[i] = rng.randrange(1000)
        assert len(cow) == len(plain)
    assert list(cow) == plain
    assert base == list(range(50))


def test_cow_set_adds_without_touching_its_base() -> None:
    base = frozenset({"a"})
    s: CowSet[str] = CowSet(base)
    s.add("b")
    assert "a" in s
    assert "b" in s
    assert "c" not in s


def test_adopted_view_equals_hearing_every_record_directly() -> None:
    ids = [f"p{i}" for i in range(12)]
    records = [_record(p, i + 2) for i, p in enumerate(ids)]
    view = converged_view(records, 3.0)
    for me in ("p0", "p5", "p11"):
        heard = Membership(me, boot_id=99)
        for r in records:
            heard.note_record(r, 3.0, direct=True)
        adopted = Membership(me, boot_id=99)
        adopted.adopt_view(view)
        assert sorted(adopted.entries) == sorted(heard.entries)
        for peer in heard.entries:
            assert adopted.entries[peer] == heard.entries[peer]
        assert sorted(adopted.live_ids()) == sorted(heard.live_ids())
        assert me not in adopted.live_ids()
    # nothing a node did leaked into the shared table
    assert all(e.health is Health.ALIVE for e in view.entries.values())


def test_simnet_prefilled_mesh_detects_a_crash_without_false_deaths() -> None:
    net = SimNet(seed=2, loss=0.01)
    ids = [f"p{i:03d}" for i in range(60)]
    for peer in ids:
        net.add_node(peer)
    net.prefill(ids)
    net.run_until(5.0)
    net.crash(ids[7])
    net.run_until(10.0)
    dead = {v.observer for v in net.verdicts if v.event.new is Health.DEAD}
    assert all(v.event.peer_id == ids[7] for v in net.verdicts if v.event.new is Health.DEAD)
    assert dead == set(ids) - {ids[7]}  # every live node buried it
