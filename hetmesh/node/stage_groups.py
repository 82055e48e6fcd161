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

Pure logic (no trio); ``HETMESH_STAGE_GROUPS=0`` turns it off (every burst then
waits for the share or the gap, as before). ``HETMESH_STAGE_GATHER_MS`` sets the
gap (default ``GATHER_S``, 5 ms: a lone straggler waits it at every stage, every
token; the quiet A/B decides whether a shorter one keeps the rounds whole).
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


def groups_enabled() -> bool:
    """Whether stages end a gather once the waiting sessions' groups are in (default on)."""
    return os.environ.get("HETMESH_STAGE_GROUPS", "1") != "0"


def gather_seconds() -> float:
    """The longest gap between two frames of one burst, in seconds: ``HETMESH_STAGE_GATHER_MS``
    (0 to 1000 ms; 0: a round starts on what has come), else :data:`GATHER_S`. A value that
    is not such a number keeps the default, with a warning (the node serves on)."""
    raw = os.environ.get(GATHER_ENV, "").strip()
    if not raw:
        return GATHER_S
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0.0 <= ms <= MAX_GATHER_MS:  # (NaN fails too)
        log.warning(
            "%s=%r is not 0 to %g ms: the gap stays %g ms",
            GATHER_ENV,
            raw,
            MAX_GATHER_MS,
            GATHER_S * 1e3,
        )
        return GATHER_S
    return ms / 1e3


class Groups:
    """Each session's last round on one stage (the sessions of that round)."""

    def __init__(self) -> None:
        self._of: dict[str, frozenset[str]] = {}

    def ran(self, sessions: Iterable[str], open_sessions: Collection[str]) -> None:
        """``sessions`` ran in one round; forget the groups of sessions no longer open."""
        group = frozenset(sessions)
        for sid in group:
            self._of[sid] = group
        if len(self._of) > 2 * len(open_sessions) + 8:  # closed sessions: drop them
            self._of = {s: g for s, g in self._of.items() if s in open_sessions}

    def forget(self, session_id: str) -> None:
        self._of.pop(session_id, None)

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


__all__ = ["Groups", "groups_enabled"]
