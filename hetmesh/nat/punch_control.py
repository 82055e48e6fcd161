"""The control connection between two homes, moved off the relay onto a punched path.

Two members behind different NAT routers first meet through a relay
(:mod:`hetmesh.nat.relay`), so their libp2p connection — membership pings,
RPCs, plan and session control — lives and dies with the relay. Their data
plane is already hole-punched where the routers allow
(:mod:`hetmesh.nat.punch`); this module punches one more TCP connection
the same way and hands it to libp2p as an ordinary connection: the private
network key, noise (which proves the far peer's id end to end) and yamux run
over it exactly as over a dialled socket. The swarm then prefers it, trims
the older relayed connection, and a relay that dies takes nothing with it.

Why a libp2p connection rather than heartbeats over the data-plane socket:
liveness is only one of the things that ride the control connection; plan
adoption, session opens and replays need RPCs too, and a second liveness
path would let the two views disagree. One connection, authenticated the
usual way, keeps every existing protocol working unchanged.

Protocol on :data:`PUNCH_CONTROL_PROTOCOL` (over the relayed connection): the
lower peer id asks with ``"<candidate> <token hex>\\n"``, the other answers
``"<candidate>\\n"`` (``"-"``: none); both open simultaneously from their
reserved ports; the asker writes the 16-byte token first and the answerer
drops a connection without it, so only the punch it agreed to is upgraded.
A failed punch (a symmetric router) leaves the relayed connection as it was;
it is tried again after a back-off that doubles up to :data:`MAX_RETRY_S`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.errors import MeshError, PeerUnreachable, RemoteProtocolError
from hetmesh.nat.punch import TOKEN_BYTES, answer_offer, punch_from, punch_to, recv_exact
from hetmesh.nat.punch_plan import DEFAULT_SCHEDULE
from hetmesh.nat.state import NatState
from hetmesh.transport.p2p import PUNCHED_MARK
from hetmesh.transport.threads import in_thread

if TYPE_CHECKING:
    from hetmesh.discovery.service import Discovery

log = logging.getLogger(__name__)

PUNCH_CONTROL_PROTOCOL = "/hetmesh/punch-control/1.0.0"
_TOKEN_TIMEOUT_S = 10.0
_UPGRADE_TIMEOUT_S = 30.0  # the private network, noise and yamux handshakes
FIRST_RETRY_S = 30.0
MAX_RETRY_S = 600.0
# a relayed connection younger than this is left alone: libp2p's per-peer trim
# spares connections inside its 20 s grace period, and the relayed one must go
MIN_RELAYED_AGE_S = 25.0


def _token_on(sock: socket.socket, token: bytes, send: bool) -> None:
    """Blocking: write ``token`` (asker) or read and check it (answerer)."""
    sock.settimeout(_TOKEN_TIMEOUT_S)
    if send:
        sock.sendall(token)
    elif not hmac.compare_digest(recv_exact(sock, TOKEN_BYTES), token):
        raise RemoteProtocolError("punched control connection without the token")
    sock.settimeout(None)


def _rwc(sock: socket.socket) -> Any:
    """A punched socket as the byte stream libp2p's TCP transport would hand over."""
    from libp2p.io.trio import TrioTCPStream

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rwc = TrioTCPStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    # the data plane reads the mark: the peer's announced endpoints are behind its
    # router, so a link to it is punched as over a relayed connection
    setattr(rwc, PUNCHED_MARK, True)
    return rwc


class ControlPuncher:
    """Punches direct control connections to members we only reach through a relay."""

    def __init__(self, discovery: Discovery, nat: NatState | None = None) -> None:
        self.discovery = discovery
        self.nat = nat if nat is not None else NatState()  # the public IP to punch from
        self.direct: dict[str, Any] = {}  # peer -> the punched swarm connection
        self.attempts = 0
        self.failures = 0
        self._busy: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._backoff_s: dict[str, float] = {}

    def is_direct(self, peer_id: str) -> bool:
        """Whether our control connection to ``peer_id`` is a punched one still open."""
        conn = self.direct.get(peer_id)
        if conn is None:
            return False
        live = self.discovery.host.get_network().connections
        if any(c is conn for conns in live.values() for c in conns):
            return True
        del self.direct[peer_id]
        return False

    def wanted(self, relayed: dict[str, float], now: float) -> list[str]:
        """Peers to punch a control connection to now (we ask only the higher ids)."""
        me = self.discovery.peer_id
        return sorted(
            peer
            for peer, since in relayed.items()
            if me < peer
            and now - since >= MIN_RELAYED_AGE_S
            and peer not in self._busy
            and now >= self._retry_at.get(peer, 0.0)
            and not self.is_direct(peer)
        )

    def _failed(self, peer_id: str, why: object) -> None:
        self.failures += 1
        backoff = min(self._backoff_s.get(peer_id, FIRST_RETRY_S / 2) * 2, MAX_RETRY_S)
        self._backoff_s[peer_id] = backoff
        self._retry_at[peer_id] = trio.current_time() + backoff
        log.info(
            "control connection to %s stays relayed (%s); next try in %.0f s",
            peer_id,
            why,
            backoff,
        )

    async def _adopt(
        self, peer_id: str, sock: socket.socket, nursery: trio.Nursery | None = None
    ) -> None:
        """Run the libp2p upgrade over the punched socket and add it to the swarm.

        We dial (``nursery`` None): an outbound upgrade, which returns once the
        connection is in the swarm. We answer: the swarm's inbound handling, which
        serves the connection until it closes, so it runs in ``nursery`` and we
        wait for the new connection to appear.
        """
        from libp2p.network.connection.raw_connection import RawConnection
        from libp2p.peer.id import ID
        from libp2p.security.pnet.protector import new_protected_conn
        from multiaddr import Multiaddr

        network = self.discovery.host.get_network()
        peer = ID.from_base58(peer_id)
        before = {id(c) for c in network.connections.get(peer, ())}
        rwc = _rwc(sock)
        if nursery is None:
            raw: Any = RawConnection(rwc, initiator=True)
            if network.psk is not None:
                raw = new_protected_conn(raw, network.psk)
            conn = await network.upgrade_outbound_raw_conn(raw, peer)
        else:
            ip, port = sock.getpeername()[:2]
            nursery.start_soon(
                network._handle_inbound_connection, rwc, Multiaddr(f"/ip4/{ip}/tcp/{port}")
            )
            with trio.move_on_after(_UPGRADE_TIMEOUT_S):
                while True:
                    fresh = [c for c in network.connections.get(peer, ()) if id(c) not in before]
                    if fresh:
                        break
                    await trio.sleep(0.1)
            if not fresh:
                with contextlib.suppress(Exception):
                    await rwc.close()
                raise PeerUnreachable(f"the punched control connection from {peer_id} failed")
            conn = fresh[-1]
        self.direct[peer_id] = conn
        self._backoff_s.pop(peer_id, None)
        log.info("control connection to %s moved onto a hole-punched path", peer_id)

    async def upgrade(self, peer_id: str, timeout_s: float = 40.0) -> None:
        """Ask ``peer_id`` for a punched control connection; failures are logged, not raised."""
        self._busy.add(peer_id)
        self.attempts += 1
        try:
            with trio.fail_after(timeout_s):
                await self._ask(peer_id)
        except (MeshError, trio.TooSlowError, OSError) as exc:
            self._failed(peer_id, repr(exc))
        except Exception as exc:  # libp2p upgrade errors
            log.debug("punched control connection to %s failed", peer_id, exc_info=True)
            self._failed(peer_id, repr(exc))
        finally:
            self._busy.discard(peer_id)

    async def _ask(self, peer_id: str) -> None:
        discovery = self.discovery
        sock, token = await punch_to(
            self.nat, discovery.addrs, discovery.host, peer_id, PUNCH_CONTROL_PROTOCOL, 10.0
        )
        try:
            await in_thread(_token_on, sock, token, True)
            await self._adopt(peer_id, sock)
        except BaseException:
            sock.close()
            raise

    def handler(self, nursery: trio.Nursery) -> Any:
        """The answerer's libp2p handler (wrap it with ``guarded_handler``)."""

        async def handle(stream: Any) -> None:
            asker = str(stream.muxed_conn.peer_id)
            willing = asker < self.discovery.peer_id and asker not in self._busy
            with trio.fail_after(10.0):
                offer = await answer_offer(stream, self.nat, self.discovery.addrs, willing=willing)
            if offer is not None:
                reserved, theirs, token = offer
                self._busy.add(asker)
                nursery.start_soon(self._answer, asker, reserved, theirs, token, nursery)

        return handle

    async def _answer(
        self, asker: str, reserved: socket.socket, theirs: Any, token: bytes, nursery: trio.Nursery
    ) -> None:
        try:
            with trio.fail_after(DEFAULT_SCHEDULE.total_s + _TOKEN_TIMEOUT_S + 5.0):
                sock = await punch_from(reserved, theirs)
                if sock is None:
                    log.info("hole punching a control connection from %s failed", asker)
                    return
                try:
                    await in_thread(_token_on, sock, token, False)
                except BaseException:
                    sock.close()
                    raise
            # no deadline around the adoption: the connection it starts outlives it
            await self._adopt(asker, sock, nursery)
        except (MeshError, trio.TooSlowError, OSError) as exc:
            log.info("punched control connection from %s failed: %r", asker, exc)
        except Exception:
            log.info("punched control connection from %s failed", asker, exc_info=True)
        finally:
            self._busy.discard(asker)


__all__ = ["PUNCH_CONTROL_PROTOCOL", "ControlPuncher"]
