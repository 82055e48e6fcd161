"""The whole hetmesh exception tree, rooted at :class:`MeshError`.

```
MeshError
├── ProtocolError
│   ├── LocalProtocolError      we misused a protocol object (a bug on our side)
│   └── RemoteProtocolError     the peer sent something malformed or over a cap
├── TransportError
│   ├── ConnectTimeout
│   ├── PeerUnreachable
│   ├── StreamReset             the peer vanished or reset mid-transfer
│   └── AuthenticationFailed    wrong mesh secret or data-plane credential
├── SchedulingError
│   ├── InsufficientCapacity    the mesh cannot hold the model (says how much is missing)
│   └── NoRoute                 no healthy pipeline serves the request
├── ComputeError
│   └── DeviceOutOfMemory
├── ModelError
│   ├── ModelNotFound           a path or name that does not exist
│   ├── UnsupportedModel        an architecture or format we do not serve
│   └── CorruptModel            a truncated or mismatching file
└── ClientError
    ├── RequestTimeout
    ├── Rejected                the mesh is busy or refused the request
    └── InvalidRequest          the request itself is impossible or malformed
```

Library code raises these; boundaries (libp2p, sockets, torch, HTTP) translate
foreign exceptions into them with ``raise X(...) from exc``. The CLI prints
``str(exc)`` of any ``MeshError`` as one line and exits non-zero.

Errors cross the wire one way, through :mod:`hetmesh.error_codec`.
"""

from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound=BaseException)


def find_in_group(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first ``kind`` exception in ``exc`` or, depth first, in its exception groups.

    Structured concurrency wraps errors in groups; boundaries (the CLI, the HTTP
    server) use this to report the error that matters in one line.
    """
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find_in_group(inner, kind)
            if found is not None:
                return found
    return None


class MeshError(Exception):
    """Root of every error hetmesh raises on purpose."""


class ProtocolError(MeshError):
    """A protocol was violated."""


class LocalProtocolError(ProtocolError):
    """Our own code misused a protocol object: a bug, never the peer's fault."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol or exceed a cap."""


class TransportError(MeshError):
    """Moving bytes between peers failed."""


class ConnectTimeout(TransportError):
    """A connection could not be set up in time."""


class PeerUnreachable(TransportError):
    """No route to the peer, or it refused the connection."""


class StreamReset(TransportError):
    """The peer closed or reset the stream before a message was complete."""


class AuthenticationFailed(TransportError):
    """The peer could not prove membership (mesh secret or credential)."""


class SchedulingError(MeshError):
    """No placement or route satisfies the request."""


class InsufficientCapacity(SchedulingError):
    """The devices cannot hold the model; ``missing_bytes`` says by how much."""

    def __init__(self, message: str, *, missing_bytes: int = 0) -> None:
        super().__init__(message)
        self.missing_bytes = missing_bytes


class NoRoute(SchedulingError):
    """No healthy pipeline can serve the request."""


class ComputeError(MeshError):
    """Running a model stage failed."""


class DeviceOutOfMemory(ComputeError):
    """The device ran out of memory."""


class ModelError(MeshError):
    """A model could not be located, read or understood."""


class ModelNotFound(ModelError):
    """The model path or name does not exist."""


class UnsupportedModel(ModelError):
    """The model's architecture or file format is not one hetmesh serves."""


class CorruptModel(ModelError):
    """The model file is truncated, fails its checksum, or lacks tensors."""


class ClientError(MeshError):
    """A request failed as seen by the client."""


class RequestTimeout(ClientError):
    """The request did not finish within its timeout."""


class Rejected(ClientError):
    """The mesh refused the request (busy, shutting down, not a member)."""


class InvalidRequest(ClientError):
    """The request is malformed or impossible (bad sampling values, too long).

    ``param`` names the request field at fault, when one is (the HTTP API
    reports it as OpenAI's ``error.param``).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


__all__ = [
    "AuthenticationFailed",
    "ClientError",
    "ComputeError",
    "ConnectTimeout",
    "CorruptModel",
    "DeviceOutOfMemory",
    "InsufficientCapacity",
    "InvalidRequest",
    "LocalProtocolError",
    "MeshError",
    "ModelError",
    "ModelNotFound",
    "NoRoute",
    "PeerUnreachable",
    "ProtocolError",
    "Rejected",
    "RemoteProtocolError",
    "RequestTimeout",
    "SchedulingError",
    "StreamReset",
    "TransportError",
    "UnsupportedModel",
    "find_in_group",
]
