"""The running node's state and settings, shared by the daemon and its services.

:func:`hetmesh.node.daemon.run_node` builds a :class:`Node`; every service
(discovery, serving, the HTTP API's backend) takes it or parts of it. Kept apart
from the daemon so that the services never import the module that starts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from hetmesh.discovery.service import Discovery
from hetmesh.discovery.table import LivenessPolicy
from hetmesh.nat.state import NatState
from hetmesh.node.config import ServingConfig


def default_data_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("hetmesh"))


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """Everything ``hetmesh node start`` can set; defaults suit a LAN."""

    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    bootstrap: tuple[str, ...] = ()
    mesh_secret: str | None = None
    mdns: bool = True
    data_dir: Path = field(default_factory=default_data_dir)
    max_memory_bytes: int | None = None
    device: str | None = None  # restrict to one torch device ("cpu", "cuda:0")
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    link_probe_interval_s: float = 60.0
    profile_update_s: float = 5.0  # memory/utilisation figures
    benchmark_refresh_s: float = 600.0  # re-measure FLOP/s when idle this often
    benchmark_budget_s: float = 1.5
    dial_timeout_s: float = 3.0
    serving: ServingConfig | None = field(default_factory=ServingConfig)
    api_port: int | None = None  # the HTTP API (hetmesh.node.api); None: off
    api_host: str = "127.0.0.1"  # beyond loopback only with an api_key
    api_key: str | None = None  # Bearer token the HTTP API requires (None: none)
    relay: bool = True  # offer relay slots to members behind NAT while publicly reachable


@dataclass(slots=True)
class Node:
    """The running node, handed to every service."""

    config: NodeConfig
    host: Any
    discovery: Discovery
    device_limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    stop_requested: trio.Event = field(default_factory=trio.Event)
    serving: Any = None  # hetmesh.node.serving.Serving, once the model is served
    # what NAT traversal learned (public IP, punched links): dial-back, relay, data plane
    nat: NatState = field(default_factory=NatState)

    def request_stop(self) -> None:
        """Ask :func:`run_node` to say goodbye, cancel its services and return."""
        self.stop_requested.set()

    @property
    def peer_id(self) -> str:
        return self.discovery.peer_id


__all__ = ["Node", "NodeConfig", "default_data_dir"]
