"""hetmesh: a peer-to-peer mesh that serves large language models across mixed machines.

The SDK's public names live here: ``from hetmesh import Client, AsyncClient, Timeout``,
and the exception tree (``hetmesh.MeshError`` and ``hetmesh.errors``).
"""

from typing import TYPE_CHECKING, Any

from hetmesh import errors
from hetmesh.client._base import Completion, Delta, SamplingOptions, Timeout
from hetmesh.errors import (
    ClientError,
    ConnectTimeout,
    InvalidRequest,
    MeshError,
    NoRoute,
    PeerUnreachable,
    Rejected,
    RequestTimeout,
)

if TYPE_CHECKING:
    from hetmesh.client.sdk import AsyncClient, Client

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``Client`` and ``AsyncClient`` load trio: import them only when asked for."""
    if name in ("AsyncClient", "Client"):
        from hetmesh.client import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'hetmesh' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Completion",
    "ConnectTimeout",
    "Delta",
    "InvalidRequest",
    "MeshError",
    "NoRoute",
    "PeerUnreachable",
    "Rejected",
    "RequestTimeout",
    "SamplingOptions",
    "Timeout",
    "__version__",
    "errors",
]
