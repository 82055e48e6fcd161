"""The libp2p control plane: host, membership, announcements, liveness, profiling.

The daemon builds a :class:`Discovery` around its host and runs
:meth:`Discovery.serve`; see :mod:`hetmesh.node.daemon`.
"""

from hetmesh.discovery.service import Discovery, DiscoveryConfig, DiscoveryStatistics
from hetmesh.discovery.table import Health, LivenessPolicy, PeerEntry, TableEvent
from hetmesh.discovery.wire import Announcement, KnownPeer, Load

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
