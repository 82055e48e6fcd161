"""Errors on the wire: one mapping from the tree of :mod:`hetmesh.errors` and back.

An error crosses the wire as its class's **name** (its Python name, in maps: the
generate RPC's error reply, session control replies, the HTTP API's
``error.hetmesh_error``) or its stable **code** (an integer, in the data plane's
binary ``Error`` frames). :func:`error_name`/:func:`error_code` encode an
exception as its nearest class in the tree (a foreign exception as
:class:`MeshError`); :func:`error_from_wire` turns either back into the
exception, an unknown name or code into a plain :class:`MeshError`. Pure.
"""

from __future__ import annotations

from hetmesh.errors import (
    AuthenticationFailed,
    ClientError,
    ComputeError,
    ConnectTimeout,
    CorruptModel,
    DeviceOutOfMemory,
    InsufficientCapacity,
    InvalidRequest,
    LocalProtocolError,
    MeshError,
    ModelError,
    ModelNotFound,
    NoRoute,
    PeerUnreachable,
    ProtocolError,
    Rejected,
    RemoteProtocolError,
    RequestTimeout,
    SchedulingError,
    StreamReset,
    TransportError,
    UnsupportedModel,
)

# The code of each class of the tree; never renumber one (old peers read them).
# 1-4 are the data-plane Error frame's historical codes (protocol, auth, internal,
# fallback), kept so their meaning on the wire does not change.
_CODES: dict[type[MeshError], int] = {
    MeshError: 0,
    InvalidRequest: 1,
    AuthenticationFailed: 2,
    ComputeError: 3,
    PeerUnreachable: 4,
    ProtocolError: 5,
    LocalProtocolError: 6,
    RemoteProtocolError: 7,
    TransportError: 8,
    ConnectTimeout: 9,
    StreamReset: 10,
    SchedulingError: 11,
    InsufficientCapacity: 12,
    NoRoute: 13,
    DeviceOutOfMemory: 14,
    ModelError: 15,
    ModelNotFound: 16,
    UnsupportedModel: 17,
    CorruptModel: 18,
    ClientError: 19,
    RequestTimeout: 20,
    Rejected: 21,
}
_BY_CODE = {code: cls for cls, code in _CODES.items()}
_BY_NAME = {cls.__name__: cls for cls in _CODES}


def _tree_class(exc: BaseException | type[BaseException]) -> type[MeshError]:
    """The nearest class of the tree ``exc`` is an instance (or subclass) of."""
    cls = exc if isinstance(exc, type) else type(exc)
    for base in cls.__mro__:
        if base in _CODES:
            return base  # type: ignore[return-value]  # a key of _CODES: a MeshError class
    return MeshError


def error_name(exc: BaseException | type[BaseException]) -> str:
    """The wire name of an error (or error class): its nearest class in the tree."""
    return _tree_class(exc).__name__


def error_code(exc: BaseException | type[BaseException]) -> int:
    """The wire code of an error (or error class): its nearest class in the tree."""
    return _CODES[_tree_class(exc)]


def error_from_wire(name_or_code: object, message: object) -> MeshError:
    """The local exception for an error a peer reported by name or code."""
    if isinstance(name_or_code, int) and not isinstance(name_or_code, bool):
        cls = _BY_CODE.get(name_or_code)
    else:
        cls = _BY_NAME.get(str(name_or_code))
    if cls is None:
        return MeshError(f"{name_or_code}: {message}")
    return cls(str(message))


__all__ = ["error_code", "error_from_wire", "error_name"]
