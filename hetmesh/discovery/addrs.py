"""Multiaddr strings: what we announce, and the host part of what peers announce."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

import psutil


def expand_listen_addrs(addrs: Sequence[Any], peer_id: str) -> tuple[str, ...]:
    """Dialable multiaddrs (with /p2p/) for our listen addrs; 0.0.0.0 becomes each IPv4."""
    out: list[str] = []
    for addr in addrs:
        text = str(addr).split("/p2p/")[0]
        parts = text.split("/")
        # ['', 'ip4', HOST, 'tcp', PORT]
        if len(parts) >= 5 and parts[1] == "ip4" and parts[2] == "0.0.0.0":
            ips = []
            for nics in psutil.net_if_addrs().values():
                for nic in nics:
                    if nic.family.name == "AF_INET":
                        ips.append(nic.address)
            non_loop = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
            for ip in non_loop or ips:
                out.append("/".join(["", "ip4", ip, *parts[3:]]) + f"/p2p/{peer_id}")
        else:
            out.append(f"{text}/p2p/{peer_id}")
    return tuple(dict.fromkeys(out))


def addr_host(addr: str) -> str | None:
    parts = addr.split("/")
    if len(parts) >= 3 and parts[1] in ("ip4", "ip6"):
        return parts[2]
    return None


__all__ = ["addr_host", "expand_listen_addrs"]
