"""Hole punching for the data plane: the pure parts (candidates, when, attempt schedule).

Two members behind different NAT routers meet over a relayed libp2p
connection. To move tensors without the relay hop, each side offers a
*punch candidate* in its data-plane :class:`~hetmesh.transport.frames.Offer`
(``endpoints["punch"] = "public-ip:port"``): the public IP a member saw it
from (the dial-back's observation) and the local port it has bound for the
attempt. A router that keeps the source port (a cone NAT; Linux masquerade
does so while the port is free) maps that port to the same public port, so
the two sides' simultaneous TCP opens from those ports meet in the middle.
A symmetric router picks a fresh port per destination: the candidate is then
wrong, the attempts fail, and the link stays on the relayed stream.

Pure: no trio, no libp2p, no sockets. :mod:`hetmesh.nat.punch` does the I/O.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

PUNCH_KEY: Final = "punch"  # the Offer endpoint that carries a punch candidate


@dataclass(frozen=True, slots=True)
class Candidate:
    """Where a peer expects its punched connection to come from / go to."""

    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}"


def parse_candidate(text: str) -> Candidate | None:
    """``"a.b.c.d:port"`` as a :class:`Candidate`; None for anything else.

    Input comes from a peer's offer: malformed, loopback, unspecified or
    multicast addresses and out-of-range ports are refused (None), never raised.
    """
    if not isinstance(text, str) or len(text) > 64:
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        return None
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    port = int(port_text)
    if not 0 < port < 65536:
        return None
    if address.is_loopback or address.is_unspecified or address.is_multicast:
        return None
    return Candidate(str(address), port)


def candidate_of(endpoints: tuple[tuple[str, str], ...]) -> Candidate | None:
    """The punch candidate among an offer's endpoints, if any (and well formed)."""
    for key, value in endpoints:
        if key == PUNCH_KEY:
            return parse_candidate(value)
    return None


def punch_pair(
    relayed: bool,
    backend: str,
    mine: tuple[tuple[str, str], ...],
    theirs: tuple[tuple[str, str], ...],
) -> tuple[Candidate, Candidate] | None:
    """``(ours, theirs)`` when this link should be hole-punched, else None.

    Only over a relayed control connection (a direct one needs no punching),
    only for a backend that is a plain TCP link, and only when both sides
    offered a candidate. Both ends evaluate this on the same two offers and
    so agree on whether to try.
    """
    if not relayed or backend != "tcp":
        return None
    ours, other = candidate_of(mine), candidate_of(theirs)
    if ours is None or other is None or ours == other:
        return None
    return ours, other


@dataclass(frozen=True, slots=True)
class AttemptSchedule:
    """A few synchronised connect attempts from the same local port.

    Both sides start when the offers have crossed (one relay hop apart). The
    first SYNs usually die at the other router (no mapping there yet); the
    kernel's retransmit one second later then meets an open mapping, so each
    attempt waits ``timeout_s`` (two retransmits) before the next begins at
    ``i * timeout_s``. A symmetric router never lets one through: after
    ``attempts`` the side gives up and the link stays relayed.
    """

    attempts: int = 3
    timeout_s: float = 3.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.timeout_s <= 0:
            raise ValueError(f"a punch needs ≥ 1 attempt and a positive timeout: {self}")

    def starts(self) -> tuple[float, ...]:
        """Offsets (seconds from the start) at which each attempt begins."""
        return tuple(i * self.timeout_s for i in range(self.attempts))

    @property
    def total_s(self) -> float:
        """How long a failing punch takes at most."""
        return self.attempts * self.timeout_s


DEFAULT_SCHEDULE: Final = AttemptSchedule()


__all__ = [
    "DEFAULT_SCHEDULE",
    "PUNCH_KEY",
    "AttemptSchedule",
    "Candidate",
    "candidate_of",
    "parse_candidate",
    "punch_pair",
]
