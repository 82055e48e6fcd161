"""mDNS membership: advertise this node and hear of others on the LAN.

py-libp2p's mDNS (zeroconf) reports peers through a process-global registry,
on a zeroconf thread; :func:`start_mdns` filters nothing itself but hands each
discovery to ``on_peer`` as ``(peer_id, dialable addrs)``, and the caller moves
it into trio. The service name carries the mesh fingerprint, so meshes with
different secrets do not even see each other's adverts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hetmesh.resources import PeerId

OnPeer = Callable[[PeerId, tuple[str, ...]], None]


@dataclass(frozen=True, slots=True)
class MdnsHandle:
    service: Any
    handler: Callable[[Any], None]


def start_mdns(host: Any, addrs: Sequence[str], fingerprint: str, on_peer: OnPeer) -> MdnsHandle:
    """Advertise ``addrs`` (with /p2p/) and report peers heard of to ``on_peer``.

    Must be called from the trio thread (the listener starts a trio system task).
    """
    from libp2p.discovery.events.peerDiscovery import peerDiscovery
    from libp2p.discovery.mdns.mdns import create_mdns_discovery

    plain = [a.split("/p2p/")[0] for a in addrs]
    port = int(plain[0].split("/")[4]) if plain else 0

    def handler(info: Any) -> None:
        peer_id = str(info.peer_id)
        dialable = tuple(f"{a}/p2p/{peer_id}" for a in map(str, info.addrs) if "/tcp/" in a)
        if dialable:
            on_peer(peer_id, dialable)

    service = create_mdns_discovery(
        host.get_network(),
        port=port,
        listen_addrs=plain,
        private_network_fingerprint=fingerprint,
    )
    peerDiscovery.register_peer_discovered_handler(handler)
    service.start()
    return MdnsHandle(service, handler)


def stop_mdns(handle: MdnsHandle) -> None:
    from libp2p.discovery.events.peerDiscovery import peerDiscovery

    peerDiscovery.unregister_peer_discovered_handler(handle.handler)
    with contextlib.suppress(Exception):
        handle.service.stop()


__all__ = ["MdnsHandle", "start_mdns", "stop_mdns"]
