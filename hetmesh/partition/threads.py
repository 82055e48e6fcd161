"""A decode forward's thread count, chosen by measuring it (issue 47, threads).

A node gives its compute thread T torch threads. On a quiet machine the
int4 kernels gain ~1.5x from a second thread; on a machine whose cores are
taken by other work a second thread has no core to run on, and each of the
~250 OpenMP regions of a decode step waits at its barrier for a descheduled
worker: the project's shared 2-core box decoded 10-25x *slower* at 2 threads
than at 1 (docs/journal/2026-12-05-kernels.md, section 2). Which of the two
holds changes with the other work on the machine, so it is measured while
serving, not once at start.

:class:`ThreadChooser` runs decode forwards (one token per row) at the
caller's count or at 1 thread, whichever measured faster per row in its last
probe. A probe runs a few forwards at each count, alternated (one each where
one count is :data:`CLEAR` times slower than the other); the next probe
comes after a period that doubles while the choice stands (up to
``max_period`` forwards) and starts short again when it changes, and never
before the forwards in between have cost 1 / :data:`BUDGET` times the losing
count's forward (a 1.5 s two-thread step against 30 ms at one thread: 1,000
forwards; at most :data:`MAX_WAIT`). Prefill
chunks run at the caller's count, unmeasured.

Changing the thread count must not change a result: the stage uses it only
for the compact formats (int8, int4), whose kernels split their work by
output rows (each row's sum made by one thread), as do CPU attention and the
element-wise ops; tests pin a stage's logits equal at 1 and 2 threads. Float
formats' BLAS may split a sum by thread: they always run at the caller's count.

Pure logic (no torch): the stage feeds it timings. ``HETMESH_ADAPTIVE_THREADS=0``
turns it off.
"""

from __future__ import annotations

import math
import os
import statistics
import threading

ADAPTIVE_ENV = "HETMESH_ADAPTIVE_THREADS"
# a probe ends early once one count is this many times slower than the other: a
# 2-thread step on a busy machine takes 10-25x one thread's, and each costs that
CLEAR = 2.0
# probes cost at most this share of the time served at the choice (the forward at the
# losing count over the forwards until the next probe), waiting up to MAX_WAIT forwards
BUDGET = 0.05
MAX_WAIT = 8192


def adaptive_default() -> bool:
    """Whether compact stages choose their decode thread count (env switch, on unless ``0``)."""
    return os.environ.get(ADAPTIVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ThreadChooser:
    """1 thread or the caller's count for each decode forward; see the module docstring."""

    def __init__(self, *, probe: int = 3, first_period: int = 32, max_period: int = 1024) -> None:
        if probe < 1 or first_period < 1 or max_period < first_period:
            raise ValueError("probe and first_period must be >= 1, max_period >= first_period")
        self.probe, self.first_period, self.max_period = probe, first_period, max_period
        self.cap = 0  # the caller's count the current choice was made under
        self.choice = 0
        self.period = first_period
        self._until_probe = 0
        self._plan: list[int] = []  # the counts of the probe's forwards still to run
        self._samples: dict[int, list[float]] = {}
        # a stage server may run a forward on a reader thread while its device thread is
        # parked: one at a time, but not always the same thread
        self._lock = threading.Lock()

    def count(self, cap: int) -> int:
        """Threads for the next decode forward; ``cap`` is the count the caller set."""
        if cap <= 1:
            return cap
        with self._lock:
            return self._count(cap)

    def _count(self, cap: int) -> int:
        if cap != self.cap:  # a new caller count: probe from scratch
            self.cap, self.choice, self.period = cap, cap, self.first_period
            self._start_probe()
        if not self._plan and self._until_probe <= 0:
            self._start_probe()
        if self._plan:
            return self._plan[0]
        self._until_probe -= 1
        return self.choice

    def record(self, count: int, seconds_per_row: float) -> None:
        """A decode forward that :meth:`count` gave ``count`` threads took this long per row."""
        with self._lock:
            self._record(count, seconds_per_row)

    def _record(self, count: int, seconds_per_row: float) -> None:
        if not self._plan or self._plan[0] != count:
            return
        self._plan.pop(0)
        self._samples.setdefault(count, []).append(seconds_per_row)
        one = statistics.median(self._samples.get(1, [float("inf")]))
        many = statistics.median(self._samples.get(self.cap, [float("inf")]))
        measured_both = len(self._samples) == 2
        if self._plan and not (measured_both and max(one, many) >= CLEAR * min(one, many)):
            return  # not yet decided: the probe goes on
        self._plan = []
        choice = 1 if one < many else self.cap
        if choice == self.choice:
            self.period = min(2 * self.period, self.max_period)
        else:
            self.choice, self.period = choice, self.first_period
        # and no sooner than the loser's forward is BUDGET of the winner's in between
        affordable = math.ceil(max(one, many) / (BUDGET * max(min(one, many), 1e-9)))
        self._until_probe = max(self.period, min(affordable, MAX_WAIT))
        self._samples = {}

    def _start_probe(self) -> None:
        # alternated: both counts meet the machine's load swings alike
        other = 1 if self.choice != 1 else self.cap
        self._plan = [self.choice, other] * self.probe
        self._samples = {}


__all__ = ["ADAPTIVE_ENV", "BUDGET", "CLEAR", "MAX_WAIT", "ThreadChooser", "adaptive_default"]
