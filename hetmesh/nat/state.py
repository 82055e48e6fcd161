"""What one node knows of its NAT traversal, in one object the daemon hands around (pure).

- ``public_ip``: the IP members see this node from, once the dial-back says it
  is behind NAT (:mod:`hetmesh.nat.dialback` writes it); None: offer no punch
  candidate (public, or not known yet).
- the hole-punched data-plane links the node holds (the data plane notes each
  one it opens; :mod:`hetmesh.nat.relay` announces their peers, and probes
  those links over a punched path of their own).

One :class:`NatState` per node (:class:`hetmesh.node.runtime.Node` holds it):
two nodes in one process (the in-process tests) never share what either
learned. No I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Callable

from hetmesh.resources import PeerId


class NatState:
    """A node's public IP (as members see it) and its open hole-punched links."""

    def __init__(self, public_ip: str | None = None) -> None:
        self._public_ip = public_ip or None
        # the hole-punched links this node holds: (peer id, "is it still open?")
        self._punched: list[tuple[PeerId, Callable[[], bool]]] = []

    @property
    def public_ip(self) -> str | None:
        """The public IP members see this node from (None: none to offer a punch from)."""
        return self._public_ip

    def set_public_ip(self, ip: str | None) -> None:
        """Record the public IP members see this node from (None: behind no NAT / unknown)."""
        self._public_ip = ip or None

    def note_punched(self, peer_id: PeerId, is_open: Callable[[], bool]) -> None:
        """Remember a hole-punched link to ``peer_id`` while ``is_open()`` (for status)."""
        self._punched.append((peer_id, is_open))

    def punched_peers(self) -> list[PeerId]:
        """The peers this node holds an open hole-punched data-plane link to, sorted."""
        self._punched[:] = [(peer, is_open) for peer, is_open in self._punched if is_open()]
        return sorted({peer for peer, _ in self._punched})


__all__ = ["NatState"]
