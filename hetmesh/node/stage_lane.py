"""The fast lane of a stage of a cut: decode steps computed on the link's reader thread
that reads them, with no hop through trio and no hand-off to another thread.

A stage of a cut serving one stream sees the same session's next step arrive
once per token. Through trio that costs, per stage and token, a wake of the
trio thread (the link's reader hands it the frame), the inbox and batching
loop, a hand-off to the device thread (``trio.to_thread``) and a wake of trio
again when the forward ends: on a loaded 2-core box each of these cross-thread
wake-ups waits for a time slice (docs/journal/2026-12-05-fast-cut.md).

Here the device thread, after a batch of one session's step whose output left at
once, does not return to trio: it *parks* (:meth:`Lane.park`), holding the
device, for up to :data:`PARK_S` after the last step. The link's reader thread that
reads the session's next step offers it (:meth:`Lane.offer`); the stage accepts it
only if it can be computed with no help from trio (see ``StageServer.offer``), and
the reader thread computes it itself, sends its output on and goes back to reading,
while the device thread stays parked: one thread wakes per stage and token (the
reader, on the frame's arrival), none hands anything to another. The reader may
run the step only while the device thread is parked (it holds the device for it,
and computes nothing meanwhile). Anything else — a frame the stage does not
accept, a control request, another session, a stage load waiting for the device,
a step after which the stage should not park — wakes the parked thread
(:meth:`Lane.wake`, or the step's own verdict), which returns to trio once no
step runs, where the batching loop takes over as before. (2026-12-05 the parked
thread computed the step itself: one more wake per stage and token,
docs/journal/2026-12-06-fast-cut.md.)

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
    """On unless ``HETMESH_STAGE_LANE=0`` (every step through trio, for comparisons)."""
    return os.environ.get("HETMESH_STAGE_LANE", "1") != "0"


class Lane(Generic[_T]):
    """One stage's hand-off point between reader threads and its parked device thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._parked = False
        self._woken = False
        self._busy = False  # an offered step runs on its reader thread
        self._last = 0.0  # when the last offered step ended (perf_counter)
        self.taken = 0  # items run here (for the stage's counters and tests)
        self.parks = 0  # times a device thread parked
        self.busy_s = 0.0  # seconds offered steps ran

    @property
    def parked(self) -> bool:
        return self._parked

    def wake(self) -> None:
        """Something waits for the batching loop: the parked thread returns (any thread)
        once no offered step runs."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def call_off(self) -> bool:
        """From trio: if the device thread is parked with nothing running, send it back
        (it computes nothing more in its batch) and say True: the sessions of its batch
        are then idle, not mid-step. False while it or an offered step computes."""
        with self._cond:
            if not self._parked or self._busy:
                return False
            self._woken = True
            self._cond.notify_all()
            return True

    def offer(self, accept: Callable[[], _T | None], run: Callable[[_T], bool]) -> bool:
        """From a reader thread: if the device thread is parked with nothing running, run
        ``accept`` (under the lane's lock; None refuses) and then ``run`` its item on
        this thread, the device thread still parked; ``run`` says whether it stays
        parked (False sends it back to trio). True once taken, whatever ``run`` does
        (it must not raise)."""
        with self._cond:
            if not self._parked or self._woken or self._busy:
                return False
            item = accept()
            if item is None:
                return False
            self._busy = True
            self.taken += 1
        began = time.perf_counter()
        stay = False
        try:
            stay = run(item)
        finally:
            with self._cond:
                self._busy = False
                self._last = time.perf_counter()
                self.busy_s += self._last - began
                if not stay:
                    self._woken = True
                if self._woken:  # the parked thread waits for the step's end to leave
                    self._cond.notify_all()
        return True

    def park(self, timeout_s: float, stay: Callable[[], bool]) -> float:
        """On the device thread: stay parked while offered steps run, until nobody has
        offered one for ``timeout_s``, somebody wakes the lane or ``stay()`` (asked every
        :data:`PARK_SLICE_S`) fails. Returns the seconds parked, less those steps'."""
        began = time.perf_counter()
        with self._cond:
            busy_before = self.busy_s
            self._woken = False
            self._parked = True
            self._last = began
            self.parks += 1
            try:
                while True:
                    if not self._busy:
                        left = self._last + timeout_s - time.perf_counter()
                        if self._woken or left <= 0 or not stay():
                            break
                        self._cond.wait(min(left, PARK_SLICE_S))
                    else:
                        self._cond.wait(PARK_SLICE_S)
            finally:
                self._parked = False
            ran = self.busy_s - busy_before
        return max(0.0, time.perf_counter() - began - ran)


__all__ = ["PARK_S", "PARK_SLICE_S", "Lane", "lane_enabled"]
