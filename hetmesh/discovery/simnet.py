"""A virtual network for the membership protocol: virtual time, loss, crashes, freezes.

The same :class:`~hetmesh.discovery.membership.Membership` code the node runs,
driven by a discrete-event loop instead of trio and libp2p: messages arrive
after a random latency, a fraction is lost, a *crashed* node refuses
connections (the sender hears so, as a refused dial), a *frozen* one swallows
everything and stops ticking, and a *stalled* one (a starved event loop) runs
nothing for a while and then, as trio would, fires its overdue timer before it
reads what queued up meanwhile. Used by the unit tests and ``bench/scale.py``.
Pure: no trio, no sockets, one explicit ``random.Random``.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hetmesh.discovery.membership import Membership, Message, SwimPolicy, converged_view
from hetmesh.discovery.membership_wire import encode_message
from hetmesh.discovery.table import TableEvent
from hetmesh.discovery.wire import Announcement
from hetmesh.resources import PeerId


@dataclass(slots=True)
class NetStats:
    messages: int = 0
    bytes: int = 0
    lost: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One health change seen by one node at one virtual time."""

    at_s: float
    observer: PeerId
    event: TableEvent


class SimNet:
    """Virtual nodes exchanging real protocol messages (see the module doc)."""

    def __init__(
        self,
        *,
        policy: SwimPolicy | None = None,
        seed: int = 0,
        loss: float = 0.0,
        latency_s: tuple[float, float] = (0.001, 0.005),
        tick_s: float = 0.2,
        measure_bytes: bool = True,
    ) -> None:
        policy = policy or SwimPolicy()
        if policy.tick_s is None:  # we keep the cadence: let the nodes notice a late tick
            policy = replace(policy, tick_s=tick_s)
        self.policy = policy
        self.rng = random.Random(seed)
        self.loss = loss
        self.latency_s = latency_s
        self.tick_s = tick_s
        self.measure_bytes = measure_bytes
        self.now = 0.0
        self.nodes: dict[PeerId, Membership] = {}
        self.crashed: set[PeerId] = set()
        self.frozen: set[PeerId] = set()
        self.stats = NetStats()
        self.verdicts: list[Verdict] = []
        self.on_verdict: Callable[[Verdict], None] | None = None
        self._queue: list[tuple[float, int, int, object]] = []
        self._n = 0
        self._boot = 1
        self._frozen_at: dict[PeerId, float] = {}
        self._stalled_until: dict[PeerId, float] = {}

    # -- building ------------------------------------------------------------------

    def add_node(self, peer_id: PeerId, *, introduce_to: PeerId | None = None) -> Membership:
        """Start a node; ``introduce_to`` plays the bootstrap address."""
        self._boot += 1
        node = Membership(
            peer_id,
            boot_id=self._boot,
            addrs=(f"/sim/{peer_id}",),
            policy=self.policy,
            rng=random.Random(self.rng.random()),
        )
        node.set_record(_record(peer_id, self._boot, 1), self.now)
        self.nodes[peer_id] = node
        self._schedule(self.now + self.rng.uniform(0, self.tick_s), 1, peer_id)
        if introduce_to is not None:
            node.note_candidate(introduce_to, (f"/sim/{introduce_to}",), self.now)
            self._send_all(node.introduce(introduce_to, self.now))
        return node

    def prefill(self, ids: list[PeerId]) -> None:
        """Make every node know every one of ``ids`` as alive with its record (a converged mesh).

        Equivalent to a long-finished join phase, without simulating it: large
        meshes start from here. The nodes share one member table copy-on-write
        (:meth:`Membership.adopt_view`), so 10,000 of them fit in a few GB.
        """
        records = [self.nodes[p].record for p in ids]
        view = converged_view((r for r in records if r is not None), self.now)
        for node in self.nodes.values():
            node.adopt_view(view)

    # -- faults --------------------------------------------------------------------

    def crash(self, peer_id: PeerId) -> None:
        self.crashed.add(peer_id)

    def freeze(self, peer_id: PeerId) -> None:
        self.frozen.add(peer_id)
        self._frozen_at[peer_id] = self.now

    def stall(self, peer_id: PeerId, duration_s: float) -> None:
        """Starve ``peer_id``'s event loop for ``duration_s`` from now.

        Nothing it should have done meanwhile is lost: its next tick comes late,
        then it reads the messages that queued up (in their order).
        """
        until = self.now + duration_s
        self._stalled_until[peer_id] = max(self._stalled_until.get(peer_id, 0.0), until)

    def _stalled(self, peer_id: PeerId) -> float | None:
        until = self._stalled_until.get(peer_id)
        if until is None or until <= self.now:
            self._stalled_until.pop(peer_id, None)
            return None
        return until

    def thaw(self, peer_id: PeerId) -> None:
        """Resume a frozen node; like the service, it notices its own stall."""
        self.frozen.discard(peer_id)
        self.nodes[peer_id].excuse_gap(self.now - self._frozen_at.pop(peer_id, self.now))

    # -- running -------------------------------------------------------------------

    def run_until(self, t_s: float) -> None:
        while self._queue and self._queue[0][0] <= t_s:
            at, _, what, payload = heapq.heappop(self._queue)
            self.now = at
            if what == 1:  # a node's tick
                assert isinstance(payload, str)
                self._tick(payload)
            elif what == 2:  # a message arrives
                assert isinstance(payload, Message)
                self._deliver(payload)
            else:  # a refused dial comes back to its sender
                assert isinstance(payload, Message)
                node = self.nodes.get(payload.src)
                if (until := self._stalled(payload.src)) is not None:
                    self._schedule(until + 1e-6, 3, payload)
                elif node is not None and payload.src not in self.crashed | self.frozen:
                    self._send_all(node.note_unreachable(payload.dst, self.now))
                    self._collect(node)
        self.now = t_s

    def _tick(self, peer_id: PeerId) -> None:
        if peer_id in self.crashed:
            return
        if (until := self._stalled(peer_id)) is not None:
            self._schedule(until, 1, peer_id)  # one late tick when it wakes
            return
        self._schedule(self.now + self.tick_s, 1, peer_id)
        if peer_id in self.frozen:
            return
        node = self.nodes[peer_id]
        self._send_all(node.tick(self.now))
        self._collect(node)

    def _deliver(self, msg: Message) -> None:
        if msg.dst in self.frozen or msg.dst not in self.nodes:
            return
        if (until := self._stalled(msg.dst)) is not None:
            self._schedule(until + 1e-6, 2, msg)  # read after the overdue tick
            return
        node = self.nodes[msg.dst]
        self._send_all(node.receive(msg, self.now))
        self._collect(node)

    def _send_all(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self.stats.messages += 1
            self.stats.by_kind[msg.kind.name] += 1
            if self.measure_bytes:
                self.stats.bytes += len(encode_message(msg))
            delay = self.rng.uniform(*self.latency_s)
            if msg.dst in self.crashed:
                self._schedule(self.now + delay, 3, msg)  # connection refused
            elif self.rng.random() < self.loss:
                self.stats.lost += 1
            else:
                self._schedule(self.now + delay, 2, msg)

    def _collect(self, node: Membership) -> None:
        for event in node.drain_events():
            verdict = Verdict(self.now, node.self_id, event)
            self.verdicts.append(verdict)
            if self.on_verdict is not None:
                self.on_verdict(verdict)

    def _schedule(self, at: float, what: int, payload: object) -> None:
        self._n += 1
        heapq.heappush(self._queue, (at, self._n, what, payload))

    # -- reading ---------------------------------------------------------------------

    def health(self, observer: PeerId, peer_id: PeerId) -> str | None:
        h = self.nodes[observer].health_of(peer_id)
        return None if h is None else str(h)


def _record(peer_id: PeerId, boot_id: int, seq: int) -> Announcement:
    return Announcement(
        version="sim",
        peer_id=peer_id,
        boot_id=boot_id,
        seq=seq,
        addrs=(f"/ip4/10.0.0.1/tcp/4001/p2p/{peer_id}",),
    )


__all__ = ["NetStats", "SimNet", "Verdict"]
