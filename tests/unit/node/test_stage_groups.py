"""A stage's micro-batch groups (hetmesh.node.stage_groups): a burst is complete once
every open session of the waiting sessions' last rounds is in."""

from __future__ import annotations

import pytest

from hetmesh.node.stage_groups import (
    ACTIVE_S,
    GATHER_ENV,
    GATHER_S,
    MERGE_ENV,
    MERGE_S,
    MICRO_BATCHES_ENV,
    Groups,
    gather_seconds,
    groups_enabled,
    merge_seconds,
    micro_batches_env,
)

EIGHT = {f"s{i}" for i in range(8)}


def test_a_burst_is_complete_once_every_session_of_its_round_waits() -> None:
    groups = Groups()
    groups.ran(["a", "b", "c"], {"a", "b", "c", "d"})
    groups.ran(["d"], {"a", "b", "c", "d"})
    open_ = {"a", "b", "c", "d"}
    assert not groups.complete({"a"}, open_)
    assert not groups.complete({"a", "b"}, open_)
    assert groups.complete({"a", "b", "c"}, open_)
    assert groups.complete({"d"}, open_)
    assert groups.complete({"a", "b", "c", "d"}, open_)  # two whole groups
    assert not groups.complete({"c", "d"}, open_)  # d's round is in, c's is not
    assert not groups.complete(set(), open_)


def test_a_session_that_never_ran_here_leaves_the_burst_open() -> None:
    groups = Groups()
    groups.ran(["a"], {"a", "new"})
    assert not groups.complete({"new"}, {"a", "new"})
    assert not groups.complete({"a", "new"}, {"a", "new"})


def test_closed_sessions_are_not_waited_for_and_are_forgotten() -> None:
    groups = Groups()
    groups.ran(["a", "b"], {"a", "b"})
    assert groups.complete({"a"}, {"a"})  # b closed meanwhile
    groups.forget("a")
    assert groups.of("a") is None
    for i in range(40):  # many short sessions come and go: their groups do not pile up
        groups.ran([f"s{i}"], {f"s{i}"})
    assert groups.of("s0") is None
    assert groups.of("s39") == frozenset({"s39"})


def test_a_later_round_replaces_a_sessions_group() -> None:
    groups = Groups()
    open_ = {"a", "b", "c"}
    groups.ran(["a", "b"], open_)
    groups.ran(["b", "c"], open_)
    assert groups.of("b") == frozenset({"b", "c"})
    assert groups.complete({"b", "c"}, open_)


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False)])
def test_the_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    else:
        monkeypatch.setenv("HETMESH_STAGE_GROUPS", value)
    assert groups_enabled() is on


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, GATHER_S), ("", GATHER_S), ("2", 0.002), (" 0.5 ", 0.0005), ("0", 0.0)],
)
def test_the_gap_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, seconds: float
) -> None:
    if value is None:
        monkeypatch.delenv(GATHER_ENV, raising=False)
    else:
        monkeypatch.setenv(GATHER_ENV, value)
    assert gather_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["fast", "-1", "nan", "1e9", "inf"])
def test_a_bad_gap_keeps_the_default_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(GATHER_ENV, value)
    with caplog.at_level("WARNING", logger="hetmesh.node.stage_groups"):
        assert gather_seconds() == GATHER_S
    assert GATHER_ENV in caplog.text


def test_a_group_too_small_for_two_micro_batches_waits_to_merge() -> None:
    """8 sessions as groups of 4, 3 and 1: the 3 and the 1 are each too small (with them
    apart the 8 need three rounds of 4); two groups of 4 are not."""
    groups = Groups()
    groups.ran(["s0", "s1", "s2", "s3"], EIGHT, now=10.0)
    groups.ran(["s4", "s5", "s6"], EIGHT, now=10.01)
    groups.ran(["s7"], EIGHT, now=10.02)
    assert groups.too_small({"s7"}, EIGHT, 4, 2, now=10.03)
    assert groups.too_small({"s4", "s5", "s6"}, EIGHT, 4, 2, now=10.03)
    assert not groups.too_small({"s4", "s5", "s6", "s7"}, EIGHT, 4, 2, now=10.03)
    assert not groups.too_small({"s0", "s1", "s2", "s3"}, EIGHT, 4, 2, now=10.03)
    # one micro-batch: every burst runs as it is
    assert not groups.too_small({"s7"}, EIGHT, 8, 1, now=10.03)
    # seven sessions as 4 and 3 fit in two rounds of 4: the 3 runs
    seven = EIGHT - {"s7"}
    assert not groups.too_small({"s4", "s5", "s6"}, seven, 4, 2, now=10.03)
    assert groups.too_small({"s4", "s5"}, seven, 4, 2, now=10.03)


def test_idle_sessions_do_not_hold_a_burst_back() -> None:
    groups = Groups()
    groups.ran(["s0", "s1", "s2", "s3"], EIGHT, now=0.0)
    groups.ran(["s4", "s5", "s6", "s7"], EIGHT, now=ACTIVE_S * 5)
    later = ACTIVE_S * 5 + 0.01
    assert groups.active(EIGHT, later) == {"s4", "s5", "s6", "s7"}
    # s0..s3 stopped stepping: s4, s5 alone are no longer short of a second round
    assert not groups.too_small({"s4", "s5"}, EIGHT, 4, 2, now=later)
    groups.ran(["s0", "s1", "s2"], EIGHT, now=later)
    assert groups.too_small({"s4", "s5"}, EIGHT, 4, 2, now=later)  # 7 active: 2 < 7 - 4
    # closed sessions do not count, whatever they did
    assert not groups.too_small({"s4", "s5"}, EIGHT - {"s1", "s2"}, 4, 2, now=later)
    groups.forget("s0")
    assert "s0" not in groups.active(EIGHT, later)


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, MERGE_S), ("", MERGE_S), ("20", 0.02), ("0", 0.0)]
)
def test_the_merge_wait_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, seconds: float
) -> None:
    if value is None:
        monkeypatch.delenv(MERGE_ENV, raising=False)
    else:
        monkeypatch.setenv(MERGE_ENV, value)
    assert merge_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "2000"])
def test_a_bad_merge_wait_keeps_the_default_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(MERGE_ENV, value)
    with caplog.at_level("WARNING", logger="hetmesh.node.stage_groups"):
        assert merge_seconds() == MERGE_S
    assert MERGE_ENV in caplog.text


@pytest.mark.parametrize(("value", "count"), [(None, None), ("", None), ("3", 3), (" 1 ", 1)])
def test_the_micro_batches_follow_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, count: int | None
) -> None:
    if value is None:
        monkeypatch.delenv(MICRO_BATCHES_ENV, raising=False)
    else:
        monkeypatch.setenv(MICRO_BATCHES_ENV, value)
    assert micro_batches_env() == count


@pytest.mark.parametrize("value", ["two", "0", "-2", "9", "2.5"])
def test_bad_micro_batches_keep_the_default_and_say_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(MICRO_BATCHES_ENV, value)
    with caplog.at_level("WARNING", logger="hetmesh.node.stage_groups"):
        assert micro_batches_env() is None
    assert MICRO_BATCHES_ENV in caplog.text
