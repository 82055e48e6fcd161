"""The gateway's one table from a stage's error to what it does (hetmesh.node.outcomes)."""

from __future__ import annotations

import pytest

from hetmesh.error_codec import error_code, error_from_wire
from hetmesh.errors import (
    ComputeError,
    InvalidRequest,
    MeshError,
    NoRoute,
    PeerUnreachable,
    Rejected,
    RequestTimeout,
)
from hetmesh.node.control import Reply
from hetmesh.node.outcomes import Verdict, classify

CASES = [
    # error, on a control reply, on the data plane
    (InvalidRequest("unknown session s.0"), Verdict.PREEMPTED, Verdict.PREEMPTED),
    (InvalidRequest("sampling: temperature must be >= 0"), Verdict.FATAL, Verdict.FATAL),
    (Rejected("busy: no free KV blocks"), Verdict.BUSY, Verdict.PREEMPTED),
    (NoRoute("no stage 0-4 here"), Verdict.REPLAN, Verdict.REPLAN),
    (NoRoute("moved session s.0: it moved to b2"), Verdict.REPLAN, Verdict.MOVED),
    (PeerUnreachable("no answer"), Verdict.SUSPECT, Verdict.SUSPECT),
    (ComputeError("the forward failed"), Verdict.SUSPECT, Verdict.SUSPECT),
    (RequestTimeout("stalled"), Verdict.SUSPECT, Verdict.SUSPECT),
    (MeshError("something else"), Verdict.SUSPECT, Verdict.SUSPECT),
]


@pytest.mark.parametrize(("error", "control", "data"), CASES)
def test_each_error_has_one_verdict_per_channel(
    error: MeshError, control: Verdict, data: Verdict
) -> None:
    assert classify(error, data_plane=False) is control
    assert classify(error, data_plane=True) is data


@pytest.mark.parametrize(("error", "control", "data"), CASES)
def test_the_verdict_survives_the_wire(error: MeshError, control: Verdict, data: Verdict) -> None:
    """What a stage sends (a reply's kind, a frame's code) is classified as the error it
    stands for: the gateway sees only the wire form."""
    reply = Reply.failed(error).error()
    assert reply is not None
    assert classify(reply, data_plane=False) is control
    frame = error_from_wire(error_code(error), str(error))
    assert classify(frame, data_plane=True) is data


def test_unknown_session_is_only_the_prefix() -> None:
    """Only a message that begins so means the stage let the session go."""
    assert classify(InvalidRequest("not an unknown session"), data_plane=True) is Verdict.FATAL
