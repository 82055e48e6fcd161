"""The exception tree is rooted, shaped as drawn, and fully exported."""

from __future__ import annotations

import pytest

import hetmesh
from hetmesh import errors

TREE = {
    "ProtocolError": "MeshError",
    "LocalProtocolError": "ProtocolError",
    "RemoteProtocolError": "ProtocolError",
    "TransportError": "MeshError",
    "ConnectTimeout": "TransportError",
    "PeerUnreachable": "TransportError",
    "StreamReset": "TransportError",
    "AuthenticationFailed": "TransportError",
    "SchedulingError": "MeshError",
    "InsufficientCapacity": "SchedulingError",
    "NoRoute": "SchedulingError",
    "ComputeError": "MeshError",
    "DeviceOutOfMemory": "ComputeError",
    "ModelError": "MeshError",
    "ModelNotFound": "ModelError",
    "UnsupportedModel": "ModelError",
    "CorruptModel": "ModelError",
    "ClientError": "MeshError",
    "RequestTimeout": "ClientError",
    "Rejected": "ClientError",
    "InvalidRequest": "ClientError",
}


@pytest.mark.parametrize(("name", "parent"), sorted(TREE.items()))
def test_error_has_its_parent(name: str, parent: str) -> None:
    cls = getattr(errors, name)
    assert cls.__bases__ == (getattr(errors, parent),)
    assert issubclass(cls, errors.MeshError)
    assert name in (errors.__doc__ or "")  # drawn in the module docstring


def test_every_error_is_exported() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception)
    }
    assert defined == set(errors.__all__) - {"find_in_group"}
    assert defined == set(TREE) | {"MeshError"}
    assert hetmesh.MeshError is errors.MeshError


def test_insufficient_capacity_carries_missing_bytes() -> None:
    exc = errors.InsufficientCapacity("short by 2 GiB", missing_bytes=2 * 2**30)
    assert exc.missing_bytes == 2 * 2**30
    assert str(exc) == "short by 2 GiB"


def test_find_in_group_digs_through_nested_groups() -> None:
    inner = errors.NoRoute("no pipeline")
    group = BaseExceptionGroup("outer", [ValueError("x"), ExceptionGroup("inner", [inner])])
    assert errors.find_in_group(group, errors.MeshError) is inner
    assert errors.find_in_group(group, OSError) is None
    assert errors.find_in_group(inner, errors.SchedulingError) is inner
