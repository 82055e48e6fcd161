"""Session control messages between a gateway and the stages of a pipeline.

They travel on the libp2p control plane (``SESSION_PROTOCOL``), one request
and one reply per stream, as length-prefixed msgpack maps (the framing of
:mod:`hetmesh.discovery.wire`). Tensors never travel here: token ids and
hidden states go over the data plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hetmesh.errors import InvalidRequest, MeshError, Rejected, RemoteProtocolError
from hetmesh.resources import PeerId, WireRecord

SESSION_PROTOCOL = "/hetmesh/session/1.0.0"
MAX_CONTROL_BYTES = 64 * 1024

ErrorKind = Literal["", "busy", "invalid", "not_serving", "internal"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingWire(WireRecord):
    """Sampling settings the last stage applies; ``seed`` is always set by the gateway."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenSession(WireRecord):
    """Ask a stage to hold a session's KV cache and where to send its outputs."""

    session_id: str
    start: int
    end: int
    next_peer: PeerId  # the next stage, or the gateway for the last stage
    gateway: PeerId
    max_tokens: int
    sampling: SamplingWire
    op: str = "open"


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseSession(WireRecord):
    session_id: str
    op: str = "close"


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply(WireRecord):
    ok: bool
    kind: str = ""
    message: str = ""

    def raise_for_error(self) -> None:
        """Turn an error reply into the matching exception."""
        if self.ok:
            return
        if self.kind == "busy":
            raise Rejected(self.message)
        if self.kind == "invalid":
            raise InvalidRequest(self.message)
        raise MeshError(self.message or "stage refused the request")


def parse_request(data: dict[str, Any]) -> OpenSession | CloseSession:
    """Decode a control request map, or raise :class:`RemoteProtocolError`."""
    op = data.get("op")
    try:
        if op == "open":
            return OpenSession.from_wire(data)
        if op == "close":
            return CloseSession.from_wire(data)
    except ValueError as exc:
        raise RemoteProtocolError(f"malformed session request: {exc}") from exc
    raise RemoteProtocolError(f"unknown session operation {op!r}")
