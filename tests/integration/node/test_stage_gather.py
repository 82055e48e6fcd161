"""A stage gathers a burst of frames into one round (the micro-batch stays whole).

The previous stage sends a round's outputs one right after another; a stage that
started on the first of them would split the micro-batch. A real stage server of
a seeded tiny Llama (``tiny_hops``) on trio's mock clock, whose time moves only
when the test moves it: the batching is decided by the gaps the test makes, not
by how busy the machine is.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from hetmesh.node.control import OpenSession
from hetmesh.node.kvcache import KVLimits
from hetmesh.node.stage_groups import GATHER_ENV
from hetmesh.node.stage_server import GATHER_S, StageServer
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import load_stage
from hetmesh.transport.frames import Activations
from tests.integration.node.tiny_hops import GATEWAY, save_tiny_model

SESSIONS = ["s0", "s1", "s2", "s3"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-gather"))


async def never_sends(peer: str, frame: object) -> None:
    raise AssertionError("the batching loop is not running: nothing is sent")


def first_stage(tiny_model, micro_batches: int | None, end: int = 2) -> StageServer:
    stage = load_stage(tiny_model, 0, end)
    server = StageServer(
        stage,
        limits=KVLimits(
            max_sessions=4,
            max_tokens_per_session=64,
            budget_bytes=4 * 64 * stage.kv_bytes_per_token(),
        ),
        send=never_sends,
        micro_batches=micro_batches,
    )
    for sid in SESSIONS:
        request = OpenSession(
            session_id=sid,
            start=0,
            end=end,
            next_peer="b" if end < 4 else GATEWAY,
            gateway=GATEWAY,
            max_tokens=32,
            sampling=SamplingParams(),
        )
        assert server.handle(request, GATEWAY).ok
    return server


def step(sid: str) -> Activations:
    ids = torch.tensor([3], dtype=torch.int64)
    return Activations(session_id=sid, step=0, positions=(0,), tensors=(ids,))


async def next_round(server: StageServer, rounds: list[list[str]]) -> None:
    batch = await server._next_batch()
    rounds.append([item.session_id for item in batch])


async def test_frames_that_follow_each_other_closely_share_one_round(
    tiny_model, mock_clock: trio.testing.MockClock
) -> None:
    server = first_stage(tiny_model, micro_batches=1)  # a round may take all four
    rounds: list[list[str]] = []
    server.submit(step("s0"), release=lambda: None, sender=GATEWAY)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        for sid in SESSIONS[1:]:
            await trio.testing.wait_all_tasks_blocked()
            assert rounds == []  # still gathering
            mock_clock.jump(GATHER_S * 0.9)  # the next frame comes within the gap
            server.submit(step(sid), release=lambda: None, sender=GATEWAY)
    # the fourth frame filled the round: it did not wait for the gap to pass
    assert rounds == [SESSIONS]


async def test_a_gap_longer_than_the_burst_starts_the_round(
    tiny_model, mock_clock: trio.testing.MockClock
) -> None:
    server = first_stage(tiny_model, micro_batches=1)
    rounds: list[list[str]] = []
    server.submit(step("s0"), release=lambda: None, sender=GATEWAY)
    server.submit(step("s1"), release=lambda: None, sender=GATEWAY)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []
        mock_clock.jump(GATHER_S * 1.1)  # nothing came within the gap
    assert rounds == [["s0", "s1"]]
    server.submit(step("s2"), release=lambda: None, sender=GATEWAY)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(GATHER_S * 1.1)
    assert rounds[1] == ["s2"]


async def test_the_environment_sets_the_gap(
    tiny_model, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HETMESH_STAGE_GATHER_MS=1: a frame 0.9 ms after the last joins the round, and 1.1 ms
    without one (far under the default's 5 ms) starts it."""
    monkeypatch.setenv(GATHER_ENV, "1")
    server = first_stage(tiny_model, micro_batches=1)
    rounds: list[list[str]] = []
    server.submit(step("s0"), release=lambda: None, sender=GATEWAY)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_round, server, rounds)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(0.0009)
        server.submit(step("s1"), release=lambda: None, sender=GATEWAY)
        await trio.testing.wait_all_tasks_blocked()
        assert rounds == []  # still gathering
        mock_clock.jump(0.0011)  # nothing came within the gap
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()  # (the default's gap would still be gathering)
    assert rounds == [["s0", "s1"]]
    assert GATHER_S > 0.0011


async def test_a_round_never_waits_once_it_holds_its_share(
    tiny_model, mock_clock: trio.testing.MockClock
) -> None:
    server = first_stage(tiny_model, micro_batches=2)  # four open: two a round
    rounds: list[list[str]] = []
    server.submit(step("s0"), release=lambda: None, sender=GATEWAY)
    server.submit(step("s1"), release=lambda: None, sender=GATEWAY)
    await next_round(server, rounds)  # no clock jump: it returned without waiting
    assert rounds == [["s0", "s1"]]


async def test_a_stage_holding_the_whole_model_takes_every_waiting_session(tiny_model) -> None:
    # with no next stage to overlap with, halves would only leave the device idle
    rounds: list[list[str]] = []
    whole = first_stage(tiny_model, micro_batches=None, end=4)  # embed, 2 blocks, head
    part = first_stage(tiny_model, micro_batches=None)  # [0, 2): a next stage follows
    for server in (whole, part):
        for sid in SESSIONS:
            server.submit(step(sid), release=lambda: None, sender=GATEWAY)
        await next_round(server, rounds)  # each holds its share at once: no waiting
    assert rounds == [SESSIONS, SESSIONS[:2]]
