"""The stage lane's hand-off (hetmesh.node.stage_lane), with real threads."""

from __future__ import annotations

import threading
import time

from hetmesh.node.stage_lane import Lane


def _park_in_thread(lane: Lane[int], timeout_s: float, stay=lambda: True):  # type: ignore[no-untyped-def]
    result: dict[str, object] = {}

    def run() -> None:
        result["item"], result["waited"] = lane.park(timeout_s, stay)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_parked(lane: Lane[int]) -> None:
    """Until the thread waits in the lane (a condition another thread sets)."""
    while not lane.parked:
        time.sleep(0.001)


def test_an_offer_is_refused_unless_a_thread_is_parked() -> None:
    lane: Lane[int] = Lane()
    asked: list[int] = []
    assert not lane.offer(lambda: asked.append(1) or 7)  # type: ignore[func-returns-value]
    assert asked == []
    assert lane.taken == 0


def test_a_parked_thread_gets_the_offered_item() -> None:
    lane: Lane[int] = Lane()
    thread, result = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    assert not lane.offer(lambda: None)  # the stage refuses it: it goes through trio
    assert lane.offer(lambda: 42)
    thread.join(30)
    assert result["item"] == 42
    assert lane.taken == 1
    assert not lane.parked


def test_a_wake_sends_the_parked_thread_back_and_refuses_offers_until_it_parks_again() -> None:
    lane: Lane[int] = Lane()
    thread, result = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    lane.wake()
    thread.join(30)
    assert result["item"] is None
    assert not lane.offer(lambda: 1)
    thread, result = _park_in_thread(lane, 30.0)  # a new park forgets the old wake
    _wait_parked(lane)
    assert lane.offer(lambda: 2)
    thread.join(30)
    assert result["item"] == 2


def test_a_parked_thread_leaves_when_it_should_not_stay_or_its_time_is_up() -> None:
    lane: Lane[int] = Lane()
    leave = threading.Event()
    thread, result = _park_in_thread(lane, 30.0, stay=lambda: not leave.is_set())
    _wait_parked(lane)
    leave.set()  # asked every PARK_SLICE_S
    thread.join(30)
    assert result["item"] is None
    assert lane.park(0.0, lambda: True)[0] is None


def test_calling_off_a_parked_thread_says_its_batch_is_idle_but_not_while_it_computes() -> None:
    lane: Lane[int] = Lane()
    assert not lane.call_off()  # nobody parked: the batch may be computing
    thread, result = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    assert lane.call_off()  # it computes nothing more
    assert not lane.offer(lambda: 3)
    thread.join(30)
    assert result["item"] is None
