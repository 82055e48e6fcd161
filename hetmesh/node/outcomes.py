"""What a stage's failure means to the gateway, decided once (pure).

A stage says no in two ways: an error reply to a control request (opening a
session, moving it: :class:`~hetmesh.node.control.Reply`) and an
:class:`~hetmesh.transport.frames.Error` frame on the data plane while a step
is in flight. Either way the gateway does one of six things with it:

=======================================  =============  ==========  =======================
the stage's error                        control reply  data plane  meaning
=======================================  =============  ==========  =======================
``InvalidRequest("unknown session …")``  preempted      preempted   it let the session go
``InvalidRequest`` (anything else)       fatal          fatal       the request is bad
``Rejected``                             busy           preempted   no room / KV evicted
``NoRoute("moved session …")``           re-plan        moved       it handed it on
``NoRoute`` (anything else)              re-plan        re-plan     the plan moved it
anything else (``PeerUnreachable``, …)   suspect        suspect     the stage failed
=======================================  =============  ==========  =======================

What each verdict then costs is the caller's: an open waits while stages are
busy and replays nothing; a move falls back to a replay on anything but a
suspect, and avoids a suspect's peer; a step resumes a preempted session by
replay with a new place in line, sends a step that reached a stage after the
session moved off it once more on its new route, and replays anything but a
fatal error on a new route. No I/O, no trio.
"""

from __future__ import annotations

import enum

from hetmesh.errors import InvalidRequest, MeshError, NoRoute, Rejected

UNKNOWN_SESSION = "unknown session "
"""How a stage's ``InvalidRequest`` begins when it holds no such session."""
MOVED_SESSION = "moved session "
"""How a stage's ``NoRoute`` begins for a step of a session it has handed over (a move)."""
MID_STEP = "busy: mid-step: "
"""How a stage's ``Rejected`` begins when a move finds the session's step still on its
device thread (its token may be back at the gateway already: ask again shortly)."""


class Verdict(enum.Enum):
    """What a stage's error means for the session it was about."""

    PREEMPTED = "preempted"  # the stage let the session go to make room: resume by replay
    BUSY = "busy"  # the stage cannot take it now: ask again after a while
    REPLAN = "re-plan"  # a new plan moved the stage: route again, avoiding nobody for it
    MOVED = "moved"  # a step reached a stage the session moved off: send it again
    SUSPECT = "suspect"  # the stage failed or did not answer: avoid its peer
    FATAL = "fatal"  # the request itself is impossible: the caller's error


def classify(error: MeshError, *, data_plane: bool) -> Verdict:
    """The verdict on a stage's ``error``: from an ``Error`` frame for a step in flight
    (``data_plane``) or from an error reply to a control request."""
    if isinstance(error, InvalidRequest):
        # a stage holding no such session let it go (preempted: its Rejected may come
        # second) before the request reached it
        return Verdict.PREEMPTED if str(error).startswith(UNKNOWN_SESSION) else Verdict.FATAL
    if isinstance(error, Rejected):
        # on the data plane only a preemption sends it; a control reply: busy, full
        return Verdict.PREEMPTED if data_plane else Verdict.BUSY
    if isinstance(error, NoRoute):
        moved = data_plane and str(error).startswith(MOVED_SESSION)
        return Verdict.MOVED if moved else Verdict.REPLAN
    return Verdict.SUSPECT


__all__ = ["MID_STEP", "MOVED_SESSION", "UNKNOWN_SESSION", "Verdict", "classify"]
