"""The fast lane of a stage of a cut: decode steps handed from a link's reader thread
straight to the stage's device thread, with no hop through trio.

A stage of a cut serving one stream sees the same session's next step arrive
once per token. Through trio that costs, per stage and token, a wake of the
trio thread (the link's reader hands it the frame), the inbox and batching
loop, a hand-off to the device thread (``trio.to_thread``) and a wake of trio
again when the forward ends: on a loaded 2-core box each of these cross-thread
wake-ups waits for a time slice (docs/journal/2026-12-05-fast-cut.md).

Here the device thread, after a batch of one session's step whose output left at
once, does not return to trio: it *parks* (:meth:`Lane.park`), holding the
device, for up to :data:`PARK_S`. The link's reader thread that reads the
session's next step offers it (:meth:`Lane.offer`); the stage accepts it only if
the device thread could compute it with no help from trio (see
``StageServer.offer``), and the parked thread computes it, sends its output on
from the device thread and parks again. Anything else — a frame the stage does
not accept, a control request, another session, a stage load waiting for the
device — wakes the parked thread (:meth:`Lane.wake`), which returns to trio,
where the batching loop takes over as before.

Pure threading: no trio, no torch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

PARK_S = 2.0  # the longest a device thread waits for its session's next step
PARK_SLICE_S = 0.05  # how often a parked thread looks whether it should leave

_T = TypeVar("_T")


def lane_enabled() -> bool:
    """Off unless ``HETMESH_STAGE_LANE=1``: opt-in until a quiet A/B shows it pays (+3-8 %
    decode in two quiet pairs on a 3-stage cut, TTFT and 8 streams within noise; the
    frame "lost" on a refused hand-over was the sink test's own race, now fixed). Off:
    every step goes through trio."""
    return os.environ.get("HETMESH_STAGE_LANE", "0") == "1"


class Lane(Generic[_T]):
    """One stage's hand-off point between reader threads and its parked device thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._parked = False
        self._woken = False
        self._item: _T | None = None
        self.taken = 0  # items handed over (for the stage's counters and tests)

    @property
    def parked(self) -> bool:
        return self._parked

    def wake(self) -> None:
        """Something waits for the batching loop: the parked thread returns (any thread)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def call_off(self) -> bool:
        """From trio: if the device thread is parked with nothing to compute, send it
        back (it computes nothing more in its batch) and say True: the sessions of
        its batch are then idle, not mid-step. False while it computes."""
        with self._cond:
            if not self._parked or self._item is not None:
                return False
            self._woken = True
            self._cond.notify_all()
            return True

    def offer(self, accept: Callable[[], _T | None]) -> bool:
        """From a reader thread: if the device thread is parked with nothing to do, run
        ``accept`` (under the lane's lock; None refuses) and hand its item over."""
        with self._cond:
            if not self._parked or self._woken or self._item is not None:
                return False
            item = accept()
            if item is None:
                return False
            self._item = item
            self.taken += 1
            self._cond.notify_all()
            return True

    def park(self, timeout_s: float, stay: Callable[[], bool]) -> tuple[_T | None, float]:
        """On the device thread: wait for an offered item, at most ``timeout_s``, while
        nobody wakes the lane and ``stay()`` holds (asked every :data:`PARK_SLICE_S`).
        Returns the item (None: leave for trio) and the seconds spent waiting."""
        began = time.perf_counter()
        deadline = began + timeout_s
        with self._cond:
            self._woken = False
            self._parked = True
            try:
                while self._item is None and not self._woken:
                    left = deadline - time.perf_counter()
                    if left <= 0 or not stay():
                        break
                    self._cond.wait(min(left, PARK_SLICE_S))
                item, self._item = self._item, None
            finally:
                self._parked = False
        return item, time.perf_counter() - began


__all__ = ["PARK_S", "PARK_SLICE_S", "Lane", "lane_enabled"]
