"""Relays: a public member carries members behind NAT; their links ride through it.

Why our own: py-libp2p 0.8's circuit relay v2 did not carry a connection
here — its listener's stop handler calls a method ``NetStream`` lacks (and a
handler that raises takes the host down), and its stop side never answers
the relay, so the source's dial fails. What we need is small, so it is ours.

The shape (all on the mesh's libp2p hosts, so only members, who hold the
mesh secret, can open any of these streams):

- **reserve**: a member behind NAT asks a public member offering relay
  slots (``extra["relay"]``) for one over :data:`RELAY_PROTOCOL`, renews it
  at half its TTL, and announces the relay's peer id in ``extra["via"]``;
- **connect**: a member that cannot dial it directly opens a stream to the
  relay asking for a circuit to it; the relay opens a :data:`STOP_PROTOCOL`
  stream to it over the connection the reservation keeps open, both answer
  ``ok``, and the relay splices the two streams (each member's bytes paced to
  :attr:`RelayLimits.bandwidth_bps`, :mod:`hetmesh.nat.relay_limits`);
- both ends then run the ordinary libp2p upgrade over the circuit (private
  network key, noise authenticating the far peer's id end to end, yamux), so
  the result is a connection like any other and every existing protocol —
  membership, RPCs, the ``libp2p`` data-plane backend — works over it.

:func:`hetmesh.discovery.host.dial` tries :meth:`RelayClient.dial_via_relay`
when a direct dial fails (``set_dial_fallback``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import trio

from hetmesh.discovery import wire
from hetmesh.discovery.host import dial, guarded_handler, set_dial_fallback
from hetmesh.errors import MeshError, PeerUnreachable, RemoteProtocolError
from hetmesh.nat.link_probe import LinkProber
from hetmesh.nat.punch_control import PUNCH_CONTROL_PROTOCOL, ControlPuncher
from hetmesh.nat.reachability import (
    BEHIND_NAT,
    PUBLIC,
    PUNCHED_KEY,
    RELAY_KEY,
    RELAYED_KEY,
    VIA_KEY,
    reach_of,
)
from hetmesh.nat.relay_limits import RelayBook, RelayLimits
from hetmesh.nat.state import NatState

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    from hetmesh.discovery.service import Discovery
    from hetmesh.nat.dialback import Reachability

log = logging.getLogger(__name__)

RELAY_PROTOCOL = "/hetmesh/relay/1.0.0"
STOP_PROTOCOL = "/hetmesh/relay-stop/1.0.0"
MAX_RELAYED_ANNOUNCED = 64
MAX_CONTROL_BYTES = 1024
CHUNK = 256 * 1024
PEER_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class RelayStatistics:
    offering: bool
    reservations: int
    circuits_open: int
    circuits_refused: int
    bytes_relayed: int
    via: str  # the relay we hold a slot on ("" when none)
    relayed_dials: int  # connections we opened through a relay
    control_punched: int  # members whose control connection we moved onto a punched path
    control_punch_failures: int  # punches of a control connection that failed (we asked)


def _pack(**fields: Any) -> bytes:
    blob: bytes = msgpack.packb(fields)
    return blob


def _unpack(blob: bytes) -> dict[str, Any]:
    try:
        raw = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:
        raise RemoteProtocolError(f"undecodable relay message: {exc}") from exc
    if not isinstance(raw, dict):
        raise RemoteProtocolError("relay message is not a map")
    return raw


def _peer_field(raw: dict[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= PEER_ID_CHARS:
        raise RemoteProtocolError(f"relay message: {key} must be a peer id")
    return value


def record_extra(discovery: Discovery, peer_id: str) -> dict[str, Any]:
    entry = discovery.table.entries.get(peer_id)
    if entry is None or entry.record is None:
        return {}
    return dict(entry.record.extra)


def _raw_connection(stream: Any, *, initiator: bool) -> Any:
    """A libp2p raw connection over ``stream`` (the spliced circuit)."""
    from libp2p.connection_types import ConnectionType
    from libp2p.network.connection.raw_connection import RawConnection

    return RawConnection(stream, initiator=initiator, connection_type=ConnectionType.RELAYED)


class RelayClient:
    """Relay slots offered (when public and enabled) and taken (when behind NAT)."""

    def __init__(
        self,
        discovery: Discovery,
        reachability: Reachability,
        *,
        offer: bool = True,
        limits: RelayLimits | None = None,
        check_every_s: float = 3.0,
        nat: NatState | None = None,
    ) -> None:
        """``nat``: the node's traversal state, the one its dial-back fills and its data
        plane notes punched links in (None: a state of its own)."""
        self.discovery = discovery
        self.nat = nat if nat is not None else NatState()
        self.reachability = reachability
        self.offer = offer
        self.book = RelayBook(limits or RelayLimits())
        self.check_every_s = check_every_s
        self.via = ""  # the relay we hold a slot on
        self._renew_at = 0.0
        self._bytes = 0
        self._relayed_dials = 0
        self._offering = False
        # peers our connection to runs through a relay -> when it was made
        self._relayed: dict[str, float] = {}
        self._punched_seen: set[str] = set()  # punched peers at the last publication
        # moves relayed control connections onto hole-punched ones where the NATs allow
        self.control = ControlPuncher(discovery, self.nat)
        # links no TCP probe reaches (a member behind NAT): over libp2p or a punched path
        self.prober = LinkProber(discovery, self.nat)

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            offering=self._offering,
            reservations=len(self.book.reservations),
            circuits_open=self.book.open_circuits,
            circuits_refused=self.book.refused,
            bytes_relayed=self._bytes,
            via=self.via,
            relayed_dials=self._relayed_dials,
            control_punched=sum(self.control.is_direct(p) for p in list(self.control.direct)),
            control_punch_failures=self.control.failures,
        )

    # -- the relay's side ---------------------------------------------------------

    async def _handle_hop(self, stream: Any) -> None:
        remote = str(stream.muxed_conn.peer_id)
        request = _unpack(await wire.read_frame(stream, max_bytes=MAX_CONTROL_BYTES, timeout_s=5.0))
        op = request.get("op")
        if not self._offering:
            await wire.write_frame(stream, _pack(ok=False, reason="this node offers no relay"))
            return
        now = trio.current_time()
        if op == "reserve":
            reason = self.book.reserve(remote, now)
            ttl = self.book.limits.reservation_ttl_s
            await wire.write_frame(stream, _pack(ok=reason is None, reason=reason or "", ttl_s=ttl))
            return
        if op != "connect":
            raise RemoteProtocolError(f"relay: unknown op {op!r}")
        target = _peer_field(request, "to")
        reason = self.book.open(remote, target, now)
        if reason is not None:
            await wire.write_frame(stream, _pack(ok=False, reason=reason))
            return
        try:
            await self._splice(stream, remote, target)
        finally:
            self.book.close(remote, target)

    async def _splice(self, stream: Any, remote: str, target: str) -> None:
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        try:
            with trio.fail_after(5.0):
                stop = await self.discovery.host.new_stream(
                    ID.from_base58(target), [TProtocol(STOP_PROTOCOL)]
                )
                await wire.write_frame(stop, _pack(source=remote))
                answer = _unpack(
                    await wire.read_frame(stop, max_bytes=MAX_CONTROL_BYTES, timeout_s=5.0)
                )
        except (trio.TooSlowError, MeshError, Exception) as exc:
            log.debug("relay: no stop stream to %s", target, exc_info=True)
            await wire.write_frame(stream, _pack(ok=False, reason=f"destination: {exc}"))
            return
        if answer.get("ok") is not True:
            await wire.write_frame(stream, _pack(ok=False, reason="the destination refused"))
            with contextlib.suppress(Exception):
                await stop.reset()
            return
        await wire.write_frame(stream, _pack(ok=True))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, stream, stop, remote, nursery.cancel_scope)
                nursery.start_soon(self._pump, stop, stream, target, nursery.cancel_scope)
        finally:
            for s in (stream, stop):
                with contextlib.suppress(Exception):
                    await s.reset()

    async def _pump(self, src: Any, dst: Any, sender: str, scope: trio.CancelScope) -> None:
        """Copy ``src`` to ``dst``, pacing ``sender``'s bytes; either end closing ends both."""
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                wait = self.book.charge(sender, len(data), trio.current_time())
                if wait > 0:
                    await trio.sleep(wait)
                await dst.write(data)
                self._bytes += len(data)
        except Exception:
            log.debug("relay circuit from %s ended", sender, exc_info=True)
        finally:
            scope.cancel()

    # -- the side behind NAT --------------------------------------------------------

    async def _handle_stop(self, stream: Any) -> None:
        relay = str(stream.muxed_conn.peer_id)
        request = _unpack(await wire.read_frame(stream, max_bytes=MAX_CONTROL_BYTES, timeout_s=5.0))
        source = _peer_field(request, "source")
        if relay != self.via:
            await wire.write_frame(stream, _pack(ok=False))
            return
        await wire.write_frame(stream, _pack(ok=True))
        from multiaddr import Multiaddr

        log.debug("relayed connection from %s via %s", source, relay)
        raw = _raw_connection(stream, initiator=False)
        self._relayed[source] = trio.current_time()
        # upgrades (psk, noise, yamux), adds the connection and serves it until it closes
        await self.discovery.host.get_network()._handle_inbound_connection(
            raw, Multiaddr(f"/p2p/{relay}/p2p-circuit")
        )

    async def _reserve(self, relay: str) -> bool:
        try:
            reply = _unpack(
                await self.discovery.request(
                    relay,
                    RELAY_PROTOCOL,
                    _pack(op="reserve"),
                    max_reply_bytes=MAX_CONTROL_BYTES,
                    timeout_s=5.0,
                )
            )
        except (MeshError, trio.TooSlowError):
            log.debug("relay reservation with %s failed", relay, exc_info=True)
            return False
        if reply.get("ok") is not True:
            log.info("relay %s refused a slot: %s", relay, reply.get("reason"))
            return False
        ttl = reply.get("ttl_s")
        ttl_s = float(ttl) if isinstance(ttl, int | float) and ttl > 0 else 60.0
        self._renew_at = trio.current_time() + min(ttl_s / 2, 120.0)
        return True

    def _relays(self) -> list[str]:
        """Alive members offering relay slots, the current one first."""
        me = self.discovery.peer_id
        offering = [
            e.peer_id
            for e in self.discovery.alive()
            if e.peer_id != me
            and e.record is not None
            and e.record.extra.get(RELAY_KEY) == 1
            and reach_of({"extra": e.record.extra}) == PUBLIC
        ]
        return sorted(offering, key=lambda p: (p != self.via, p))

    async def _keep_slot(self) -> None:
        """Hold a slot on a relay while behind NAT; announce it (``extra["via"]``)."""
        if self.reachability.reach != BEHIND_NAT:
            if self.via:
                log.info("reachable directly again: giving up the relay slot on %s", self.via)
            self._set_via("")
            return
        alive = {e.peer_id for e in self.discovery.alive()}
        if self.via and self.via in alive and trio.current_time() < self._renew_at:
            return
        for relay in self._relays():
            if await self._reserve(relay):
                if relay != self.via:
                    log.info("behind NAT: reachable through relay %s", relay)
                self._set_via(relay)
                return
        self._set_via("")

    def _set_via(self, relay: str) -> None:
        self.via = relay
        self.discovery.set_extra(VIA_KEY, relay)

    def _publish_relayed(self) -> None:
        """Announce the members we reach through a relay (for status and the planner)."""
        connected = {str(p) for p in self.discovery.host.get_network().connections}
        now = trio.current_time()
        for peer, since in list(self._relayed.items()):
            # a closed circuit's connection is gone from the swarm (a new one is given
            # a few seconds to finish its upgrade)
            if peer not in connected and now - since > 10.0:
                del self._relayed[peer]
            elif self.control.is_direct(peer):
                del self._relayed[peer]  # the connection now runs over a punched path
        relayed = sorted(self._relayed)[:MAX_RELAYED_ANNOUNCED]
        self.discovery.set_extra(RELAYED_KEY, relayed)
        # whose relayed connection carries a hole-punched data plane beside it
        punched = self.nat.punched_peers()[:MAX_RELAYED_ANNOUNCED]
        self.discovery.set_extra(PUNCHED_KEY, punched)
        if set(punched) - self._punched_seen:
            # a link just moved onto a punched path: measure it now rather than at the
            # next periodic probe (discovery's membership-change trigger; no public hook)
            wanted = getattr(self.discovery, "_probe_wanted", None)
            if wanted is not None:
                wanted.set()
        self._punched_seen = set(punched)

    async def dial_via_relay(self, peer_info: Any, timeout_s: float) -> bool:
        """Connect to a member through the relay it announces; False if it has none."""
        from libp2p.custom_types import TProtocol
        from libp2p.security.pnet.protector import new_protected_conn

        peer_id = str(peer_info.peer_id)
        relay = record_extra(self.discovery, peer_id).get(VIA_KEY)
        if not isinstance(relay, str) or not relay or relay in (peer_id, self.discovery.peer_id):
            return False
        host = self.discovery.host
        entry = self.discovery.table.entries.get(relay)
        info = self.discovery._peer_info(relay, entry.addrs if entry else ())
        with trio.fail_after(max(timeout_s, 5.0)):
            if info.peer_id not in host.get_network().connections:
                await dial(host, info, timeout_s=timeout_s)
            stream = await host.new_stream(info.peer_id, [TProtocol(RELAY_PROTOCOL)])
            await wire.write_frame(stream, _pack(op="connect", to=peer_id))
            reply = _unpack(
                await wire.read_frame(stream, max_bytes=MAX_CONTROL_BYTES, timeout_s=timeout_s)
            )
            if reply.get("ok") is not True:
                with contextlib.suppress(Exception):
                    await stream.reset()
                raise PeerUnreachable(f"relay {relay} refused a circuit: {reply.get('reason')}")
            network = host.get_network()
            raw = _raw_connection(stream, initiator=True)
            if network.psk is not None:
                raw = new_protected_conn(raw, network.psk)
            await network.upgrade_outbound_raw_conn(raw, peer_info.peer_id)
        self._relayed_dials += 1
        self._relayed[peer_id] = trio.current_time()
        log.debug("connected to %s through relay %s", peer_id, relay)
        return True

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve relay requests (when offering) and keep our own slot; never returns."""
        from libp2p.custom_types import TProtocol

        host = self.discovery.host
        host.set_stream_handler(
            TProtocol(RELAY_PROTOCOL), guarded_handler(RELAY_PROTOCOL, self._handle_hop)
        )
        host.set_stream_handler(
            TProtocol(STOP_PROTOCOL), guarded_handler(STOP_PROTOCOL, self._handle_stop)
        )
        set_dial_fallback(host, self.dial_via_relay)
        # links no TCP probe reaches (a member behind NAT) are measured over libp2p
        for protocol, handler in self.prober.handlers().items():
            host.set_stream_handler(TProtocol(protocol), guarded_handler(protocol, handler))
        self.discovery.link_prober = self.prober.probe
        async with trio.open_nursery() as nursery:
            # punched control connections are upgraded and held in this nursery
            host.set_stream_handler(
                TProtocol(PUNCH_CONTROL_PROTOCOL),
                guarded_handler(PUNCH_CONTROL_PROTOCOL, self.control.handler(nursery)),
            )
            task_status.started()
            while True:
                offering = self.offer and self.reachability.reach == PUBLIC
                if offering != self._offering:
                    log.info("relay slots %s", "offered" if offering else "withdrawn")
                self._offering = offering
                self.discovery.set_extra(RELAY_KEY, 1 if offering else 0)
                await self._keep_slot()
                self._publish_relayed()
                for peer in self.control.wanted(self._relayed, trio.current_time()):
                    nursery.start_soon(self.control.upgrade, peer)
                await trio.sleep(self.check_every_s)


__all__ = [
    "RELAYED_KEY",
    "RELAY_KEY",
    "RELAY_PROTOCOL",
    "STOP_PROTOCOL",
    "VIA_KEY",
    "RelayClient",
    "RelayStatistics",
]
