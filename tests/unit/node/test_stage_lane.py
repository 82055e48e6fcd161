"""The stage lane's hand-off (hetmesh.node.stage_lane), with real threads."""

from __future__ import annotations

import threading
import time

from hetmesh.node.stage_lane import Lane, lane_enabled


def _park_in_thread(lane: Lane[int], timeout_s: float, stay=lambda: True):  # type: ignore[no-untyped-def]
    result: dict[str, object] = {}

    def run() -> None:
        result["waited"] = lane.park(timeout_s, stay)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_parked(lane: Lane[int]) -> None:
    """Until the thread waits in the lane (a condition another thread sets)."""
    while not lane.parked:
        time.sleep(0.001)


def _recorder(ran: list[tuple[int, int]], stay: bool = True):  # type: ignore[no-untyped-def]
    def run(item: int) -> bool:
        ran.append((item, threading.get_ident()))
        return stay

    return run


def test_the_lane_is_on_unless_switched_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("HETMESH_STAGE_LANE", raising=False)
    assert lane_enabled()
    monkeypatch.setenv("HETMESH_STAGE_LANE", "0")
    assert not lane_enabled()


def test_an_offer_is_refused_unless_a_thread_is_parked() -> None:
    lane: Lane[int] = Lane()
    asked: list[int] = []
    ran: list[tuple[int, int]] = []
    assert not lane.offer(lambda: asked.append(1) or 7, _recorder(ran))  # type: ignore[func-returns-value]
    assert asked == []
    assert ran == []
    assert lane.taken == 0


def test_an_offered_step_runs_on_the_offering_thread_while_the_device_thread_stays_parked() -> None:
    lane: Lane[int] = Lane()
    thread, result = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    ran: list[tuple[int, int]] = []
    assert not lane.offer(lambda: None, _recorder(ran))  # refused: it goes through trio
    assert lane.offer(lambda: 42, _recorder(ran))
    assert lane.offer(lambda: 43, _recorder(ran))
    assert ran == [(42, threading.get_ident()), (43, threading.get_ident())]
    assert lane.parked
    assert thread.is_alive()
    assert lane.taken == 2
    assert lane.parks == 1
    lane.wake()
    thread.join(30)
    assert not thread.is_alive()
    assert not lane.parked
    assert "waited" in result


def test_a_step_that_says_leave_sends_the_parked_thread_back() -> None:
    lane: Lane[int] = Lane()
    thread, _ = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    ran: list[tuple[int, int]] = []
    assert lane.offer(lambda: 1, _recorder(ran, stay=False))
    thread.join(30)
    assert not thread.is_alive()
    assert not lane.offer(lambda: 2, _recorder(ran))  # nobody parked any more
    assert [item for item, _ in ran] == [1]


def test_a_wake_during_a_step_returns_the_parked_thread_only_after_it() -> None:
    lane: Lane[int] = Lane()
    thread, _ = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    running, finish = threading.Event(), threading.Event()
    left_during_step: list[bool] = []

    def slow(item: int) -> bool:
        running.set()
        finish.wait(30)
        left_during_step.append(not thread.is_alive())
        return True

    offering = threading.Thread(target=lane.offer, args=(lambda: 5, slow))
    offering.start()
    assert running.wait(30)
    lane.wake()
    assert not lane.call_off()  # a step runs: the batch is not idle
    refused: list[tuple[int, int]] = []
    assert not lane.offer(lambda: 6, _recorder(refused))  # one step at a time
    finish.set()
    offering.join(30)
    thread.join(30)
    assert left_during_step == [False]
    assert not thread.is_alive()
    assert refused == []


def test_a_new_park_forgets_the_old_wake() -> None:
    lane: Lane[int] = Lane()
    thread, _ = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    lane.wake()
    thread.join(30)
    ran: list[tuple[int, int]] = []
    assert not lane.offer(lambda: 1, _recorder(ran))
    thread, _ = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    assert lane.offer(lambda: 2, _recorder(ran, stay=False))
    thread.join(30)
    assert [item for item, _ in ran] == [2]


def test_a_parked_thread_leaves_when_it_should_not_stay_or_its_time_is_up() -> None:
    lane: Lane[int] = Lane()
    leave = threading.Event()
    thread, _ = _park_in_thread(lane, 30.0, stay=lambda: not leave.is_set())
    _wait_parked(lane)
    leave.set()  # asked every PARK_SLICE_S
    thread.join(30)
    assert not thread.is_alive()
    assert lane.park(0.0, lambda: True) >= 0.0  # no time to wait: back at once


def test_calling_off_a_parked_thread_says_its_batch_is_idle() -> None:
    lane: Lane[int] = Lane()
    assert not lane.call_off()  # nobody parked: the batch may be computing
    thread, _ = _park_in_thread(lane, 30.0)
    _wait_parked(lane)
    assert lane.call_off()  # it computes nothing more
    ran: list[tuple[int, int]] = []
    assert not lane.offer(lambda: 3, _recorder(ran))
    thread.join(30)
    assert not thread.is_alive()
    assert ran == []
