"""The discovery service: membership, announcements, liveness and link probes.

One :class:`Discovery` per node wraps the node's libp2p host. Its
:meth:`Discovery.serve` runs, in one nursery:

- an announcement round about once a second: the local record is sent to
  every known peer on its own short stream (length-prefixed msgpack); a
  record doubles as the heartbeat, and it carries the addresses of the peers
  we see alive (peer exchange), so one bootstrap address teaches the whole mesh;
- a liveness clock that re-judges the :class:`~hetmesh.discovery.table.PeerTable`
  and hangs up on dead peers;
- mDNS (:mod:`hetmesh.discovery.mdns`, this mesh's fingerprint only) and bootstrap dialling;
- link probes to every alive peer, periodically and on membership change.

Everything the node publishes goes through the ``set_*`` methods; everything
it reads comes from :meth:`Discovery.members`, :meth:`Discovery.view` and
:meth:`Discovery.subscribe`. New RPCs register with :meth:`Discovery.add_handler`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from hetmesh import __version__
from hetmesh.discovery import rpc, wire
from hetmesh.discovery.addrs import addr_host, expand_listen_addrs
from hetmesh.discovery.host import dial, guarded_handler, mesh_fingerprint
from hetmesh.discovery.mdns import MdnsHandle, start_mdns, stop_mdns
from hetmesh.discovery.probe import LinkMeasurement, probe_link, serve_probe
from hetmesh.discovery.table import Health, LivenessPolicy, PeerEntry, PeerTable, TableEvent
from hetmesh.discovery.wire import Announcement, KnownPeer, Load
from hetmesh.errors import (
    AuthenticationFailed,
    ConnectTimeout,
    MeshError,
    PeerUnreachable,
    RemoteProtocolError,
)
from hetmesh.resources import DeviceProfile, LinkProfile, PeerId

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryConfig:
    bootstrap: tuple[str, ...] = ()
    mdns: bool = True
    mesh_secret: str | None = None
    policy: LivenessPolicy = field(default_factory=LivenessPolicy)
    dial_timeout_s: float = 3.0
    send_timeout_s: float = 2.0
    link_probe_interval_s: float = 60.0
    link_probe_bytes: int = 4 * 1024 * 1024
    link_probe_settle_s: float = 3.0  # the follow-up probe after a membership change
    link_probe_window: int = 3  # samples per link kept; the best is published
    dead_redial_every_s: float = 5.0
    require_bootstrap: bool = True  # fail start-up if no bootstrap peer answers


@dataclass(frozen=True, slots=True)
class DiscoveryStatistics:
    announcements_sent: int
    send_failures: int
    accepted: int
    rejected: int
    stale: int
    alive: int
    suspect: int
    joining: int
    dead_or_left: int
    link_probes: int


class Discovery:
    """Membership, announcements and liveness of one node (see the module doc)."""

    def __init__(self, host: Any, config: DiscoveryConfig, *, psk: str) -> None:
        self.host = host
        self.config = config
        self.psk = psk
        self.peer_id: PeerId = str(host.get_id())
        self.boot_id = time.time_ns()
        self.table = PeerTable(self.peer_id, config.policy)
        self.addrs: tuple[str, ...] = ()
        self.probe_port = 0
        self._seq = 0
        self._devices: tuple[DeviceProfile, ...] = ()
        self._links: dict[PeerId, LinkProfile] = {}
        self._data_plane: dict[str, Any] = {}
        self._stages: tuple[dict[str, Any], ...] = ()
        self._load = Load()
        self._extra: dict[str, Any] = {}
        self._subscribers: list[trio.MemorySendChannel[TableEvent]] = []
        self._candidates_send, self._candidates_recv = trio.open_memory_channel[
            tuple[PeerId, tuple[str, ...]]
        ](256)
        self._probe_wanted = trio.Event()
        self._last_dial: dict[PeerId, float] = {}
        self._inflight: set[PeerId] = set()
        self._said_goodbye = False
        self._probes_enabled = trio.Event()
        self._link_samples: dict[PeerId, list[LinkMeasurement]] = {}
        self._sent = 0
        self._send_failures = 0
        self._probes = 0

    # -- what the node publishes ----------------------------------------------

    def set_devices(self, devices: Sequence[DeviceProfile]) -> None:
        self._devices = tuple(devices)

    def set_data_plane(self, offer: dict[str, Any]) -> None:
        """The transport's data-plane offer (opaque to discovery)."""
        self._data_plane = dict(offer)

    def set_stages(self, stages: Sequence[dict[str, Any]]) -> None:
        """Stages this node serves, e.g. ``{"model": ..., "start": 0, "end": 8, "ready": True}``."""
        self._stages = tuple(dict(s) for s in stages)

    def set_load(self, load: Load) -> None:
        self._load = load

    @property
    def load(self) -> Load:
        return self._load

    def set_extra(self, key: str, value: Any) -> None:
        """Publish any other msgpack-able field (e.g. ``"plan"``) in the announcement."""
        self._extra[key] = value

    def add_handler(self, protocol: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        """Serve a new libp2p protocol; the handler is guarded (see host.guarded_handler)."""
        from libp2p.custom_types import TProtocol

        self.host.set_stream_handler(TProtocol(protocol), guarded_handler(protocol, handler))

    async def request(
        self,
        peer_id: PeerId,
        protocol: str,
        payload: bytes,
        *,
        max_reply_bytes: int = wire.MAX_STATUS_BYTES,
        timeout_s: float = 5.0,
    ) -> bytes:
        """One framed request/reply with a peer over ``protocol`` (dialling if needed).

        The handler on the other side (see :meth:`add_handler`) reads one frame
        with :func:`wire.read_frame` and answers with :func:`wire.write_frame`.
        The peer is dialled at its announced addresses first (``PeerUnreachable``,
        ``ConnectTimeout``, ``AuthenticationFailed``); the call itself is
        :func:`hetmesh.discovery.rpc.request`, whose module lists what it raises.
        """
        entry = self.table.entries.get(peer_id)
        info = self._peer_info(peer_id, entry.addrs if entry else ())
        if info.peer_id not in self.host.get_network().connections:
            await dial(self.host, info, timeout_s=min(timeout_s, self.config.dial_timeout_s))
        return await rpc.request(
            self.host,
            peer_id,
            protocol,
            payload,
            timeout_s=timeout_s,
            max_reply_bytes=max_reply_bytes,
        )

    # -- what the node reads --------------------------------------------------

    def members(self) -> list[PeerEntry]:
        """The live table (alive and suspect peers), sorted by peer id."""
        return self.table.members()

    def alive(self) -> list[PeerEntry]:
        return self.table.alive()

    def subscribe(self) -> trio.MemoryReceiveChannel[TableEvent]:
        """A channel of health changes (joins, suspicions, deaths, departures)."""
        send, recv = trio.open_memory_channel[TableEvent](1024)
        self._subscribers.append(send)
        return recv

    def local_record(self, *, goodbye: bool = False, advance: bool = True) -> Announcement:
        """This node's announcement; ``advance`` takes the next sequence number."""
        if advance:
            self._seq += 1
        known = tuple(
            KnownPeer(peer_id=e.peer_id, addrs=e.addrs) for e in self.table.alive() if e.addrs
        )
        return Announcement(
            version=__version__,
            peer_id=self.peer_id,
            boot_id=self.boot_id,
            seq=self._seq,
            addrs=self.addrs,
            devices=self._devices,
            links=tuple(self._links[k] for k in sorted(self._links)),
            data_plane=self._data_plane,
            stages=self._stages,
            load=self._load,
            known_peers=known,
            probe_port=self.probe_port,
            goodbye=goodbye,
            sent_at_s=time.time(),
            extra=dict(self._extra),
        )

    def view(self) -> dict[str, Any]:
        """The node's view of the mesh as a plain (msgpack-able) map."""
        now = trio.current_time()
        me = self.local_record(advance=False)  # a view is not an announcement
        peers = [
            {
                "peer_id": self.peer_id,
                "health": "self",
                "last_heard_s": 0.0,
                "record": me.to_wire(),
            }
        ]
        links = [link.to_wire() for link in me.links]
        for entry in sorted(self.table.entries.values(), key=lambda e: e.peer_id):
            if entry.record is None:
                continue
            peers.append(
                {
                    "peer_id": entry.peer_id,
                    "health": str(entry.health),
                    "last_heard_s": round(now - entry.last_heard, 3),
                    "record": entry.record.to_wire(),
                }
            )
            if entry.health in (Health.ALIVE, Health.SUSPECT):
                links += [link.to_wire() for link in entry.record.links]
        return {
            "self": self.peer_id,
            "version": __version__,
            "generated_at_s": time.time(),
            "peers": peers,
            "links": links,
            "statistics": self.statistics_dict(),
        }

    def statistics(self) -> DiscoveryStatistics:
        t = self.table.statistics()
        return DiscoveryStatistics(
            announcements_sent=self._sent,
            send_failures=self._send_failures,
            accepted=t.accepted,
            rejected=t.rejected,
            stale=t.stale,
            alive=t.alive,
            suspect=t.suspect,
            joining=t.joining,
            dead_or_left=t.dead_or_left,
            link_probes=self._probes,
        )

    def statistics_dict(self) -> dict[str, int]:
        s = self.statistics()
        return {name: getattr(s, name) for name in s.__slots__}

    # -- inbound ----------------------------------------------------------------

    def receive(
        self, payload: bytes, remote: PeerId, now: float | None = None
    ) -> Announcement | None:
        """Apply one announcement payload from an authenticated peer; None if rejected.

        Never raises for anything the peer sent: bad records are counted in
        ``statistics().rejected``.
        """
        now = trio.current_time() if now is None else now
        try:
            record = wire.decode_announcement(payload)
            if record.peer_id != remote:
                raise RemoteProtocolError(
                    f"announcement for {record.peer_id} arrived from {remote}"
                )
        except RemoteProtocolError as exc:
            self.table.note_rejected()
            log.debug("rejected an announcement from %s: %s", remote, exc)
            return None
        self._emit(self.table.note_announcement(record, now))
        for known in record.known_peers:
            self._offer_candidate(known.peer_id, known.addrs, now)
        return record

    async def _handle_announce(self, stream: Any) -> None:
        remote = str(stream.muxed_conn.peer_id)
        try:
            payload = await wire.read_frame(
                stream, max_bytes=wire.MAX_ANNOUNCEMENT_BYTES, timeout_s=5.0
            )
        except RemoteProtocolError:
            self.table.note_rejected()
            raise
        self.receive(payload, remote)

    async def _handle_status(self, stream: Any) -> None:
        await wire.write_frame(stream, wire.encode(self.view()))

    # -- outbound ---------------------------------------------------------------

    def _offer_candidate(
        self, peer_id: PeerId, addrs: tuple[str, ...], now: float | None = None
    ) -> None:
        if peer_id == self.peer_id or not addrs:
            return
        now = trio.current_time() if now is None else now
        if self.table.note_candidate(peer_id, addrs, now):
            with contextlib.suppress(trio.WouldBlock):
                self._candidates_send.send_nowait((peer_id, addrs))

    def _peer_info(self, peer_id: PeerId, addrs: Sequence[str]) -> Any:
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo
        from multiaddr import Multiaddr

        maddrs = [Multiaddr(a.split("/p2p/")[0]) for a in addrs]
        return PeerInfo(ID.from_base58(peer_id), maddrs)

    async def _send(self, peer_id: PeerId, addrs: Sequence[str], payload: bytes) -> None:
        """Send one record to one peer; failures only feed the liveness judgement."""
        from libp2p.custom_types import TProtocol

        info = self._peer_info(peer_id, addrs)
        self._inflight.add(peer_id)
        try:
            if info.peer_id not in self.host.get_network().connections:
                await dial(self.host, info, timeout_s=self.config.dial_timeout_s)
            with trio.fail_after(self.config.send_timeout_s):
                stream = await self.host.new_stream(
                    info.peer_id, [TProtocol(wire.ANNOUNCE_PROTOCOL)]
                )
                try:
                    await wire.write_frame(stream, payload)
                    await stream.close()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await stream.reset()
                    raise
            self._sent += 1
        except PeerUnreachable:
            self._send_failures += 1
            self._emit(self.table.note_refused(peer_id, trio.current_time()))
        except (AuthenticationFailed, ConnectTimeout, trio.TooSlowError):
            self._send_failures += 1
        except Exception as exc:  # libp2p errors: a dropped connection is a refusal
            self._send_failures += 1
            log.debug("announcing to %s failed: %r", peer_id, exc)
            if info.peer_id not in self.host.get_network().connections:
                self._emit(self.table.note_refused(peer_id, trio.current_time()))
        finally:
            self._inflight.discard(peer_id)

    def _targets(self, now: float) -> list[PeerEntry]:
        out = []
        for entry in self.table.dial_targets():
            if not entry.addrs:
                continue
            if entry.health is Health.DEAD or (
                entry.record is None and entry.health is Health.JOINING
            ):
                last = self._last_dial.get(entry.peer_id, -math.inf)
                if now - last < self.config.dead_redial_every_s:
                    continue
            self._last_dial[entry.peer_id] = now
            out.append(entry)
        return out

    async def _announce_round(self, nursery: trio.Nursery, *, goodbye: bool = False) -> None:
        """Start one send per target; a peer whose last send is still pending is skipped."""
        payload = wire.encode(self.local_record(goodbye=goodbye))
        if len(payload) > wire.MAX_ANNOUNCEMENT_BYTES:
            log.error(
                "our announcement is %d bytes, over the %d every peer accepts: not sent "
                "(publish less through set_extra/set_stages)",
                len(payload),
                wire.MAX_ANNOUNCEMENT_BYTES,
            )
            return
        now = trio.current_time()
        if goodbye:
            live = (Health.ALIVE, Health.SUSPECT, Health.JOINING)
            targets = [e for e in self.table.dial_targets() if e.health in live and e.record]
        else:
            targets = self._targets(now)
        for entry in targets:
            if entry.peer_id not in self._inflight:
                nursery.start_soon(self._send, entry.peer_id, entry.addrs, payload)

    def _emit(self, events: list[TableEvent]) -> None:
        for event in events:
            log.info("peer %s: %s -> %s", event.peer_id, event.old, event.new)
            if event.new is Health.ALIVE and event.old is not Health.SUSPECT:
                self._probe_wanted.set()
            if event.new in (Health.DEAD, Health.LEFT):
                self._links.pop(event.peer_id, None)
                self._link_samples.pop(event.peer_id, None)
            for send in list(self._subscribers):
                try:
                    send.send_nowait(event)
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    self._subscribers.remove(send)

    # -- services ------------------------------------------------------------------

    async def _serve_announcements(self) -> None:
        interval = self.config.policy.interval_s
        async with trio.open_nursery() as nursery:
            while True:
                await self._announce_round(nursery)
                await trio.sleep(interval)

    async def _serve_liveness(self) -> None:
        tick_s = 0.2
        last = trio.current_time()
        while True:
            now = trio.current_time()
            if now - last > max(2.0, self.config.policy.interval_s * 2):
                log.warning(
                    "this node stalled for %.1f s; restarting the liveness window", now - last
                )
                self.table.excuse_gap(now - last - tick_s)
            last = now
            events = self.table.tick(now)
            self._emit(events)
            for event in events:
                if event.new is Health.DEAD:
                    await self._hang_up(event.peer_id)
            await trio.sleep(tick_s)

    async def _hang_up(self, peer_id: PeerId) -> None:
        from libp2p.peer.id import ID

        with trio.move_on_after(1.0), contextlib.suppress(Exception):
            await self.host.disconnect(ID.from_base58(peer_id))

    async def _serve_candidates(self) -> None:
        async with trio.open_nursery() as nursery:
            async for peer_id, addrs in self._candidates_recv:
                if peer_id in self._inflight:
                    continue
                payload = wire.encode(self.local_record())
                self._last_dial[peer_id] = trio.current_time()
                nursery.start_soon(self._send, peer_id, addrs, payload)

    def enable_link_probes(self) -> None:
        """Start measuring links (the daemon calls this once its own benchmark is done,
        so the benchmark and the probes do not compete for the CPU)."""
        self._probes_enabled.set()

    async def _serve_links(self) -> None:
        """Probe every alive peer on membership change (twice: once at once, once
        after things settle) and every ``link_probe_interval_s``."""
        await self._probes_enabled.wait()
        follow_up = 0
        while True:
            wait_s = (
                self.config.link_probe_settle_s if follow_up else self.config.link_probe_interval_s
            )
            with trio.move_on_after(wait_s):
                await self._probe_wanted.wait()
                await trio.sleep(0.5)  # let a burst of joins settle
                follow_up = 2
            self._probe_wanted = trio.Event()
            follow_up = max(follow_up - 1, 0)
            for entry in self.table.alive():
                await self._probe_one(entry)

    async def _probe_one(self, entry: PeerEntry) -> None:
        record = entry.record
        if record is None or not record.probe_port:
            return
        hosts = [h for h in map(addr_host, record.addrs) if h]
        for host_ip in hosts[:2]:
            try:
                m = await probe_link(
                    host_ip, record.probe_port, self.psk, nbytes=self.config.link_probe_bytes
                )
            except (PeerUnreachable, RemoteProtocolError) as exc:
                log.debug("link probe to %s at %s failed: %s", entry.peer_id, host_ip, exc)
                continue
            self._probes += 1
            samples = self._link_samples.setdefault(entry.peer_id, [])
            samples.append(m)
            del samples[: -self.config.link_probe_window]
            # contention (CPU or other traffic) only ever lowers a sample: publish the
            # best of the recent ones as the link's capacity, and the lowest RTT
            self._links[entry.peer_id] = LinkProfile(
                src=self.peer_id,
                dst=entry.peer_id,
                rtt_s=min(x.rtt_s for x in samples),
                bandwidth_bps=max(x.bandwidth_bps for x in samples),
                measured_at_s=time.time(),
            )
            return

    async def _bootstrap(self) -> None:
        """Dial the bootstrap peers; raise if none of them answers."""
        from hetmesh.discovery.host import parse_peer_addr

        if not self.config.bootstrap:
            return
        failures: list[MeshError] = []
        log.info("joining the mesh through %d bootstrap peer(s)", len(self.config.bootstrap))
        for addr in self.config.bootstrap:
            info = parse_peer_addr(addr)
            try:
                await dial(self.host, info, timeout_s=self.config.dial_timeout_s)
            except MeshError as exc:
                log.warning("bootstrap peer %s: %s", addr, exc)
                failures.append(exc)
                continue
            self._offer_candidate(str(info.peer_id), (addr,))
        if len(failures) == len(self.config.bootstrap) and self.config.require_bootstrap:
            auth = [f for f in failures if isinstance(f, AuthenticationFailed)]
            raise (auth or failures)[0]

    def _start_mdns(self) -> MdnsHandle:
        token = trio.lowlevel.current_trio_token()

        def on_peer(peer_id: PeerId, addrs: tuple[str, ...]) -> None:  # a zeroconf thread
            if peer_id != self.peer_id:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._offer_candidate, peer_id, addrs)

        return start_mdns(self.host, self.addrs, mesh_fingerprint(self.config.mesh_secret), on_peer)

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run discovery until cancelled; a goodbye goes out on the way down."""
        self.add_handler(wire.ANNOUNCE_PROTOCOL, self._handle_announce)
        self.add_handler(wire.STATUS_PROTOCOL, self._handle_status)
        self.addrs = expand_listen_addrs(self.host.get_transport_addrs(), self.peer_id)
        probe_host = "0.0.0.0"
        mdns: MdnsHandle | None = None
        try:
            async with trio.open_nursery() as nursery:
                self.probe_port = await nursery.start(serve_probe, probe_host, self.psk)
                await self._bootstrap()
                if self.config.mdns:
                    mdns = self._start_mdns()
                nursery.start_soon(self._serve_candidates)
                nursery.start_soon(self._serve_announcements)
                nursery.start_soon(self._serve_liveness)
                nursery.start_soon(self._serve_links)
                task_status.started()
        finally:
            if not self._said_goodbye:  # cancelled from outside: best effort, bounded
                with trio.CancelScope(deadline=trio.current_time() + 1.0, shield=True):
                    await self.say_goodbye()
            if mdns is not None:
                stop_mdns(mdns)

    async def say_goodbye(self, grace_s: float = 1.5) -> None:
        """Tell every peer we are leaving (they drop us at once); call before cancelling.

        Must run while the host is still up, so the daemon calls it before it
        cancels its services.
        """
        self._said_goodbye = True
        self._inflight.clear()
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as nursery:
                await self._announce_round(nursery, goodbye=True)


__all__ = [
    "Discovery",
    "DiscoveryConfig",
    "DiscoveryStatistics",
]
