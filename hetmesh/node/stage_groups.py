"""Micro-batch groups: which sessions a stage ran in one round, so that it knows when
the next round's burst is complete.

A stage of a cut serving several streams gathers a burst of frames into one round
(:meth:`StageServer._gather <hetmesh.node.stage_server.StageServer._gather>`): the
previous stage sends a round's outputs one right after another. Without knowing
how many frames a burst holds, it waits until its share of the open sessions is
in, or until no frame has come for ``GATHER_S``. A group smaller than the share
(8 streams running as groups of 3, 3 and 2 with a share of 4) then waits out that
gap at every stage, every token.

The sessions of one round travel together: their outputs leave in one burst, the
next stage runs them in one round, and the last stage's tokens bring them back
to the first together. So a stage remembers each session's last round here, and
a burst is complete once every session of the rounds of the sessions waiting is
in (sessions closed meanwhile do not count): the round starts then, without the
gap. A session that never ran here (a new one's prefill) has no group, and a
burst holding one gathers as before; so does a burst of fewer than half the
share (a lone straggler split off a round): it waits for the gap, to rejoin a
round, since groups that never merge again would crumble into single steps,
each a forward of its own.

Groups too small for the micro-batches merge. With more groups circulating than
``micro_batches`` (8 streams on a cut of 3 settled as groups of 4, 3 and 1: 2026-12-12,
a third of every stage's rounds were one session's step, each costing nearly what a
round of four does), a stage computes more rounds than it needs, each paying its
layers' weights again. So a burst of decode steps smaller than the share, when the
sessions active here could not fit in ``micro_batches`` rounds of the share with it
apart (:meth:`Groups.too_small`), waits up to ``MERGE_S`` for the next group to come in
and runs with it: the groups settle as ``micro_batches`` rounds of the share. The wait
costs no CPU (the stage has nothing else to run) and only while other active sessions
are on their way (the stage server bounds it by two of its recent rounds: the next
group comes in about a round behind); a session counts as active for :data:`ACTIVE_S` after its last
round here, so idle ones (a client that stopped reading) stop holding bursts back.

Pure logic (no trio); ``HETMESH_STAGE_GROUPS=0`` turns it off (every burst then
waits for the share or the gap, as before). ``HETMESH_STAGE_GATHER_MS`` sets the
gap (default ``GATHER_S``, 5 ms: a lone straggler waits it at every stage, every
token; the quiet A/B decides whether a shorter one keeps the rounds whole).
``HETMESH_STAGE_MERGE_MS`` sets the merge's longest wait (default ``MERGE_S``; 0: groups
too small do not wait to merge, as before 2026-12-12). ``HETMESH_STAGE_MICRO_BATCHES``
sets a cut's micro-batches (default 2; three stages on two cores might prefer 3: for
the quiet A/B).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection, Iterable

log = logging.getLogger(__name__)

GATHER_S = 0.005  # the default longest gap between two frames of one burst
GATHER_ENV = "HETMESH_STAGE_GATHER_MS"
MAX_GATHER_MS = 1000.0
# the default longest wait of a burst too small for the micro-batches, for the next group:
# a ceiling; the stage server bounds it by two of its recent rounds (the next group comes
# about a round behind), ~25 ms for the default model's stages, ~100 ms at 1B
MERGE_S = 0.2
MERGE_ENV = "HETMESH_STAGE_MERGE_MS"
# a session counts as active here this long after its last round here
ACTIVE_S = 1.0


def groups_enabled() -> bool:
    """Whether stages end a gather once the waiting sessions' groups are in (default on)."""
    return os.environ.get("HETMESH_STAGE_GROUPS", "1") != "0"


def gather_seconds() -> float:
    """The longest gap between two frames of one burst, in seconds: ``HETMESH_STAGE_GATHER_MS``
    (0 to 1000 ms; 0: a round starts on what has come), else :data:`GATHER_S`. A value that
    is not such a number keeps the default, with a warning (the node serves on)."""
    return _ms_env(GATHER_ENV, GATHER_S, "the gap")


def merge_seconds() -> float:
    """The longest a burst too small for the micro-batches waits for the next group, in
    seconds: ``HETMESH_STAGE_MERGE_MS`` (0 to 1000 ms; 0: no wait), else :data:`MERGE_S`;
    a value that is not such a number keeps the default, with a warning."""
    return _ms_env(MERGE_ENV, MERGE_S, "the merge's wait")


MICRO_BATCHES_ENV = "HETMESH_STAGE_MICRO_BATCHES"
MAX_MICRO_BATCHES = 8


def micro_batches_env() -> int | None:
    """A stage of a cut's micro-batches as ``HETMESH_STAGE_MICRO_BATCHES`` says (1 to 8:
    a round takes that share of the open sessions; the stage server's default, 2, where
    unset); a value that is not such a number is ignored, with a warning."""
    raw = os.environ.get(MICRO_BATCHES_ENV, "").strip()
    if not raw:
        return None
    if raw.isdigit() and 1 <= int(raw) <= MAX_MICRO_BATCHES:
        return int(raw)
    log.warning(
        "%s=%r is not 1 to %d: the default micro-batches stay",
        MICRO_BATCHES_ENV,
        raw,
        MAX_MICRO_BATCHES,
    )
    return None


def _ms_env(name: str, default_s: float, what: str) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0.0 <= ms <= MAX_GATHER_MS:  # (NaN fails too)
        log.warning(
            "%s=%r is not 0 to %g ms: %s stays %g ms",
            name,
            raw,
            MAX_GATHER_MS,
            what,
            default_s * 1e3,
        )
        return default_s
    return ms / 1e3


class Groups:
    """Each session's last round on one stage (the sessions of that round)."""

    def __init__(self) -> None:
        self._of: dict[str, frozenset[str]] = {}
        self._last: dict[str, float] = {}  # each session's last round here (the caller's clock)

    def ran(
        self, sessions: Iterable[str], open_sessions: Collection[str], now: float = 0.0
    ) -> None:
        """``sessions`` ran in one round at ``now``; forget the groups of sessions no longer
        open."""
        group = frozenset(sessions)
        for sid in group:
            self._of[sid] = group
            self._last[sid] = now
        if len(self._of) > 2 * len(open_sessions) + 8:  # closed sessions: drop them
            self._of = {s: g for s, g in self._of.items() if s in open_sessions}
            self._last = {s: t for s, t in self._last.items() if s in open_sessions}

    def forget(self, session_id: str) -> None:
        self._of.pop(session_id, None)
        self._last.pop(session_id, None)

    def active(self, open_sessions: Collection[str], now: float) -> set[str]:
        """The open sessions that ran a round here within :data:`ACTIVE_S` of ``now``."""
        return {s for s in open_sessions if s in self._last and now - self._last[s] <= ACTIVE_S}

    def too_small(
        self,
        waiting: Collection[str],
        open_sessions: Collection[str],
        share: int,
        micro_batches: int,
        now: float,
    ) -> bool:
        """Whether a burst of ``waiting`` sessions should wait for the next group to merge
        with: fewer than the ``share`` of a round, and the sessions active here (these
        among them) need more than ``micro_batches`` rounds of the share if it runs apart
        (the rest would fill ``micro_batches - 1`` rounds and still leave some over)."""
        if micro_batches < 2 or len(waiting) >= share:
            return False
        active = self.active(open_sessions, now) | set(waiting)
        return len(waiting) < len(active) - share * (micro_batches - 1)

    def of(self, session_id: str) -> frozenset[str] | None:
        return self._of.get(session_id)

    def complete(self, waiting: Collection[str], open_sessions: Collection[str]) -> bool:
        """Whether the burst of ``waiting`` sessions is all in: each ran here before, and
        every open session of their last rounds here waits too."""
        if not waiting:
            return False
        for sid in waiting:
            group = self._of.get(sid)
            if group is None:
                return False
            for member in group:
                if member not in waiting and member in open_sessions:
                    return False
        return True


__all__ = [
    "ACTIVE_S",
    "GATHER_S",
    "MERGE_S",
    "Groups",
    "gather_seconds",
    "groups_enabled",
    "merge_seconds",
]
