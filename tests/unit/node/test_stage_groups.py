"""A stage's micro-batch groups (hetmesh.node.stage_groups): a burst is complete once
every open session of the waiting sessions' last rounds is in."""

from __future__ import annotations

import pytest

from hetmesh.node.stage_groups import (
    GATHER_ENV,
    GATHER_S,
    Groups,
    gather_seconds,
    groups_enabled,
)


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
