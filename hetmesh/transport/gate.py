"""Admission of unauthenticated connections: a cap in total, per source address and
per source prefix.

Pure bookkeeping (no trio, no sockets): a listener asks :meth:`ConnectionGate.admit`
when it accepts a connection and calls :meth:`ConnectionGate.release` once that
connection has authenticated or gone. A connection refused here is closed at
once, before a byte of it is read, so a stranger holding many silent
connections costs the node a bounded number of sockets and nothing else.

Addresses are also counted by network (:func:`source_prefix`: an IPv4 /24, an
IPv6 /64, where one holder usually has every address): a stranger with many
addresses of one network holds at most ``max_per_prefix`` places once the gate
is half full, and the rest stay open to everyone else.

Members of one LAN are never starved by that cap (issue 45): a home LAN is one
/24 whose addresses are different machines, and a mesh starting there has all
its members probing and dialling each other at once. So loopback addresses
(this machine's) and private-LAN ones (RFC 1918, link-local, IPv6 unique-local:
:data:`LAN_NETWORKS`) count each on its own, bounded per address and in total
only (a stranger there is already inside that network); and a public network
(an IPv6 home LAN's /64 is one) counts against ``max_per_prefix`` only while
the gate is at least half full: alone, its members may take half the places.
A stranger with one network holds at most ``max(max_total // 2,
max_per_prefix)`` places; a member elsewhere still gets in.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

from hetmesh.errors import LocalProtocolError


@dataclass(frozen=True, slots=True, kw_only=True)
class GateStatistics:
    pending: int  # admitted connections not yet authenticated
    admitted: int
    refused: int


# private LANs: their addresses are counted one by one (see the module docstring);
# not 100.64.0.0/10 (carrier-grade NAT: one network of many customers)
LAN_NETWORKS: Final = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)


def source_prefix(address: str) -> str:
    """The network ``address`` is counted under: its /24 (IPv4, mapped ones included)
    or /64 (IPv6); a loopback, private-LAN or unparsable address is its own."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or any(ip in net for net in LAN_NETWORKS):
        return address
    bits = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class ConnectionGate:
    """At most ``max_total`` pending connections, ``max_per_address`` from any one
    address and, once half full, ``max_per_prefix`` from any one network (default: a
    quarter of the total, at least ``max_per_address``)."""

    def __init__(
        self, max_total: int, max_per_address: int, max_per_prefix: int | None = None
    ) -> None:
        if max_total < 1 or max_per_address < 1:
            raise LocalProtocolError("connection caps must be at least 1")
        self.max_total = max_total
        self.max_per_address = max_per_address
        self.max_per_prefix = max_per_prefix or max(max_per_address, max_total // 4)
        self._prefixes: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._total = 0
        self._admitted = 0
        self._refused = 0

    def admit(self, address: str) -> bool:
        """Take a slot for a connection from ``address``; False (counted) when full."""
        held = self._pending.get(address, 0)
        prefix = source_prefix(address)
        in_prefix = self._prefixes.get(prefix, 0)
        pressed = 2 * self._total >= self.max_total  # half full: networks keep to a share
        if (
            self._total >= self.max_total
            or held >= self.max_per_address
            or (pressed and in_prefix >= self.max_per_prefix)
        ):
            self._refused += 1
            return False
        self._pending[address] = held + 1
        self._prefixes[prefix] = in_prefix + 1
        self._total += 1
        self._admitted += 1
        return True

    def release(self, address: str) -> None:
        """Give back the slot :meth:`admit` took (once per admitted connection)."""
        held = self._pending.get(address, 0)
        if held <= 0:
            raise LocalProtocolError(f"no pending connection from {address!r} to release")
        if held == 1:
            del self._pending[address]  # the maps stay as small as what is pending
        else:
            self._pending[address] = held - 1
        prefix = source_prefix(address)
        if self._prefixes[prefix] == 1:
            del self._prefixes[prefix]
        else:
            self._prefixes[prefix] -= 1
        self._total -= 1

    def statistics(self) -> GateStatistics:
        return GateStatistics(pending=self._total, admitted=self._admitted, refused=self._refused)


__all__ = ["LAN_NETWORKS", "ConnectionGate", "GateStatistics", "source_prefix"]
