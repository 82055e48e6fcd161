"""The gateway lane's hand-off (hetmesh.node.gateway_lane): the awaited token of an
armed session sends its next step once, from the calling thread; anything else sends
nothing and leaves the step to the gateway's trio loop."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hetmesh.errors import StreamReset
from hetmesh.node.gateway_lane import Armed, GatewayLane
from hetmesh.transport.frames import Activations, Error, Frame, Tokens

EOS = frozenset({2})


class Sent:
    """A ``send_now`` that records what it was given (and answers ``answer``)."""

    def __init__(self, answer: bool | Exception = True) -> None:
        self.frames: list[tuple[str, Frame, str]] = []
        self.answer = answer

    def __call__(self, peer: str, frame: Frame) -> bool:
        self.frames.append((peer, frame, threading.current_thread().name))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def token(step: int = 5, position: int = 9, token_id: int = 77, sid: str = "s") -> Tokens:
    return Tokens(session_id=sid, step=step, token_ids=(token_id,), position=position)


def armed() -> Armed:
    return Armed(step=5, position=9, last="last", first="first", eos=EOS)


def test_the_awaited_token_sends_the_next_step_once_from_the_reader_thread() -> None:
    sent = Sent()
    lane = GatewayLane(sent)
    lane.arm("s", armed())
    reader = threading.Thread(target=lane.offer, args=("last", token()), name="reader")
    reader.start()
    reader.join()
    ((peer, frame, thread),) = sent.frames
    assert (peer, thread) == ("first", "reader")
    assert isinstance(frame, Activations)
    assert (frame.session_id, frame.step, frame.positions) == ("s", 6, (9,))
    assert torch.equal(frame.tensors[0], torch.tensor([77], dtype=torch.int64))
    lane.offer("last", token())  # the same token again (a stale copy): nothing more
    assert len(sent.frames) == 1
    claimed = lane.claim("s")
    assert claimed is not None
    assert claimed.step == 5
    assert claimed.sent_at > 0
    assert lane.sent == 1
    assert lane.claim("s") is None  # disarmed
    lane.offer("last", token())
    assert len(sent.frames) == 1


@pytest.mark.parametrize(
    ("sender", "frame"),
    [
        ("other", token()),  # not the route's last stage
        ("last", token(step=4)),  # another step's token
        ("last", token(position=8)),  # another position (a stale frame)
        ("last", token(token_id=2)),  # end of sequence: no next step
        ("last", token(sid="t")),  # a session not armed
        ("last", Tokens(session_id="s", step=5, token_ids=(), position=9)),
        ("last", Error(code=1, message="boom", session_id="s")),
    ],
)
def test_anything_but_the_awaited_token_sends_nothing(sender: str, frame: Frame) -> None:
    sent = Sent()
    lane = GatewayLane(sent)
    lane.arm("s", armed())
    lane.offer(sender, frame)
    assert sent.frames == []
    assert lane.claim("s") is None  # the gateway sends the step itself


@pytest.mark.parametrize("answer", [False, StreamReset("link closed")])
def test_a_link_that_would_wait_or_fails_leaves_the_step_to_the_gateway(
    answer: bool | Exception,
) -> None:
    sent = Sent(answer)
    lane = GatewayLane(sent)
    lane.arm("s", armed())
    lane.offer("last", token())  # never raises
    assert len(sent.frames) == 1
    assert lane.claim("s") is None
    assert lane.sent == 0


def test_a_lane_without_send_now_is_off() -> None:
    lane = GatewayLane(None)
    assert not lane.enabled
    lane.arm("s", armed())
    lane.offer("last", token())
    assert lane.claim("s") is None


def test_a_turn_is_timed_from_the_token_in_once_by_whoever_sent_the_next_step() -> None:
    """The lane counts its turns (token in to next step written); a token it did not
    turn leaves its arrival for trio's send (``arrival``), read once; a claimed step's
    arrival is gone (not counted twice)."""
    slow = Sent()

    def send_now(peer: str, frame: Frame) -> bool:
        # the write takes a measurable while: the turn covers it
        began = time.perf_counter()
        while time.perf_counter() - began < 0.002:
            pass
        return slow(peer, frame)

    lane = GatewayLane(send_now)
    lane.arm("s", armed())
    before = time.perf_counter()
    lane.offer("last", token())
    assert lane.sent == 1
    assert 0.002 <= lane.turn_s <= time.perf_counter() - before
    assert lane.claim("s") is not None
    assert lane.arrival("s") is None  # the lane's turn: trio counts nothing
    # not armed: nothing sent, the arrival waits for trio
    lane.offer("last", token(step=6, position=10, sid="t"))
    arrived = lane.arrival("t")
    assert arrived is not None
    assert before <= arrived <= time.perf_counter()
    assert lane.arrival("t") is None  # read once
    assert lane.sent == 1
    # a next step for this node's own first stage is that stage's forward: sent, no turn
    own = GatewayLane(send_now, "first")
    own.arm("s", armed())
    own.offer("last", token())
    assert own.sent == 1
    assert own.turns == 0
    assert own.turn_s == 0.0
    assert lane.turns == 1
    # an error frame is no token: no arrival
    lane.offer("last", Error(code=1, message="boom", session_id="u"))
    assert lane.arrival("u") is None
