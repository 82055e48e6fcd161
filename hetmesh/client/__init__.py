"""The client SDK: a light peer that talks to a mesh (see :mod:`hetmesh.client.sdk`).

The clients are imported on first use, so that importing a pure part of
hetmesh (the scheduler, the frames) never pulls in trio.
"""

from typing import TYPE_CHECKING, Any

from hetmesh.client._base import Completion, Delta, SamplingOptions, Timeout

if TYPE_CHECKING:
    from hetmesh.client.sdk import AsyncClient, Client


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client"):
        from hetmesh.client import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'hetmesh.client' has no attribute {name!r}")


__all__ = ["AsyncClient", "Client", "Completion", "Delta", "SamplingOptions", "Timeout"]
