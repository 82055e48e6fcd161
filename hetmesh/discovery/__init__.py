"""The libp2p control plane: host, membership, announcements, liveness, profiling.

The daemon builds a :class:`Discovery` around its host and runs
:meth:`Discovery.serve`; see :mod:`hetmesh.node.daemon`. The membership
protocol itself is pure (:mod:`hetmesh.discovery.membership`): importing it
loads neither trio nor libp2p, so the service names below load lazily.
"""

from typing import TYPE_CHECKING, Any

from hetmesh.discovery.table import Health, LivenessPolicy, PeerEntry, TableEvent
from hetmesh.discovery.wire import Announcement, KnownPeer, Load

if TYPE_CHECKING:
    from hetmesh.discovery.service import Discovery, DiscoveryConfig, DiscoveryStatistics


def __getattr__(name: str) -> Any:
    """The service's names load trio: import them only when asked for."""
    if name in ("Discovery", "DiscoveryConfig", "DiscoveryStatistics"):
        from hetmesh.discovery import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Announcement",
    "Discovery",
    "DiscoveryConfig",
    "DiscoveryStatistics",
    "Health",
    "KnownPeer",
    "LivenessPolicy",
    "Load",
    "PeerEntry",
    "TableEvent",
]
