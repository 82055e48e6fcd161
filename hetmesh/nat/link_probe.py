"""Link probes where no TCP probe gets through: over libp2p, or a hole-punched path.

Discovery measures links with a TCP probe to the peer's announced address
(:data:`~hetmesh.discovery.probe.TCP_PROBE`); a member behind NAT has no
address anyone outside reaches, so its links would stay unmeasured and the
planner would price them as default links. :class:`LinkProber` measures
them with the same prober (:mod:`hetmesh.discovery.probe`) over another
path, chosen by the kind:

- :data:`~hetmesh.discovery.probe.PUNCHED_PROBE`, where this node's data
  plane to the peer is hole-punched: tensors take a direct TCP connection
  through both routers, not the relay, so the probe punches a connection of
  its own the same way and measures that. On :data:`PUNCH_PROBE_PROTOCOL`
  (over the authenticated, relayed libp2p connection) the asker writes
  ``"<candidate> <token hex>\\n"``, the answerer ``"<candidate>\\n"`` (``"-"``
  when it has none); both open simultaneously from their reserved ports
  (:mod:`hetmesh.nat.punch`), and on the punched socket the asker first
  sends the 16-byte token (the answerer drops a connection without it).
  Where that fails, the libp2p kind.
- :data:`~hetmesh.discovery.probe.LIBP2P_PROBE`, otherwise: a stream of the
  libp2p connection on :data:`P2P_PROBE_PROTOCOL` (already authenticated);
  over a relayed connection that is the relayed path, relay hop and both
  routers' uplinks included, which is what the data plane over it will get.
"""

from __future__ import annotations

import hmac
import logging
import socket
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery.host import dial
from hetmesh.discovery.probe import (
    LIBP2P_PROBE,
    PUNCHED_PROBE,
    LinkMeasurement,
    ProbeKind,
    SocketChannel,
    StreamChannel,
    answer,
    enable_timestamps,
    measure,
    read_exact,
)
from hetmesh.discovery.rpc import open_stream
from hetmesh.errors import MeshError, PeerUnreachable, RemoteProtocolError
from hetmesh.nat.punch import TOKEN_BYTES, answer_offer, punch_from, punch_to
from hetmesh.nat.punch_plan import DEFAULT_SCHEDULE
from hetmesh.nat.state import NatState

if TYPE_CHECKING:
    from hetmesh.discovery.service import Discovery

log = logging.getLogger(__name__)

P2P_PROBE_PROTOCOL = "/hetmesh/p2p-probe/1.0.0"
PUNCH_PROBE_PROTOCOL = "/hetmesh/punch-probe/1.0.0"
_IO_TIMEOUT_S = 30.0
# punched probes answered at once (each holds a reserved port for up to ~10 s):
# more are told "-" (no candidate), and the asker probes over libp2p instead
MAX_CONCURRENT_ANSWERS = 2


def _punched_stream(sock: socket.socket) -> tuple[trio.SocketStream, bool]:
    """A punched socket as a trio stream, and whether the kernel timestamps arrivals
    (asked for first: the kernel may switch its timestamps on a little later)."""
    stamped = enable_timestamps(sock)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    return stream, stamped


async def measure_punched(sock: socket.socket, token: bytes, nbytes: int) -> LinkMeasurement:
    """The asker's side on a punched socket: the token, then the probe."""
    stream, _ = _punched_stream(sock)
    async with stream:
        with trio.fail_after(_IO_TIMEOUT_S):
            await stream.send_all(token)
        return await measure(SocketChannel(stream), PUNCHED_PROBE, nbytes)


async def answer_punched(sock: socket.socket, token: bytes) -> None:
    """The answerer's side on a punched socket: the token first (anything else is
    dropped), then pings and timed transfers."""
    stream, stamped = _punched_stream(sock)
    async with stream:
        channel = SocketChannel(stream, stamped=stamped)
        with trio.fail_after(_IO_TIMEOUT_S):
            got = await read_exact(channel, TOKEN_BYTES)
        if not hmac.compare_digest(got, token):
            raise RemoteProtocolError("punched probe connection without the token")
        await answer(channel, PUNCHED_PROBE)


class LinkProber:
    """Measures this node's link to a member no TCP probe reaches (see the module)."""

    def __init__(self, discovery: Discovery, nat: NatState) -> None:
        self.discovery = discovery
        self.nat = nat
        self._answering = 0  # punched probes being answered now
        self._punch_measured: set[str] = set()  # peers whose punched path was measured

    def kinds(self, peer_id: str) -> tuple[ProbeKind, ...]:
        """The kinds to try for ``peer_id``, in order."""
        if peer_id in self.nat.punched_peers():
            return (PUNCHED_PROBE, LIBP2P_PROBE)
        return (LIBP2P_PROBE,)

    async def probe(self, peer_id: str, nbytes: int) -> LinkMeasurement:
        """The link to ``peer_id``: over the first kind that measures it. Raises
        :class:`PeerUnreachable` (also on timeout) or :class:`RemoteProtocolError`."""
        kinds = self.kinds(peer_id)
        for kind in kinds[:-1]:
            try:
                measured = await self._probe(kind, peer_id, nbytes)
            except MeshError as exc:
                log.info("link probe to %s over %s failed (%r)", peer_id, kind.path, exc)
                continue
            if peer_id not in self._punch_measured:
                self._punch_measured.add(peer_id)
                log.info(
                    "link to %s measured over %s: %.3f ms, %.2f MB/s",
                    peer_id,
                    kind.path,
                    measured.rtt_s * 1e3,
                    measured.bandwidth_bps / 1e6,
                )
            return measured
        return await self._probe(kinds[-1], peer_id, nbytes)

    async def _probe(self, kind: ProbeKind, peer_id: str, nbytes: int) -> LinkMeasurement:
        if kind is PUNCHED_PROBE:
            return await self._over_punch(peer_id, nbytes)
        return await self._over_libp2p(peer_id, nbytes)

    async def _over_libp2p(
        self, peer_id: str, nbytes: int, timeout_s: float = 20.0
    ) -> LinkMeasurement:
        """Over a libp2p stream; dials the peer first if needed (through its relay
        when it announces one)."""
        discovery, host = self.discovery, self.discovery.host
        try:
            with trio.fail_after(timeout_s):
                if peer_id not in {str(p) for p in host.get_network().connections}:
                    entry = discovery.table.entries.get(peer_id)
                    info = discovery._peer_info(peer_id, entry.addrs if entry else ())
                    await dial(host, info, timeout_s=discovery.config.dial_timeout_s)
                stream = await open_stream(host, peer_id, P2P_PROBE_PROTOCOL, timeout_s=timeout_s)
                try:
                    return await measure(StreamChannel(stream), LIBP2P_PROBE, nbytes)
                finally:
                    await stream.close()
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"libp2p link probe to {peer_id} timed out") from exc
        except MeshError:
            raise
        except Exception as exc:  # libp2p's stream errors
            raise PeerUnreachable(f"libp2p link probe to {peer_id} failed: {exc!r}") from exc

    async def _over_punch(
        self, peer_id: str, nbytes: int, timeout_s: float = 40.0
    ) -> LinkMeasurement:
        """Over a freshly hole-punched connection (no candidate, a failed punch or a
        timeout: :class:`PeerUnreachable`)."""
        discovery = self.discovery
        try:
            with trio.fail_after(timeout_s):
                sock, token = await punch_to(
                    self.nat,
                    discovery.addrs,
                    discovery.host,
                    peer_id,
                    PUNCH_PROBE_PROTOCOL,
                    timeout_s,
                )
                return await measure_punched(sock, token, nbytes)
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"punched link probe to {peer_id} timed out") from exc
        except MeshError:
            raise
        except Exception as exc:  # libp2p stream and socket errors
            raise PeerUnreachable(f"punched link probe to {peer_id} failed: {exc!r}") from exc

    async def _answer_libp2p(self, stream: Any) -> None:
        await answer(StreamChannel(stream), LIBP2P_PROBE)

    async def _answer_punch(self, stream: Any) -> None:
        with trio.fail_after(_IO_TIMEOUT_S + DEFAULT_SCHEDULE.total_s):
            free = self._answering < MAX_CONCURRENT_ANSWERS
            offer = await answer_offer(stream, self.nat, self.discovery.addrs, willing=free)
            if offer is None:
                return
            reserved, theirs, token = offer
            self._answering += 1
            try:
                sock = await punch_from(reserved, theirs)
                if sock is not None:
                    await answer_punched(sock, token)
            finally:
                self._answering -= 1

    def handlers(self) -> dict[str, Any]:
        """The answerer's libp2p handlers by protocol (wrap each with ``guarded_handler``)."""
        return {
            P2P_PROBE_PROTOCOL: self._answer_libp2p,
            PUNCH_PROBE_PROTOCOL: self._answer_punch,
        }


__all__ = [
    "MAX_CONCURRENT_ANSWERS",
    "P2P_PROBE_PROTOCOL",
    "PUNCH_PROBE_PROTOCOL",
    "LinkProber",
    "answer_punched",
    "measure_punched",
]
