"""Admission of unauthenticated connections: a cap in total and per source address.

Pure bookkeeping (no trio, no sockets): a listener asks :meth:`ConnectionGate.admit`
when it accepts a connection and calls :meth:`ConnectionGate.release` once that
connection has authenticated or gone. A connection refused here is closed at
once, before a byte of it is read, so a stranger holding many silent
connections costs the node a bounded number of sockets and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetmesh.errors import LocalProtocolError


@dataclass(frozen=True, slots=True, kw_only=True)
class GateStatistics:
    pending: int  # admitted connections not yet authenticated
    admitted: int
    refused: int


class ConnectionGate:
    """At most ``max_total`` pending connections, ``max_per_address`` from any one address."""

    def __init__(self, max_total: int, max_per_address: int) -> None:
        if max_total < 1 or max_per_address < 1:
            raise LocalProtocolError("connection caps must be at least 1")
        self.max_total = max_total
        self.max_per_address = max_per_address
        self._pending: dict[str, int] = {}
        self._total = 0
        self._admitted = 0
        self._refused = 0

    def admit(self, address: str) -> bool:
        """Take a slot for a connection from ``address``; False (counted) when full."""
        held = self._pending.get(address, 0)
        if self._total >= self.max_total or held >= self.max_per_address:
            self._refused += 1
            return False
        self._pending[address] = held + 1
        self._total += 1
        self._admitted += 1
        return True

    def release(self, address: str) -> None:
        """Give back the slot :meth:`admit` took (once per admitted connection)."""
        held = self._pending.get(address, 0)
        if held <= 0:
            raise LocalProtocolError(f"no pending connection from {address!r} to release")
        if held == 1:
            del self._pending[address]  # the map stays as small as what is pending
        else:
            self._pending[address] = held - 1
        self._total -= 1

    def statistics(self) -> GateStatistics:
        return GateStatistics(pending=self._total, admitted=self._admitted, refused=self._refused)


__all__ = ["ConnectionGate", "GateStatistics"]
