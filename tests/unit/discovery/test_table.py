"""Liveness and membership rules of the peer table, on a fake clock."""

from __future__ import annotations

import pytest

from hetmesh.discovery.table import Health, LivenessPolicy, PeerTable
from hetmesh.discovery.wire import Announcement

POLICY = LivenessPolicy(
    interval_s=1.0,
    suspect_after_intervals=3,
    dead_after_s=7.0,
    refusals_for_dead=2,
    hysteresis_s=3.0,
    tombstone_s=60.0,
)


def rec(peer: str = "B", seq: int = 1, boot: int = 1, goodbye: bool = False) -> Announcement:
    return Announcement(
        version="0",
        peer_id=peer,
        boot_id=boot,
        seq=seq,
        addrs=(f"/ip4/1.2.3.4/tcp/1/p2p/{peer}",),
        goodbye=goodbye,
    )


@pytest.fixture
def table() -> PeerTable:
    return PeerTable("A", POLICY)


def test_table_first_contact_is_admitted_at_once(table: PeerTable) -> None:
    events = table.note_announcement(rec(), now=0.0)
    assert [(e.peer_id, e.new) for e in events] == [("B", Health.ALIVE)]
    assert [e.peer_id for e in table.members()] == ["B"]


def test_table_ignores_own_announcements(table: PeerTable) -> None:
    assert table.note_announcement(rec("A"), now=0.0) == []
    assert table.members() == []


def test_table_suspect_after_three_missed_intervals_then_dead(table: PeerTable) -> None:
    table.note_announcement(rec(), now=0.0)
    assert table.tick(2.9) == []
    assert table.health_of("B") is Health.ALIVE
    table.tick(3.0)
    assert table.health_of("B") is Health.SUSPECT
    assert [e.peer_id for e in table.members()] == ["B"]  # suspect still listed
    assert table.alive() == []
    table.tick(6.9)
    assert table.health_of("B") is Health.SUSPECT
    table.tick(7.0)
    assert table.health_of("B") is Health.DEAD
    assert table.members() == []


def test_table_refused_dials_make_a_silent_peer_dead_early(table: PeerTable) -> None:
    table.note_announcement(rec(), now=0.0)
    table.note_refused("B", now=1.5)
    table.note_refused("B", now=2.0)
    assert table.health_of("B") is Health.ALIVE  # refusals alone are one probe, not a window
    table.tick(3.1)
    assert table.health_of("B") is Health.DEAD


def test_table_a_refusal_streak_is_reset_by_an_announcement(table: PeerTable) -> None:
    table.note_announcement(rec(seq=1), now=0.0)
    table.note_refused("B", now=0.5)
    table.note_announcement(rec(seq=2), now=1.0)
    table.note_refused("B", now=1.5)
    table.tick(4.1)
    assert table.health_of("B") is Health.SUSPECT


def test_table_stale_and_duplicate_records_are_ignored(table: PeerTable) -> None:
    table.note_announcement(rec(seq=5), now=0.0)
    assert table.note_announcement(rec(seq=5), now=1.0) == []
    assert table.note_announcement(rec(seq=3), now=1.0) == []
    assert table.stale == 2
    entry = table.entries["B"]
    assert entry.record is not None
    assert entry.record.seq == 5
    assert entry.last_heard == 0.0  # stale records are not heartbeats


def test_table_goodbye_removes_at_once(table: PeerTable) -> None:
    table.note_announcement(rec(seq=1), now=0.0)
    events = table.note_announcement(rec(seq=2, goodbye=True), now=0.5)
    assert [e.new for e in events] == [Health.LEFT]
    assert table.members() == []


def test_table_dead_peer_returns_only_after_hysteresis(table: PeerTable) -> None:
    table.note_announcement(rec(seq=1), now=0.0)
    table.tick(8.0)
    assert table.health_of("B") is Health.DEAD
    table.note_announcement(rec(seq=2), now=20.0)
    assert table.health_of("B") is Health.JOINING
    assert table.members() == []
    for i, t in enumerate((21.0, 22.0), start=3):
        table.note_announcement(rec(seq=i), now=t)
        assert table.health_of("B") is Health.JOINING
    table.note_announcement(rec(seq=5), now=23.0)
    assert table.health_of("B") is Health.ALIVE


def test_table_flapping_restarts_the_hysteresis_window(table: PeerTable) -> None:
    table.note_announcement(rec(seq=1), now=0.0)
    table.tick(8.0)
    table.note_announcement(rec(seq=2), now=10.0)
    table.note_announcement(rec(seq=3), now=11.0)
    table.note_announcement(rec(seq=4), now=15.0)  # a 4 s gap: the streak starts again
    assert table.health_of("B") is Health.JOINING
    table.note_announcement(rec(seq=5), now=16.0)
    table.note_announcement(rec(seq=6), now=17.0)
    assert table.health_of("B") is Health.JOINING
    table.note_announcement(rec(seq=7), now=18.0)
    assert table.health_of("B") is Health.ALIVE


def test_table_joining_peer_that_goes_silent_is_dead_again(table: PeerTable) -> None:
    table.note_announcement(rec(seq=1), now=0.0)
    table.tick(8.0)
    table.note_announcement(rec(seq=2), now=10.0)
    table.tick(13.5)
    assert table.health_of("B") is Health.DEAD


def test_table_restart_after_goodbye_is_admitted_at_once(table: PeerTable) -> None:
    table.note_announcement(rec(seq=7, boot=1), now=0.0)
    table.note_announcement(rec(seq=8, boot=1, goodbye=True), now=1.0)
    table.note_announcement(rec(seq=1, boot=2), now=5.0)  # new process, seq restarts
    assert table.health_of("B") is Health.ALIVE


def test_table_restart_after_a_crash_goes_through_hysteresis(table: PeerTable) -> None:
    table.note_announcement(rec(seq=7, boot=1), now=0.0)
    table.tick(8.0)
    table.note_announcement(rec(seq=1, boot=2), now=9.0)
    assert table.health_of("B") is Health.JOINING


def test_table_candidates_are_not_members_and_expire(table: PeerTable) -> None:
    assert table.note_candidate("C", ("/ip4/1.1.1.1/tcp/1/p2p/C",), now=0.0)
    assert not table.note_candidate("C", ("/ip4/1.1.1.1/tcp/1/p2p/C",), now=0.0)
    assert not table.note_candidate("A", ("x",), now=0.0)  # ourselves
    assert table.members() == []
    assert [e.peer_id for e in table.dial_targets()] == ["C"]
    table.tick(61.0)
    assert "C" not in table.entries


def test_table_tombstones_are_forgotten(table: PeerTable) -> None:
    table.note_announcement(rec(), now=0.0)
    table.tick(8.0)
    table.tick(8.0 + 61.0)
    assert "B" not in table.entries


def test_table_statistics_count_every_kind(table: PeerTable) -> None:
    table.note_announcement(rec("B"), now=0.0)
    table.note_announcement(rec("C"), now=0.0)
    table.note_announcement(rec("C"), now=0.1)
    table.note_rejected()
    table.tick(3.5)
    table.note_announcement(rec("C", seq=2), now=3.6)
    stats = table.statistics()
    assert (stats.accepted, stats.rejected, stats.stale) == (3, 1, 1)
    assert (stats.alive, stats.suspect, stats.dead_or_left) == (1, 1, 0)


def test_table_our_own_stall_is_not_blamed_on_the_peers(table: PeerTable) -> None:
    table.note_announcement(rec("B"), now=0.0)
    table.note_announcement(rec("C"), now=0.0)
    table.tick(1.0)
    table.excuse_gap(20.0)  # we were SIGSTOPped from t=1 to t=21
    table.tick(21.0)
    assert table.health_of("B") is Health.ALIVE
    table.tick(24.0)
    assert table.health_of("B") is Health.SUSPECT  # the window restarted, it did not vanish
