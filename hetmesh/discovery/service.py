"""The discovery service: membership, announcements, liveness and link probes.

One :class:`Discovery` per node wraps the node's libp2p host and runs the
sans-IO membership core (:mod:`hetmesh.discovery.membership`, the same code
the simulator in ``bench/scale.py`` runs). Its :meth:`Discovery.serve` runs,
in one nursery:

- the membership clock (every 0.2 s): probes to ~log N members a second with
  indirect probes, suspicion and death by dissemination; our record is
  re-versioned when its content changes (its load part and its counters,
  :meth:`Discovery.set_counters`, at most every ``load_publish_every_s``) and
  pulled whole, signed by us, by whoever hears of the new version
  (:mod:`hetmesh.discovery.signing`);
- one long-lived stream per peer for membership messages
  (:mod:`hetmesh.discovery.outbox`), and their handler;
- mDNS (:mod:`hetmesh.discovery.mdns`, this mesh's fingerprint only) and
  bootstrap dialling; peer exchange rides on the membership messages, bounded;
- link probes to a bounded neighbour sample plus the peers asked for
  (:meth:`Discovery.want_links`), on membership change and periodically.

Everything the node publishes goes through the ``set_*`` methods; everything
it reads comes from :meth:`Discovery.members`, :meth:`Discovery.view` and
:meth:`Discovery.subscribe`. New RPCs register with :meth:`Discovery.add_handler`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import trio

from hetmesh import __version__
from hetmesh.discovery import rpc, wire
from hetmesh.discovery.addrs import addr_host, expand_listen_addrs
from hetmesh.discovery.host import dial, guarded_handler, mesh_fingerprint
from hetmesh.discovery.mdns import MdnsHandle, start_mdns, stop_mdns
from hetmesh.discovery.membership import Kind, Membership, Message, SwimPolicy
from hetmesh.discovery.membership_wire import (
    MAX_MESSAGE_BYTES,
    MEMBERSHIP_PROTOCOL,
    decode_message,
    encode_message,
)
from hetmesh.discovery.outbox import Outbox
from hetmesh.discovery.probe import LinkMeasurement, probe_link, serve_probe
from hetmesh.discovery.signing import check_own, open_record, sign_record
from hetmesh.discovery.table import Health, LivenessPolicy, PeerEntry, TableEvent
from hetmesh.discovery.wire import Announcement, LinkRequest, Load
from hetmesh.errors import (
    AuthenticationFailed,
    MeshError,
    PeerUnreachable,
    RemoteProtocolError,
    StreamReset,
)
from hetmesh.resources import DeviceProfile, LinkProfile, PeerId

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)
# the membership clock's cadence; the core counts a tick much later than this as
# a sign that this node is starved (local health, membership.py)
_TICK_S = 0.2

# peer exchange is bounded: candidates taken from one record, and pending at once
MAX_CANDIDATES_PER_RECORD = 16
MAX_PENDING_CANDIDATES = 256
MAX_LINK_REQUESTS = 256  # links one record asks others to measure
# free memory and utilisation move a little at every profile update (5 s), and each
# record version is pulled whole by every member (N-1 pulls): small moves are
# published at most this often, larger ones at once (_devices_moved)
DEVICE_REFRESH_S = 60.0
DEVICE_MOVE_EVERY_S = 30.0
BOOTSTRAP_ATTEMPTS = 3  # dial limits dial_timeout_s x 1, 2, 3
GOODBYE_TRIES = 3  # a goodbye pushed again on a failure (see _send_record)
HANG_UP_GRACE_S = 20.0  # a dead peer is forgotten (link, connection) after this, if still dead
MAX_ESTIMATED_PEERS = 64  # the view estimates missing links only in meshes this small


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
    link_neighbours: int = 8  # peers whose links we measure unasked (plus those asked for)
    load_publish_every_s: float = 2.0  # a record version for a load change at most this often
    dead_redial_every_s: float = 5.0
    require_bootstrap: bool = True  # fail start-up if no bootstrap peer answers


@dataclass(frozen=True, slots=True)
class DiscoveryStatistics:
    announcements_sent: int  # membership messages and direct records sent
    send_failures: int
    accepted: int
    rejected: int
    stale: int
    alive: int
    suspect: int
    joining: int
    dead_or_left: int
    link_probes: int
    bytes_sent: int = 0
    records_published: int = 0
    pulls: int = 0
    deaths: int = 0  # peers this node declared (or learnt were) dead
    refuted: int = 0  # suspicions of this node it refuted
    late_ticks: int = 0  # membership clock ticks that came late (this node was starved)
    local_health: int = 0  # 0: keeping up; n: its timeouts stretched (1 + n) times


class Discovery:
    """Membership, announcements and liveness of one node (see the module doc)."""

    def __init__(self, host: Any, config: DiscoveryConfig, *, psk: str) -> None:
        self.host = host
        self.config = config
        self.psk = psk
        self.peer_id: PeerId = str(host.get_id())
        self.boot_id = time.time_ns()
        # the membership core holds the peer table (``entries``, ``members()``...)
        self.table = Membership(
            self.peer_id,
            boot_id=self.boot_id,
            policy=SwimPolicy(liveness=config.policy, tick_s=_TICK_S),
        )
        self.addrs: tuple[str, ...] = ()
        self.probe_port = 0
        self._seq = 0
        self._devices: tuple[DeviceProfile, ...] = ()
        self._devices_at = 0.0  # monotonic time the published device figures were taken
        self._links: dict[PeerId, LinkProfile] = {}
        self._data_plane: dict[str, Any] = {}
        self._stages: tuple[dict[str, Any], ...] = ()
        self._load = Load()
        self._extra: dict[str, Any] = {}
        # extra entries that move with serving (counters): announced, but a change of
        # these alone waits for the load's turn (set_counters)
        self._counters: dict[str, Any] = {}
        self._subscribers: list[trio.MemorySendChannel[TableEvent]] = []
        self._probe_wanted = trio.Event()
        self._said_goodbye = False
        self._probes_enabled = trio.Event()
        self._link_samples: dict[PeerId, list[LinkMeasurement]] = {}
        self._links_wanted: set[PeerId] = set()
        self._link_requests: tuple[LinkRequest, ...] = ()
        self._requests_read: dict[PeerId, Announcement] = {}  # records whose requests we read
        self._sent = 0
        self._send_failures = 0
        self._encode_failures = 0  # messages dropped because they could not be encoded
        self._probes = 0
        self._published = 0
        # our published record: its content (to notice changes), when its load was
        # last published, and its signed bytes; records of others as signed by them
        self._content: dict[str, Any] | None = None
        self._content_of: tuple[object, ...] | None = None  # what _content was built from
        self._published_load: Load | None = None
        self._published_counters: dict[str, Any] = {}
        self._load_published_at = -1e9
        self._record: Announcement | None = None
        self._signed: dict[PeerId, tuple[tuple[int, int], bytes, bytes]] = {}
        self._nursery: trio.Nursery | None = None
        # measures a link no TCP probe reaches (hetmesh.nat: over the libp2p connection)
        self.link_prober: Callable[[PeerId, int], Awaitable[LinkMeasurement]] | None = None
        self._outbox = Outbox(
            host,
            MEMBERSHIP_PROTOCOL,
            peer_info=self._info_of,
            on_refused=self._refused,
            dial_timeout_s=config.dial_timeout_s,
            send_timeout_s=config.send_timeout_s,
        )

    # -- what the node publishes ----------------------------------------------

    def set_devices(self, devices: Sequence[DeviceProfile]) -> None:
        new, now = tuple(devices), time.monotonic()
        age = now - self._devices_at
        # only drifting figures moved: not worth a version every member pulls unless
        # they moved far, and even then at most every DEVICE_MOVE_EVERY_S (a shared
        # machine's utilisation swings by more than the margin at every update)
        drift = bool(self._devices) and not _devices_reshaped(self._devices, new)
        if (
            drift
            and age < DEVICE_REFRESH_S
            and (age < DEVICE_MOVE_EVERY_S or not _devices_moved(self._devices, new))
        ):
            return
        self._devices, self._devices_at = new, now

    def set_data_plane(self, offer: dict[str, Any]) -> None:
        """The transport's data-plane offer (opaque to discovery)."""
        self._data_plane = dict(offer)

    def set_stages(self, stages: Sequence[dict[str, Any]]) -> None:
        """Stages this node serves, e.g. ``{"model": ..., "start": 0, "end": 8, "ready": True}``."""
        self._stages = tuple(dict(s) for s in stages)

    def set_load(self, load: Load) -> None:
        """The load part of the record; published at most every ``load_publish_every_s``."""
        self._load = load

    @property
    def load(self) -> Load:
        return self._load

    def set_extra(self, key: str, value: Any) -> None:
        """Publish any other msgpack-able field (e.g. ``"plan"``) in the announcement."""
        self._counters.pop(key, None)
        self._extra[key] = value

    def set_counters(self, key: str, value: Any) -> None:
        """Publish an ``extra`` field that moves with serving (counters, memory in use):
        a change of these alone is published with the load, at most every
        ``load_publish_every_s``; any other change takes their latest values along.

        While tokens flow, a stage's counters move every plan tick: published as
        content, each tick was a record version every peer pulled, decoded and
        verified. Nothing plans or routes on these; this node's own view
        (``local_record(advance=False)``) always shows the latest.
        """
        self._extra.pop(key, None)
        self._counters[key] = value

    def want_links(self, peers: Sequence[PeerId]) -> None:
        """Measure our links to ``peers`` too (the coordinator's candidates), beyond the
        neighbour sample; they are probed soon and then with the others."""
        new = {p for p in peers if p != self.peer_id} - self._links_wanted - set(self._links)
        self._links_wanted |= {p for p in peers if p != self.peer_id}
        if new:
            self._probe_wanted.set()

    def request_links(self, pairs: Sequence[tuple[PeerId, PeerId]]) -> None:
        """Ask for the links ``(src, dst)`` the plan lacks: ``src`` measures each one.

        Ours are measured at once; the rest are published in our record (at most
        :data:`MAX_LINK_REQUESTS`), and each named ``src`` probes its ``dst`` when it
        reads them (:meth:`_read_link_requests`). An empty list withdraws them.
        """
        wanted = sorted({(s, d) for s, d in pairs if s != d})
        self.want_links([d for s, d in wanted if s == self.peer_id])
        others = [LinkRequest(src=s, dst=d) for s, d in wanted if s != self.peer_id]
        self._link_requests = tuple(others[:MAX_LINK_REQUESTS])

    def _read_link_requests(self) -> None:
        """Measure the links alive peers' records ask of us (each record read once)."""
        seen: dict[PeerId, Announcement] = {}
        wanted: list[PeerId] = []
        for entry in self.table.alive():
            record = entry.record
            if record is None:
                continue
            seen[entry.peer_id] = record
            if self._requests_read.get(entry.peer_id) is not record:
                wanted += [r.dst for r in record.link_requests if r.src == self.peer_id]
        self._requests_read = seen
        if wanted:
            self.want_links(wanted)

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
        """This node's record with what was last set.

        ``advance`` publishes it (a new version) if its content changed; a record
        whose load alone changed is published at most every ``load_publish_every_s``.
        """
        if goodbye:
            self._seq += 1
            return self._build(load=self._load, goodbye=True)
        if advance:
            self._refresh(trio.current_time())
            assert self._record is not None
            return self._record
        return self._build(load=self._load)

    def _build(self, *, load: Load, goodbye: bool = False) -> Announcement:
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
            load=load,
            known_peers=(),  # peer exchange rides on the membership messages
            probe_port=self.probe_port,
            goodbye=goodbye,
            sent_at_s=time.time(),
            extra={**self._extra, **self._counters},
            incarnation=self.table.incarnation,
            link_requests=self._link_requests,
        )

    def _refresh(self, now: float) -> None:
        """Publish a new record version if its content (or, rate-limited, its load or
        counters) changed."""
        # what the content is built from (the setters replace these, never mutate them):
        # equal, and the content is; only otherwise is the record encoded to compare
        # (five times a second and at every plan tick, it was most of this tick's CPU)
        made_of = (
            self.addrs,
            self._devices,
            tuple(self._links.items()),
            self._data_plane,
            self._stages,
            self.probe_port,
            tuple(self._extra.items()),
            self._link_requests,
        )
        changed = self._record is None
        if made_of != self._content_of:
            content = replace(  # the counters are not content: they wait like the load
                self._build(load=Load()),
                seq=0,
                sent_at_s=0.0,
                incarnation=0,
                extra=dict(self._extra),
            ).to_wire()
            changed = changed or content != self._content
            self._content, self._content_of = content, made_of
        load_due = (
            self._load != self._published_load or self._counters != self._published_counters
        ) and now - self._load_published_at >= self.config.load_publish_every_s
        if not (changed or load_due):
            return
        self._seq += 1
        self._published_load = self._load
        self._published_counters = dict(self._counters)
        self._load_published_at = now
        record = self._build(load=self._load)
        blob = wire.encode(record)
        if len(blob) > wire.MAX_ANNOUNCEMENT_BYTES:
            log.error(
                "our record is %d bytes, over the %d every peer accepts: not published "
                "(publish less through set_extra/set_stages)",
                len(blob),
                wire.MAX_ANNOUNCEMENT_BYTES,
            )
            return
        self._record = record
        self._signed[self.peer_id] = (record.order, blob, self._sign(blob))
        self._published += 1
        self._dispatch(self.table.set_record(record, now))

    def _sign(self, blob: bytes) -> bytes:
        get_key = getattr(self.host, "get_private_key", None)
        return sign_record(get_key(), blob) if get_key is not None else b""

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
            "links": links,  # measured, each by its src
            "estimated_links": estimate_links(peers, links),
            "statistics": self.statistics_dict(),
        }

    def statistics(self) -> DiscoveryStatistics:
        t = self.table.statistics()
        out = self._outbox.statistics()
        return DiscoveryStatistics(
            announcements_sent=self._sent + out.sent,
            send_failures=self._send_failures + out.failures,
            accepted=t.accepted,
            rejected=t.rejected,
            stale=t.stale,
            alive=t.alive,
            suspect=t.suspect,
            joining=t.joining,
            dead_or_left=t.dead_or_left,
            link_probes=self._probes,
            bytes_sent=out.bytes_sent,
            records_published=self._published,
            pulls=self.table.stats.pulls,
            deaths=self.table.stats.deaths,
            refuted=self.table.stats.refuted,
            late_ticks=self.table.stats.late_ticks,
            local_health=self.table.local_health,
        )

    def statistics_dict(self) -> dict[str, int]:
        s = self.statistics()
        return {name: getattr(s, name) for name in s.__slots__}

    # -- inbound ----------------------------------------------------------------

    def receive(
        self, payload: bytes, remote: PeerId, now: float | None = None
    ) -> Announcement | None:
        """Apply one record its origin pushed to us directly; None if rejected.

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
            check_own(payload, record)
        except RemoteProtocolError as exc:
            self.table.note_rejected()
            log.debug("rejected an announcement from %s: %s", remote, exc)
            return None
        self._dispatch(self.table.note_record(record, now, direct=True))
        self._emit(self.table.drain_events())
        for known in record.known_peers[:MAX_CANDIDATES_PER_RECORD]:
            self._offer_candidate(known.peer_id, known.addrs, now)
        return record

    def receive_message(self, payload: bytes, remote: PeerId, now: float | None = None) -> None:
        """Apply one membership message from an authenticated peer (never raises for it)."""
        now = trio.current_time() if now is None else now
        try:
            msg = decode_message(payload)
            if msg.src != remote:
                raise RemoteProtocolError(f"a message from {msg.src} arrived from {remote}")
            msg = self._checked_record(msg)
        except RemoteProtocolError as exc:
            self.table.note_rejected()
            log.debug("rejected a membership message from %s: %s", remote, exc)
            return
        self._dispatch(self.table.receive(msg, now))
        self._emit(self.table.drain_events())

    def _checked_record(self, msg: Message) -> Message:
        """Verify a carried record's origin signature; keep the signed bytes to relay."""
        if msg.kind is not Kind.RECORD or msg.record is None:
            return msg
        if not msg.record_blob:
            raise RemoteProtocolError(f"an unsigned record of {msg.record.peer_id}")
        held = self._signed.get(msg.record.peer_id)
        if held is not None and held[1] == msg.record_blob and held[2] == msg.signature:
            # the very bytes and signature checked already (gossip brings a record
            # many times): its record was decoded from these bytes, so it is that one
            return msg
        record = open_record(msg.record_blob, msg.signature)
        held = self._signed.get(record.peer_id)
        if held is None or held[0] < record.order:
            self._signed[record.peer_id] = (record.order, msg.record_blob, msg.signature)
        return msg

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

    async def _handle_membership(self, stream: Any) -> None:
        """A peer's lane: frames until it closes (or goes quiet for long)."""
        remote = str(stream.muxed_conn.peer_id)
        reader = wire.FrameReader(stream)  # a message's prefix and body in one read
        while True:
            try:
                payload = await reader.read_frame(
                    max_bytes=MAX_MESSAGE_BYTES, timeout_s=self._outbox.idle_s * 4
                )
            except (StreamReset, trio.TooSlowError):
                return
            except RemoteProtocolError:
                self.table.note_rejected()
                raise
            self.receive_message(payload, remote)

    async def _handle_status(self, stream: Any) -> None:
        await wire.write_frame(stream, wire.encode(self.view()))

    # -- outbound ---------------------------------------------------------------

    def _offer_candidate(
        self, peer_id: PeerId, addrs: tuple[str, ...], now: float | None = None
    ) -> None:
        if peer_id == self.peer_id or not addrs:
            return
        if self.table.pending_candidates >= MAX_PENDING_CANDIDATES:
            return  # peer exchange is bounded: the rest are learnt as they answer
        now = trio.current_time() if now is None else now
        if self.table.note_candidate(peer_id, addrs, now):
            self._dispatch(self.table.introduce(peer_id, now))

    def _peer_info(self, peer_id: PeerId, addrs: Sequence[str]) -> Any:
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo
        from multiaddr import Multiaddr

        maddrs = [Multiaddr(a.split("/p2p/")[0]) for a in addrs]
        return PeerInfo(ID.from_base58(peer_id), maddrs)

    def _info_of(self, peer_id: PeerId) -> Any | None:
        entry = self.table.entries.get(peer_id)
        try:
            return self._peer_info(peer_id, entry.addrs if entry else ())
        except Exception:  # an address or id we cannot parse: nobody to send to
            log.debug("no usable address for %s", peer_id, exc_info=True)
            return None

    def _refused(self, peer_id: PeerId) -> None:
        now = trio.current_time()
        self._dispatch(self.table.note_unreachable(peer_id, now))
        self._emit(self.table.drain_events())

    def _dispatch(self, msgs: list[Message]) -> None:
        """Send what the membership core asked for (dropped while not serving)."""
        if self._nursery is None:
            return
        for msg in msgs:
            if msg.kind is Kind.RECORD and msg.record is not None:
                held = self._signed.get(msg.record.peer_id)
                if held is None or held[0] != msg.record.order:
                    continue  # never relay a record we cannot show its origin signed
                msg = replace(msg, record_blob=held[1], signature=held[2])
            on_sent = None
            if msg.kind is Kind.PING:  # its timers start once it is on the wire
                on_sent = functools.partial(self._ping_sent, msg.seq)
            try:
                payload = encode_message(msg)
            except (ValueError, TypeError, OverflowError) as exc:
                # never the end of the node: one message we cannot carry is dropped
                self._encode_failures += 1
                log.error("dropped a %s to %s we could not encode: %r", msg.kind.name, msg.dst, exc)
                continue
            self._outbox.send(self._nursery, msg.dst, payload, on_sent)

    def _ping_sent(self, seq: int) -> None:
        self.table.note_sent(seq, trio.current_time())

    def _emit(self, events: list[TableEvent]) -> None:
        for event in events:
            log.info("peer %s: %s -> %s", event.peer_id, event.old, event.new)
            if event.new is Health.ALIVE and event.old is not Health.SUSPECT:
                self._probe_wanted.set()
            if event.new is Health.LEFT:
                self._forget(event.peer_id)
            elif event.new is Health.DEAD and self._nursery is not None:
                # forgotten only if still dead after a grace: dropping its link at
                # once made a new record version (pulled by every member) at each
                # false death, and another when the link was measured again
                self._nursery.start_soon(self._hang_up, event.peer_id)
            for send in list(self._subscribers):
                try:
                    send.send_nowait(event)
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    self._subscribers.remove(send)

    async def _send_record(self, peer_id: PeerId, addrs: Sequence[str], payload: bytes) -> None:
        """Push one record to one peer directly (the goodbye), in up to
        ``GOODBYE_TRIES`` tries: the stream may land on a connection the peer closed
        while we did not look (frozen, then resumed; the swarm spreads streams over a
        peer's connections), and the next try takes another or dials afresh."""
        from libp2p.custom_types import TProtocol

        failure: BaseException | None = None
        for _ in range(GOODBYE_TRIES):
            try:
                info = self._peer_info(peer_id, addrs)
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
                return
            except (MeshError, trio.TooSlowError) as exc:
                failure = exc
            except Exception as exc:
                failure = exc
        self._send_failures += 1
        log.info("goodbye to %s failed after %d tries: %r", peer_id, GOODBYE_TRIES, failure)

    # -- services ------------------------------------------------------------------

    async def _serve_membership(self) -> None:
        """The membership clock: probes, suspicions, record versions, tombstones."""
        tick_s = _TICK_S
        last = trio.current_time()
        next_sweep = last + 10.0
        while True:
            now = trio.current_time()
            if now - last > max(2.0, self.config.policy.interval_s * 2):
                log.warning(
                    "this node stalled for %.1f s; restarting the liveness window", now - last
                )
                self.table.excuse_gap(now - last - tick_s)
            last = now
            try:
                self._tick(now)
            except Exception:  # a bug or a peer's lie: logged, and the clock ticks on
                log.exception("a membership tick failed; going on")
            if now >= next_sweep:
                next_sweep = now + 10.0
                self.table.forget_tombstones(now)
            await trio.sleep(tick_s)

    def _tick(self, now: float) -> None:
        self._refresh(now)
        self._dispatch(self.table.tick(now))
        self._emit(self.table.drain_events())
        self._read_link_requests()

    def _forget(self, peer_id: PeerId) -> None:
        """Drop our link to a peer gone for good, and what we held to relay its record."""
        self._links.pop(peer_id, None)
        self._link_samples.pop(peer_id, None)
        self._signed.pop(peer_id, None)
        self._links_wanted.discard(peer_id)

    async def _hang_up(self, peer_id: PeerId) -> None:
        """Forget a peer still dead after ``HANG_UP_GRACE_S`` and close its connection:
        one buried while merely starved comes back on the connection it has (no new
        handshake on two loaded ends) and with the link figures we published."""
        from libp2p.peer.id import ID

        await trio.sleep(HANG_UP_GRACE_S)
        entry = self.table.entries.get(peer_id)
        if entry is not None and entry.health is not Health.DEAD:
            return
        self._forget(peer_id)
        with trio.move_on_after(1.0), contextlib.suppress(Exception):
            await self.host.disconnect(ID.from_base58(peer_id))

    def enable_link_probes(self) -> None:
        """Start measuring links (the daemon calls this once its own benchmark is done,
        so the benchmark and the probes do not compete for the CPU)."""
        self._probes_enabled.set()

    def link_targets(self) -> list[PeerEntry]:
        """Alive peers whose links we measure: a bounded neighbour sample, plus those
        asked for through :meth:`want_links`. Never every peer in a large mesh.

        Neighbours are the peers nearest to us by a hash of the two ids: stable
        while membership is, and spread so every peer is someone's neighbour.
        """
        alive = self.table.alive()

        def distance(entry: PeerEntry) -> bytes:
            pair = "\x00".join(sorted((self.peer_id, entry.peer_id))).encode()
            mine = hashlib.sha256(self.peer_id.encode()).digest()
            theirs = hashlib.sha256(pair).digest()
            return bytes(a ^ b for a, b in zip(mine, theirs, strict=True))

        near = sorted(alive, key=distance)[: self.config.link_neighbours]
        chosen = {e.peer_id for e in near} | self._links_wanted
        return [e for e in alive if e.peer_id in chosen]

    async def _serve_links(self) -> None:
        """Probe the link targets on membership change (twice: once at once, once
        after things settle) and every ``link_probe_interval_s``."""
        await self._probes_enabled.wait()
        follow_up = 0
        while True:
            wait_s = (
                self.config.link_probe_settle_s if follow_up else self.config.link_probe_interval_s
            )
            changed = False
            with trio.move_on_after(wait_s):
                await self._probe_wanted.wait()
                await trio.sleep(0.5)  # let a burst of joins settle
                follow_up, changed = 2, True
            self._probe_wanted = trio.Event()
            periodic = not changed and not follow_up
            follow_up = max(follow_up - 1, 0)
            for entry in self.link_targets():
                # a membership change measures only the links still new to us (two
                # samples: one now, one once things settle); a peer that flaps back
                # to alive keeps its figures until the periodic round
                if periodic or len(self._link_samples.get(entry.peer_id, ())) < 2:
                    await self._probe_one(entry)

    async def _probe_one(self, entry: PeerEntry) -> None:
        record = entry.record
        if record is None:
            return
        hosts = [h for h in map(addr_host, record.addrs) if h] if record.probe_port else []
        measured: list[LinkMeasurement] = []
        for host_ip in hosts[:2]:
            try:
                m = await probe_link(
                    host_ip, record.probe_port, self.psk, nbytes=self.config.link_probe_bytes
                )
            except (PeerUnreachable, RemoteProtocolError) as exc:
                log.debug("link probe to %s at %s failed: %s", entry.peer_id, host_ip, exc)
                continue
            measured.append(m)
            break
        if not measured and self.link_prober is not None:
            # no address of it answers (behind NAT): measure the path our connection takes
            try:
                measured.append(await self.link_prober(entry.peer_id, self.config.link_probe_bytes))
            except MeshError as exc:
                log.debug("link probe to %s over libp2p failed: %s", entry.peer_id, exc)
        for m in measured:
            self._probes += 1
            samples = self._link_samples.setdefault(entry.peer_id, [])
            samples.append(m)
            del samples[: -self.config.link_probe_window]
            # contention (CPU or other traffic) only ever lowers a sample: publish the
            # best of the recent ones as the link's capacity, and the lowest RTT
            link = LinkProfile(
                src=self.peer_id,
                dst=entry.peer_id,
                rtt_s=min(x.rtt_s for x in samples),
                bandwidth_bps=max(x.bandwidth_bps for x in samples),
                measured_at_s=time.time(),
            )
            old = self._links.get(entry.peer_id)
            # every new link figure is a new record version that every member pulls:
            # republish a link only when it moved, or to refresh its age now and then
            if old is None or _moved(old, link) or link.measured_at_s - old.measured_at_s > 240:
                self._links[entry.peer_id] = link
            return

    async def _bootstrap(self) -> None:
        """Dial the bootstrap peers; raise if none of them answers."""
        from hetmesh.discovery.host import parse_peer_addr

        if not self.config.bootstrap:
            return
        log.info("joining the mesh through %d bootstrap peer(s)", len(self.config.bootstrap))
        # a starved machine answers a handshake late, which reads like a wrong secret:
        # try again with a longer limit before giving up (the first failure is logged
        # at once, so a real wrong secret is still reported within one dial timeout)
        for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
            failures: list[MeshError] = []
            timeout_s = self.config.dial_timeout_s * attempt
            for addr in self.config.bootstrap:
                info = parse_peer_addr(addr)
                try:
                    await dial(self.host, info, timeout_s=timeout_s)
                except MeshError as exc:
                    log.warning(
                        "bootstrap peer %s: %s (attempt %d of %d)",
                        addr,
                        exc,
                        attempt,
                        BOOTSTRAP_ATTEMPTS,
                    )
                    failures.append(exc)
                    continue
                self._offer_candidate(str(info.peer_id), (addr,))
            if len(failures) < len(self.config.bootstrap) or not self.config.require_bootstrap:
                return
            if attempt < BOOTSTRAP_ATTEMPTS:
                await trio.sleep(1.0)
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
        self.add_handler(MEMBERSHIP_PROTOCOL, self._handle_membership)
        self.add_handler(wire.STATUS_PROTOCOL, self._handle_status)
        self.addrs = expand_listen_addrs(self.host.get_transport_addrs(), self.peer_id)
        probe_host = "0.0.0.0"
        mdns: MdnsHandle | None = None
        try:
            async with trio.open_nursery() as nursery:
                self.probe_port = await nursery.start(serve_probe, probe_host, self.psk)
                self._nursery = nursery
                self.table.addrs = self.addrs
                self._refresh(trio.current_time())  # our first record, before anyone asks
                await self._bootstrap()
                if self.config.mdns:
                    mdns = self._start_mdns()
                nursery.start_soon(self._serve_membership)
                nursery.start_soon(self._serve_links)
                task_status.started()
        finally:
            self._nursery = None  # closed: nothing more starts in it (the goodbye checks)
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
        payload = wire.encode(self.local_record(goodbye=True))
        live = (Health.ALIVE, Health.SUSPECT, Health.JOINING)
        targets = [
            e for e in self.table.entries.values() if e.health in live and e.ever_alive and e.addrs
        ]
        # and our own LEFT notice on each member's membership lane, the lane that carried
        # our last messages (the record's stream may land on a connection the member
        # closed while we were frozen: seen in CI, the member judged us dead instead)
        notices = self.table.leave()
        unsent = [len(notices)]
        all_sent = trio.Event()

        def sent_one() -> None:
            unsent[0] -= 1
            if unsent[0] <= 0:
                all_sent.set()

        if not notices:
            all_sent.set()
        for msg in notices:
            try:
                notice = encode_message(msg)
            except (ValueError, TypeError, OverflowError):
                sent_one()
                continue
            try:
                if self._nursery is None:
                    raise RuntimeError("the services have stopped")
                self._outbox.send(self._nursery, msg.dst, notice, sent_one)
            except RuntimeError:  # no lane can start now: the record alone goes
                sent_one()
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as nursery:
                for entry in targets:  # once, to each live member: they drop us at once
                    nursery.start_soon(self._send_record, entry.peer_id, entry.addrs, payload)
            await all_sent.wait()  # a lane that fails never says sent: the grace ends it


_DRIFTING = frozenset({"memory_free_bytes", "utilisation", "cpu_freq_hz"})


def _devices_reshaped(old: Sequence[DeviceProfile], new: Sequence[DeviceProfile]) -> bool:
    """Whether anything but the drifting figures (free memory, utilisation, clock)
    changed: another device list, a new benchmark."""
    if len(old) != len(new):
        return True
    # field by field: a copy through dataclasses.replace would validate again
    return any(
        getattr(a, f.name) != getattr(b, f.name)
        for a, b in zip(old, new, strict=True)
        for f in fields(a)
        if f.name not in _DRIFTING
    )


def _devices_moved(old: Sequence[DeviceProfile], new: Sequence[DeviceProfile]) -> bool:
    """Whether device figures changed enough for a record version: anything but free
    memory, utilisation and clock, free memory by 1 % of the total (at least 128 MiB),
    utilisation by 0.1, or the clock (which idles and boosts) by a quarter."""
    if _devices_reshaped(old, new):
        return True
    for a, b in zip(old, new, strict=True):
        if abs(b.cpu_freq_hz - a.cpu_freq_hz) > 0.25 * max(a.cpu_freq_hz, 1.0):
            return True
        margin = max(0.01 * a.memory_total_bytes, 128 * 2**20)
        if abs(b.memory_free_bytes - a.memory_free_bytes) > margin:
            return True
        if abs(b.utilisation - a.utilisation) > 0.1:
            return True
    return False


def _moved(old: LinkProfile, new: LinkProfile) -> bool:
    """Whether a link's figures moved enough to be worth a record version: bandwidth
    by a quarter, RTT by a quarter and at least a millisecond (loopback RTTs jitter)."""
    rtt_moved = abs(new.rtt_s - old.rtt_s) > max(0.25 * old.rtt_s, 1e-3)
    return rtt_moved or abs(new.bandwidth_bps - old.bandwidth_bps) > 0.25 * old.bandwidth_bps


def _site(record: dict[str, Any]) -> tuple[str, str]:
    """(host, /24 subnet) of a record's first IP address; empty when it has none."""
    for addr in record.get("addrs") or ():
        host = addr_host(str(addr))
        if host:
            return host, host.rsplit(".", 1)[0] if host.count(".") == 3 else host
    return "", ""


def estimate_links(
    peers: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Estimates for the missing links between live peers (pure; for display).

    A missing link between two peers on one host, or on one /24 subnet, is
    estimated as the best measured link of the same kind (same host, same
    subnet) in the view; other pairs stay unknown. Each estimate is marked
    ``"estimated": True`` and names the link it was taken from.
    """
    live = [p for p in peers if p.get("health") in ("self", "alive", "suspect")]
    if len(live) > MAX_ESTIMATED_PEERS:
        return []
    site = {str(p["peer_id"]): _site(p.get("record") or {}) for p in live}
    have = {(str(lk["src"]), str(lk["dst"])) for lk in measured}

    def kind(src: str, dst: str) -> str:
        (h1, n1), (h2, n2) = site.get(src, ("", "")), site.get(dst, ("", ""))
        if h1 and h1 == h2:
            return "host"
        return "subnet" if n1 and n1 == n2 else ""

    best: dict[str, dict[str, Any]] = {}
    for lk in measured:
        k = kind(str(lk["src"]), str(lk["dst"]))
        if k and (k not in best or lk["bandwidth_bps"] > best[k]["bandwidth_bps"]):
            best[k] = lk
    out = []
    for src in site:
        for dst in site:
            k = kind(src, dst)
            if src == dst or (src, dst) in have or k not in best:
                continue
            ref = best[k]
            out.append(
                {
                    "src": src,
                    "dst": dst,
                    "rtt_s": ref["rtt_s"],
                    "bandwidth_bps": ref["bandwidth_bps"],
                    "estimated": True,
                    "basis": f"same {k} as {ref['src']} -> {ref['dst']}",
                }
            )
    return out


__all__ = [
    "Discovery",
    "DiscoveryConfig",
    "DiscoveryStatistics",
    "estimate_links",
]
