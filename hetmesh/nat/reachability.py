"""Reachability, purely: what a dial-back request says and what its answers mean.

A node asks a few members to dial it back at its announced addresses
(:mod:`hetmesh.nat.dialback` does the I/O). A member dials only the announced
addresses whose IP is the one it sees the request come from — so a node
behind a NAT, whose private address is not the router's public one, is never
dialled (nor is anybody else: a member cannot be made to dial a third party)
— and answers whether it connected and how it saw the requester. The node's
verdict: ``public`` once a member reached it, ``behind NAT`` once members
answered and none could, ``unknown`` before that. The verdict rides in the
record's ``extra`` under :data:`EXTRA_KEY` as one short word.

Nothing here does I/O or imports trio/libp2p.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from hetmesh.errors import RemoteProtocolError

DIALBACK_PROTOCOL = "/hetmesh/dialback/1.0.0"
EXTRA_KEY = "reach"  # the record's extra field carrying the verdict
# set by hetmesh.nat.relay in the record's extra:
RELAY_KEY = "relay"  # 1 while the member offers relay slots
VIA_KEY = "via"  # the relay a member behind NAT is reachable through
RELAYED_KEY = "relayed"  # members its connection to runs through a relay
PUNCHED_KEY = "punched"  # members it holds a hole-punched data-plane link to

PUBLIC = "public"
BEHIND_NAT = "behind NAT"
UNKNOWN = "unknown"
# on the wire (record extra), one short word each
_WIRE = {PUBLIC: "public", BEHIND_NAT: "nat", UNKNOWN: "unknown"}
_FROM_WIRE = {v: k for k, v in _WIRE.items()}

MAX_DIALBACK_ADDRS = 8  # addresses one request may ask to be dialled at
MAX_ADDR_CHARS = 256
MAX_REQUEST_BYTES = 4096
MAX_REPLY_BYTES = 1024


@dataclass(frozen=True, slots=True)
class DialbackRequest:
    addrs: tuple[str, ...]  # the requester's announced multiaddrs
    probe_port: int  # its link-probe port (answers only with the mesh secret)

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb({"addrs": list(self.addrs), "probe_port": self.probe_port})
        return blob

    @staticmethod
    def decode(blob: bytes) -> DialbackRequest:
        """Parse a request; ``RemoteProtocolError`` for anything malformed or over the caps."""
        if len(blob) > MAX_REQUEST_BYTES:
            raise RemoteProtocolError(f"dial-back request of {len(blob)} bytes")
        raw = _unpack_map(blob)
        addrs, port = raw.get("addrs"), raw.get("probe_port")
        if not isinstance(addrs, list) or len(addrs) > MAX_DIALBACK_ADDRS:
            raise RemoteProtocolError("dial-back request: addrs must be a short list")
        if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs):
            raise RemoteProtocolError("dial-back request: addrs must be short strings")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise RemoteProtocolError("dial-back request: probe_port must be a port number")
        return DialbackRequest(tuple(addrs), port)


@dataclass(frozen=True, slots=True)
class DialbackReply:
    reached: bool  # the member connected to one of the addresses (and its probe port)
    address: str  # the address it reached, or "" when none
    observed: str  # the requester's IP as the member saw it ("" when unknown)
    tried: int  # addresses the member dialled (0: none matched the observed IP)

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb(
            {
                "reached": self.reached,
                "address": self.address,
                "observed": self.observed,
                "tried": self.tried,
            }
        )
        return blob

    @staticmethod
    def decode(blob: bytes) -> DialbackReply:
        if len(blob) > MAX_REPLY_BYTES:
            raise RemoteProtocolError(f"dial-back reply of {len(blob)} bytes")
        raw = _unpack_map(blob)
        reached, address = raw.get("reached"), raw.get("address")
        observed, tried = raw.get("observed"), raw.get("tried")
        if not isinstance(reached, bool) or not isinstance(tried, int) or isinstance(tried, bool):
            raise RemoteProtocolError("dial-back reply: reached/tried ill-typed")
        if not isinstance(address, str) or not isinstance(observed, str):
            raise RemoteProtocolError("dial-back reply: address/observed ill-typed")
        if len(address) > MAX_ADDR_CHARS or len(observed) > MAX_ADDR_CHARS:
            raise RemoteProtocolError("dial-back reply: address too long")
        return DialbackReply(reached, address, observed, tried)


def _unpack_map(blob: bytes) -> dict[str, Any]:
    try:
        raw = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for bad bytes
        raise RemoteProtocolError(f"undecodable dial-back message: {exc}") from exc
    if not isinstance(raw, dict):
        raise RemoteProtocolError("dial-back message is not a map")
    return raw


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """``(ip, port)`` of a ``/ip4|ip6/<ip>/tcp/<port>[/...]`` multiaddr, else None."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        port = int(parts[4])
    except ValueError:
        return None
    return (parts[2], port) if 0 < port < 65536 else None


def dialable(addrs: Iterable[str], observed_ip: str | None) -> list[tuple[str, str, int]]:
    """The ``(addr, ip, port)`` a member may dial back: TCP addresses at the observed IP.

    Dialling only the IP the request came from keeps a member from being used
    to dial third parties, and is what tells a NATed node apart: its announced
    private address is not the address its router shows the member.
    """
    if not observed_ip:
        return []
    out = []
    for addr in addrs:
        endpoint = tcp_endpoint(addr)
        if endpoint is not None and endpoint[0] == observed_ip:
            out.append((addr, *endpoint))
    return out[:MAX_DIALBACK_ADDRS]


def verdict(replies: Sequence[DialbackReply]) -> str:
    """``public`` if any member reached us, ``behind NAT`` if some answered and none did."""
    if any(r.reached for r in replies):
        return PUBLIC
    return BEHIND_NAT if replies else UNKNOWN


def to_wire(reach: str) -> str:
    if reach not in _WIRE:
        raise ValueError(f"unknown reachability {reach!r}")
    return _WIRE[reach]


def reach_of(record: Mapping[str, Any]) -> str:
    """A record's announced reachability (``unknown`` when absent or unreadable)."""
    value = _extra(record).get(EXTRA_KEY)
    return _FROM_WIRE.get(value, UNKNOWN) if isinstance(value, str) else UNKNOWN


def _extra(record: Mapping[str, Any]) -> Mapping[str, Any]:
    extra = record.get("extra")
    return extra if isinstance(extra, Mapping) else {}


def reach_text(record: Mapping[str, Any]) -> str:
    """A peer's reachability as ``hetmesh status`` shows it, with why where it matters."""
    reach, extra = reach_of(record), _extra(record)
    via = extra.get(VIA_KEY)
    if reach == PUBLIC and extra.get(RELAY_KEY) == 1:
        return "public, relays"
    if reach == BEHIND_NAT:
        if isinstance(via, str) and via:
            return f"behind NAT, via {via[-8:]}"
        return "behind NAT, no relay: unreachable from outside its network"
    return reach


def link_kind(
    src: str, src_record: Mapping[str, Any], dst: str, dst_record: Mapping[str, Any]
) -> str:
    """``hole-punched`` when either end announces a hole-punched data-plane link to the
    other, else ``relayed`` when either announces their connection runs through a
    relay, else ``direct``."""
    for peer, record in ((dst, src_record), (src, dst_record)):
        punched = _extra(record).get(PUNCHED_KEY)
        if isinstance(punched, list) and peer in punched:
            return "hole-punched"
    for peer, record in ((dst, src_record), (src, dst_record)):
        relayed = _extra(record).get(RELAYED_KEY)
        if isinstance(relayed, list) and peer in relayed:
            return "relayed"
    return "direct"


def advice(reach: str, members_reach: Iterable[str], listen_port: int | None) -> str | None:
    """The one line a node logs when members may never reach it, or None.

    Behind NAT with no public member: nobody can carry traffic to it.
    """
    if reach != BEHIND_NAT or PUBLIC in set(members_reach):
        return None
    port = f" (TCP {listen_port})" if listen_port else ""
    return (
        "this node is behind NAT (no member could dial it back) and no member of the mesh "
        "is publicly reachable, so members outside this network cannot reach it: "
        "--bootstrap a member with a public address, or forward this node's port"
        f"{port} on the router, or start a node with a public address to relay"
    )


def no_member_advice(bootstrap: Sequence[str]) -> str:
    """The one line a node that joined through ``bootstrap`` logs once it reaches no member."""
    return (
        f"this node reaches no member of the mesh (bootstrap: {', '.join(bootstrap[:3])}): "
        "check that those members run and share this node's mesh secret; from another "
        "network, --bootstrap a member with a public address (hetmesh status shows which "
        "members are public), or open a port on that member's router"
    )


__all__ = [
    "BEHIND_NAT",
    "DIALBACK_PROTOCOL",
    "EXTRA_KEY",
    "PUBLIC",
    "PUNCHED_KEY",
    "RELAYED_KEY",
    "RELAY_KEY",
    "UNKNOWN",
    "VIA_KEY",
    "DialbackReply",
    "DialbackRequest",
    "advice",
    "dialable",
    "link_kind",
    "no_member_advice",
    "reach_of",
    "reach_text",
    "tcp_endpoint",
    "to_wire",
    "verdict",
]
