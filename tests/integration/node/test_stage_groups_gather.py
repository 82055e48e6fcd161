"""A stage starts a round as soon as every session of the waiting sessions' last
rounds here is in (hetmesh.node.stage_groups), instead of waiting out the gap.

A real stage server of a seeded tiny Llama (``tiny_hops``) on trio's mock clock,
whose time moves only when the test moves it (as tests/integration/node/
test_stage_gather.py): a round ends on the test's gaps, not on the machine's load.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from hetmesh.node.stage_groups import MERGE_ENV, MERGE_S
from hetmesh.node.stage_server import GATHER_S, MERGE_ROUNDS_SEEN, StageServer
from tests.integration.node.test_stage_gather import first_stage, next_round, step, tiny_model
from tests.integration.node.tiny_hops import GATEWAY

__all__ = ["tiny_model"]  # the module's fixture, shared with test_stage_gather

GROUP = ["s0", "s1", "s2"]  # three of four open sessions: short of a round's share (4)


def submit(server: StageServer, sids: list[str]) -> None:
    for sid in sids:
        server.submit(step(sid), release=lambda: None, sender=GATEWAY)


async def first_round(server: StageServer, mock_clock: trio.testing.MockClock) -> list[str]:
    """The group's first round: nothing ran here before, so it ends on the gap."""
    rounds: list[list[str]] = []
    submit(server, GROUP)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []  # three of a share of four: it waits for more
        mock_clock.jump(GATHER_S * 1.1)
    return rounds[0]


async def test_a_round_whose_sessions_ran_together_starts_once_they_are_in(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)  # on by default
    server = first_stage(tiny_model, micro_batches=1)  # a round may take all four
    assert await first_round(server, mock_clock) == GROUP
    rounds: list[list[str]] = []
    submit(server, GROUP[:2])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []  # s2 ran with them: the burst is not in yet
        mock_clock.jump(GATHER_S * 0.9)
        submit(server, GROUP[2:])
    # the group is in: no gap waited after its last frame (the clock did not move)
    assert rounds == [GROUP]
    # a session of the group closed meanwhile is not waited for
    server.close("s2")
    submit(server, GROUP[:2])
    await next_round(server, rounds)
    assert rounds[1] == GROUP[:2]


async def test_groups_merge_when_their_bursts_meet(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    server = first_stage(tiny_model, micro_batches=1)
    assert await first_round(server, mock_clock) == GROUP
    rounds: list[list[str]] = []
    submit(server, ["s3"])  # s3 never ran here: it has no group
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(GATHER_S * 1.1)
    assert rounds == [["s3"]]
    submit(server, ["s3", "s0"])  # s3's round is in, s0's is not: it waits for s1, s2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        assert len(rounds) == 1
        submit(server, ["s1", "s2"])
    assert sorted(rounds[1]) == ["s0", "s1", "s2", "s3"]  # one round of both groups


async def test_a_lone_straggler_waits_for_the_gap_to_rejoin_a_round(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    server = first_stage(tiny_model, micro_batches=1)  # a share of four
    assert await first_round(server, mock_clock) == GROUP
    rounds: list[list[str]] = []
    for i in range(2):  # s3 alone: first without a group, then its group is itself
        submit(server, ["s3"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(next_round, server, rounds)
            await trio.testing.wait_all_tasks_blocked()
            assert len(rounds) == i  # one of a share of four: it waits
            mock_clock.jump(GATHER_S * 1.1)
        assert rounds == [["s3"]] * (i + 1)


async def test_off_every_short_burst_waits_for_the_gap(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HETMESH_STAGE_GROUPS", "0")
    server = first_stage(tiny_model, micro_batches=1)
    assert await first_round(server, mock_clock) == GROUP
    rounds: list[list[str]] = []
    submit(server, GROUP)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []  # the same group, all in: it still waits for the gap
        mock_clock.jump(GATHER_S * 1.1)
    assert rounds == [GROUP]


async def run_round(
    server: StageServer, mock_clock: trio.testing.MockClock, sids: list[str], wait_s: float
) -> list[str]:
    """``sids`` come in together; the round they start after ``wait_s`` of the clock."""
    rounds: list[list[str]] = []
    submit(server, sids)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(wait_s)
    return rounds[0]


async def test_a_group_too_small_for_the_micro_batches_waits_to_merge_with_the_next(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four sessions in two micro-batches (a share of two) running as three groups (s0+s1,
    s2, s3): s2 alone waits past the gap for s3, and the two run as one round."""
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    monkeypatch.delenv(MERGE_ENV, raising=False)
    server = first_stage(tiny_model, micro_batches=2)
    assert await run_round(server, mock_clock, ["s0", "s1"], 0.0) == ["s0", "s1"]
    for sid in ("s2", "s3"):  # no group yet: each runs alone (s3 after the merge's wait)
        assert await run_round(server, mock_clock, [sid], MERGE_S * 1.1) == [sid]
    rounds: list[list[str]] = []
    submit(server, ["s2"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(GATHER_S * 4)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []  # four gaps on: s2 still waits for the next group
        submit(server, ["s3"])
    assert rounds == [["s2", "s3"]]
    # merged, they are one group of the share: it runs as soon as it is in
    assert await run_round(server, mock_clock, ["s2", "s3"], 0.0) == ["s2", "s3"]


async def test_a_group_waits_to_merge_no_longer_than_the_merge_wait(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    monkeypatch.delenv(MERGE_ENV, raising=False)
    server = first_stage(tiny_model, micro_batches=2)
    assert await run_round(server, mock_clock, ["s0", "s1"], 0.0) == ["s0", "s1"]
    for sid in ("s2", "s3"):
        assert await run_round(server, mock_clock, [sid], MERGE_S * 1.1) == [sid]
    rounds: list[list[str]] = []
    submit(server, ["s2"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(MERGE_S * 0.9)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []
        mock_clock.jump(MERGE_S * 0.2)  # s3 never comes: s2 runs alone
    assert rounds == [["s2"]]


async def test_with_the_merge_off_a_small_group_runs_after_the_gap(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    monkeypatch.setenv(MERGE_ENV, "0")
    server = first_stage(tiny_model, micro_batches=2)
    assert await run_round(server, mock_clock, ["s0", "s1"], 0.0) == ["s0", "s1"]
    for sid in ("s2", "s3"):
        assert await run_round(server, mock_clock, [sid], GATHER_S * 1.1) == [sid]
    assert await run_round(server, mock_clock, ["s2"], GATHER_S * 1.1) == ["s2"]


async def test_the_merge_waits_no_longer_than_two_recent_rounds(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage whose rounds take 10 ms: a small group waits 20 ms for the next, not 50."""
    monkeypatch.delenv("HETMESH_STAGE_GROUPS", raising=False)
    monkeypatch.delenv(MERGE_ENV, raising=False)
    server = first_stage(tiny_model, micro_batches=2)
    assert await run_round(server, mock_clock, ["s0", "s1"], 0.0) == ["s0", "s1"]
    for sid in ("s2", "s3"):
        assert await run_round(server, mock_clock, [sid], MERGE_S * 1.1) == [sid]
    for _ in range(MERGE_ROUNDS_SEEN):
        server._counters.note_round(2, 2, 0.010)
    assert MERGE_S > 0.025
    rounds: list[list[str]] = []
    submit(server, ["s2"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(0.019)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []
        mock_clock.jump(0.002)
    assert rounds == [["s2"]]
