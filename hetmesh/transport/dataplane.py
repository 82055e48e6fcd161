"""A node's data plane: listeners for every backend, link negotiation, credentials.

See the package docstring for the API and a usage example.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import trio

from hetmesh.errors import (
    AuthenticationFailed,
    ConnectTimeout,
    LocalProtocolError,
    MeshError,
    PeerUnreachable,
    RemoteProtocolError,
    StreamReset,
    TransportError,
)
from hetmesh.nat.punch import punchable_host, reserve_port, simultaneous_open
from hetmesh.nat.punch_plan import (
    DEFAULT_SCHEDULE,
    PUNCH_KEY,
    AttemptSchedule,
    Candidate,
    candidate_of,
    punch_pair,
)
from hetmesh.nat.state import NatState
from hetmesh.transport import handshake
from hetmesh.transport.codec import BufferPool
from hetmesh.transport.credentials import (
    Credential,
    CredentialBook,
    CredentialStatistics,
    link_keys,
)
from hetmesh.transport.frames import (
    DEFAULT_LIMITS,
    ERROR_FALLBACK,
    PREFIX_BYTES,
    Decision,
    Error,
    Frame,
    Hello,
    Limits,
    Offer,
    encode_bytes,
    parse_header,
)
from hetmesh.transport.gate import ConnectionGate
from hetmesh.transport.links import (
    BufferedReader,
    ByteStream,
    FramedStream,
    Link,
    StreamLink,
    TcpLink,
    blocking_framer,
    in_thread,
    tune_tcp,
)
from hetmesh.transport.negotiation import BACKENDS, Choice, choose_backend
from hetmesh.transport.p2p import control_path
from hetmesh.transport.shm import MAX_SEGMENTS, PeerMappings, ShmLink, packet_framer

log = logging.getLogger(__name__)


def host_identity() -> str:
    """Boot id + network namespace: equal exactly when shm and abstract sockets are shared."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unknown-{secrets.token_hex(8)}"
    return f"{boot}/{netns}"


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlaneConfig:
    """How this node offers and accepts data-plane links.

    ``backends`` is the preference order (the listener's order decides);
    ``deny`` removes backends whatever the peer says; ``require_encryption``
    leaves only libp2p; ``gloo`` lets torchdist run on CPU (tests; NCCL is
    used automatically when both ends have it). A direct connection must
    prove its credential within ``preauth_timeout_s``; until then it reads
    only a bounded Hello/Proof, and at most ``max_pending_connections``
    (``max_pending_per_address`` from one address) wait at once: more are
    closed on accept. A peer holding ``max_links_per_peer`` open links that
    it dialed gets no more until one closes. ``spin_us``: links opened
    with ``blocking=True`` poll their socket this long in ``receive_blocking``
    before sleeping (at most that much CPU per receive, yielding to any peer
    on the same CPU); 0 sleeps at once. Async-mode links never poll.
    """

    peer_id: str
    backends: tuple[str, ...] = BACKENDS
    deny: tuple[str, ...] = ()
    require_encryption: bool = False
    gloo: bool = False
    tcp_host: str = "127.0.0.1"
    device: str | None = None  # "cuda:N" to receive NCCL payloads on that device
    limits: Limits = DEFAULT_LIMITS
    handshake_timeout_s: float = 10.0
    # a dialer not yet authenticated: how long it may take, how many may wait (in
    # total and from one address); each waits in trio, holding no worker thread
    preauth_timeout_s: float = 5.0
    max_pending_connections: int = 64
    max_pending_per_address: int = 16
    # open links one peer may hold to us (each costs a reader thread and buffers)
    max_links_per_peer: int = 8
    # tcp links sealed with AES-GCM: "auto" between different hosts (not on one
    # host: loopback, shm), "always", or "never" (the dialer decides; a listener
    # set to "always" refuses a plaintext link)
    tcp_encryption: Literal["auto", "always", "never"] = "auto"
    socket_buffer_bytes: int = 0  # 0: let the kernel autotune
    shm_budget_bytes: int = 2 << 30
    torchdist_timeout_s: float = 60.0
    spin_us: float = 50.0  # a wake-up from recv costs tens of µs on a shared VM
    # over a relayed control connection, try a hole-punched direct tcp link first
    # (hetmesh.nat.punch_plan); where it fails the link rides the relayed stream
    punch: bool = True
    punch_schedule: AttemptSchedule = DEFAULT_SCHEDULE
    # the node's NAT traversal state: the public IP a punch candidate names, where the
    # punched links are noted (None: no candidate is offered)
    nat: NatState | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlaneStatistics:
    peer_id: str
    endpoints: tuple[tuple[str, str], ...]
    links_opened: dict[str, int]
    connections_refused: int
    credentials: CredentialStatistics
    pending_connections: int = 0  # accepted, not yet authenticated
    choices: tuple[str, ...] = field(default=())  # the reason of every link, newest last


@dataclass(slots=True)
class _Waiting:
    choice: Choice
    remote_peer_id: str
    delivered: trio.MemoryReceiveChannel[Link]
    deliver: trio.MemorySendChannel[Link]


class DataPlane:
    """Negotiates and opens links. Create with :func:`open_data_plane`."""

    def __init__(self, config: DataPlaneConfig, nursery: trio.Nursery) -> None:
        self.config = config
        self._nursery = nursery
        self.book = CredentialBook(config.peer_id)
        self._endpoints: dict[str, str] = {}
        self._waiting: dict[bytes, _Waiting] = {}
        self._opened: dict[str, int] = {}
        self._refused = 0
        self._gate = ConnectionGate(config.max_pending_connections, config.max_pending_per_address)
        self._choices: list[str] = []
        self._accepted: dict[str, list[Link]] = {}  # links peers dialed, by peer
        # what each peer's shm links map here, in all: two links' worth
        self._mappings = PeerMappings(2 * MAX_SEGMENTS, 2 * config.shm_budget_bytes)
        self._host_id = host_identity()
        self._cuda = bool(config.device and config.device.startswith("cuda"))

    # --- offers ------------------------------------------------------------------
    def offer(self, credential: Credential | None = None, punch: Candidate | None = None) -> Offer:
        from hetmesh.transport.torchdist import nccl_available

        c = self.config
        endpoints = dict(self._endpoints)
        if punch is not None:
            endpoints[PUNCH_KEY] = str(punch)
        return Offer(
            peer_id=c.peer_id,
            host_id=self._host_id,
            backends=c.backends,
            endpoints=tuple(sorted(endpoints.items())),
            cuda=self._cuda,
            nccl=self._cuda and nccl_available(),
            gloo=c.gloo,
            deny=c.deny,
            require_encryption=c.require_encryption,
            credential_id=credential.credential_id if credential else b"",
            credential_secret=credential.secret if credential else b"",
        )

    def statistics(self) -> DataPlaneStatistics:
        return DataPlaneStatistics(
            peer_id=self.config.peer_id,
            endpoints=tuple(sorted(self._endpoints.items())),
            links_opened=dict(self._opened),
            connections_refused=self._refused,
            credentials=self.book.statistics(),
            pending_connections=self._gate.statistics().pending,
            choices=tuple(self._choices[-32:]),
        )

    def _record(self, link: Link, reason: str, blocking: bool) -> Link:
        link_start(link, blocking, self.config.spin_us)
        link.reason = reason
        self._opened[link.backend.value] = self._opened.get(link.backend.value, 0) + 1
        self._choices.append(f"{link.remote_peer_id}: {reason}")
        nat = self.config.nat
        if "hole-punched" in reason and nat is not None:  # status marks it (nat.relay)
            nat.note_punched(link.remote_peer_id, lambda: not link.statistics().closed)
        log.info("data-plane link to %s: %s", link.remote_peer_id, reason)
        return link

    # --- dialer --------------------------------------------------------------------
    async def connect(
        self,
        control: ByteStream,
        *,
        expected_peer_id: str | None = None,
        blocking: bool = False,
    ) -> Link:
        """Open a link to the peer at the other end of ``control`` (we dial).

        ``control`` is an authenticated byte stream (``send_all``,
        ``receive_some``, ``aclose``): a libp2p stream through
        :class:`~hetmesh.transport.p2p.Libp2pStream`, or a trio stream. If
        libp2p is chosen, the control stream becomes the link; otherwise it
        can be closed once this returns. ``blocking=True`` makes a link whose
        frames are read with ``receive_blocking()`` from one worker thread
        (socket backends only; see :class:`~hetmesh.transport.links.ThreadedLink`).
        Raises :class:`AuthenticationFailed`,
        :class:`PeerUnreachable`, :class:`ConnectTimeout`,
        :class:`RemoteProtocolError`.
        """
        # a relayed or hole-punched control connection: the peer is behind NAT
        path = control_path(getattr(control, "stream", None))
        reservation = self._reserve_punch(path != "direct")
        try:
            return await self._connect(control, reservation, path, expected_peer_id, blocking)
        finally:
            if reservation is not None:
                reservation[0].close()

    async def _connect(
        self,
        control: ByteStream,
        reservation: tuple[socket.socket, Candidate] | None,
        path: str,
        expected_peer_id: str | None,
        blocking: bool,
    ) -> Link:
        relayed = path != "direct"
        framed = FramedStream(control, self.config.limits)
        timeout = self.config.handshake_timeout_s
        mine = self.offer(punch=reservation[1] if reservation else None)
        try:
            with trio.fail_after(timeout):
                await framed.send(mine)
                theirs = await framed.receive()
        except trio.TooSlowError:
            raise ConnectTimeout("no offer from the peer") from None
        if isinstance(theirs, Error):
            raise PeerUnreachable(f"the peer refused a link: {theirs.message}")
        if not isinstance(theirs, Offer) or not theirs.credential_id:
            raise RemoteProtocolError("expected the listener's offer with a credential")
        if expected_peer_id is not None and theirs.peer_id != expected_peer_id:
            raise AuthenticationFailed(f"control stream peer is {theirs.peer_id!r}")
        credential = Credential(
            theirs.credential_id, theirs.credential_secret, self.config.peer_id, theirs.peer_id
        )
        choice = _choose(relayed, mine, theirs)
        reason = choice.reason
        link: Link | None = None
        pair = punch_pair(relayed, choice.backend, mine.endpoints, theirs.endpoints)
        if relayed:
            # the peer is behind NAT, reached through a relay: none of its direct
            # endpoints is reachable from here, so the link rides the relayed stream
            # unless a hole punched through both routers gives a direct one
            if reservation is not None and pair is not None:
                link = await self._punch_dial(reservation[0], pair[1], credential, theirs.peer_id)
            if link is not None and pair is not None:
                reason = f"tcp: hole-punched {pair[0]} <-> {pair[1]} (the control connection"
                reason += f" is {path})"
            else:
                choice = choose_backend(mine, _only_libp2p(theirs))
                reason = f"{choice.reason}; the control connection is {path}"
                if pair is not None:
                    reason += "; hole punching failed"
                elif reservation is None:
                    reason += "; no hole punch (no public mapping known here)"
                else:
                    reason += "; no hole punch (the peer offered no candidate)"
        if link is None and choice.backend and choice.backend != "libp2p":
            try:
                with trio.fail_after(timeout + self.config.torchdist_timeout_s):
                    link = await self._dial(choice, credential, theirs.peer_id)
            except (TransportError, OSError, trio.TooSlowError) as exc:
                if isinstance(exc, AuthenticationFailed):
                    raise
                # the direct path failed: the encrypted control stream is the one left
                skip = choose_backend(self.offer(), _only_libp2p(theirs))
                log.warning(
                    "%s link to %s failed (%r); trying %s",
                    choice.backend,
                    theirs.peer_id,
                    exc,
                    skip.backend or "nothing",
                )
                if skip.backend != "libp2p":
                    await framed.send(Error(code=ERROR_FALLBACK, message=repr(exc)))
                    raise PeerUnreachable(f"{choice.backend} failed: {exc!r}") from exc
                choice = skip
                reason = f"libp2p: {choice.reason}; fell back after {exc!r}"
        if not choice.backend:
            await framed.send(Error(code=ERROR_FALLBACK, message=reason))
            raise PeerUnreachable(reason)
        sealed = isinstance(link, TcpLink) and self._encrypts(theirs)
        if sealed:
            assert isinstance(link, TcpLink)
            link.seal()
            reason += "; sealed (AES-256-GCM)"
        await framed.send(Decision(backend=choice.backend, reason=reason, encrypted=sealed))
        if link is None:
            with trio.fail_after(timeout):
                await handshake.dial_async(framed.send, framed.receive, credential)
            link = StreamLink(framed, theirs.peer_id)
        return self._record(link, reason, blocking)

    def _reserve_punch(self, relayed: bool) -> tuple[socket.socket, Candidate] | None:
        """A local port held for a punch and our candidate, when this link may punch."""
        c = self.config
        ip = c.nat.public_ip if c.nat is not None else None
        if not (relayed and c.punch and ip and punchable_host(c.tcp_host)):
            return None
        try:
            sock = reserve_port(c.tcp_host)
        except OSError as exc:
            log.warning("no local port for hole punching: %r", exc)
            return None
        # a port-preserving (cone) router maps our port to the same public port
        return sock, Candidate(ip, sock.getsockname()[1])

    async def _punch(self, reserved: socket.socket, remote: Candidate) -> socket.socket | None:
        local = reserved.getsockname()[:2]
        schedule = self.config.punch_schedule
        with trio.move_on_after(schedule.total_s + schedule.timeout_s):
            return await in_thread(simultaneous_open, local, remote, schedule)
        return None

    async def _punch_dial(
        self, reserved: socket.socket, remote: Candidate, credential: Credential, peer: str
    ) -> Link | None:
        """The dialer's punch: a direct tcp link proven with the credential, or None."""
        c = self.config
        sock = await self._punch(reserved, remote)
        if sock is None:
            log.info("hole punching to %s (%s) failed: the link stays relayed", peer, remote)
            return None
        try:
            with trio.fail_after(c.handshake_timeout_s):
                reader, nonces = await in_thread(
                    _prove_tcp,
                    sock,
                    credential,
                    c.limits,
                    c.socket_buffer_bytes,
                    c.handshake_timeout_s,
                )
        except (TransportError, OSError, trio.TooSlowError) as exc:
            # whoever answered at the candidate could not complete the handshake (even
            # a wrong proof): the authenticated relayed stream is still there to use
            sock.close()
            log.warning("punched connection to %s failed its handshake: %r", peer, exc)
            return None
        to_listener, to_dialer = link_keys(credential, *nonces)
        return TcpLink(sock, peer, c.limits, reader, (to_listener, to_dialer))

    async def _punch_accept(self, reserved: socket.socket, remote: Candidate) -> None:
        """The listener's punch: the connection is authenticated like an accepted one."""
        try:
            sock = await self._punch(reserved, remote)
        finally:
            reserved.close()
        if sock is None:
            return
        if not self._gate.admit(remote.ip):
            self._refused += 1
            sock.close()
            return
        await self._handle(trio.socket.from_stdlib_socket(sock), remote.ip, True)

    async def _dial(self, choice: Choice, credential: Credential, peer: str) -> Link:
        c = self.config
        if choice.backend == "shm":
            return await in_thread(
                dial_shm,
                choice.endpoint,
                credential,
                peer,
                c.limits,
                c.shm_budget_bytes,
                c.handshake_timeout_s,
                self._mappings,
            )
        sock, reader, nonces = await in_thread(
            _dial_tcp,
            choice.endpoint,
            credential,
            c.limits,
            c.socket_buffer_bytes,
            c.handshake_timeout_s,
        )
        if choice.backend == "tcp":
            to_listener, to_dialer = link_keys(credential, *nonces)
            link: Link = TcpLink(sock, peer, c.limits, reader, (to_listener, to_dialer))
        else:
            link = await in_thread(_torchdist_dial, sock, reader, credential, c)
        return link

    # --- listener ------------------------------------------------------------------
    async def accept(
        self,
        control: ByteStream,
        *,
        expected_peer_id: str | None = None,
        blocking: bool = False,
    ) -> Link:
        """Accept a link from the peer at the other end of ``control`` (they dial).

        Same errors as :meth:`connect`. The credential is one-time and is
        retired whatever the outcome.
        """
        framed = FramedStream(control, self.config.limits)
        timeout = self.config.handshake_timeout_s
        with trio.fail_after(timeout):
            theirs = await framed.receive()
        if not isinstance(theirs, Offer):
            raise RemoteProtocolError("expected the dialer's offer")
        if expected_peer_id is not None and theirs.peer_id != expected_peer_id:
            raise AuthenticationFailed(f"control stream peer is {theirs.peer_id!r}")
        held = self._accepted.get(theirs.peer_id, [])
        held[:] = [link for link in held if not link.statistics().closed]
        if len(held) >= self.config.max_links_per_peer:
            message = f"{len(held)} links open already"
            await framed.send(Error(code=ERROR_FALLBACK, message=message))
            raise TransportError(f"peer {theirs.peer_id!r} has {message}")
        credential = self.book.issue(theirs.peer_id)
        relayed = control_path(getattr(control, "stream", None)) != "direct"
        reservation = self._reserve_punch(relayed)
        mine = self.offer(credential, punch=reservation[1] if reservation else None)
        choice = _choose(relayed, theirs, mine)
        pair = punch_pair(relayed, choice.backend, mine.endpoints, theirs.endpoints)
        send, receive = trio.open_memory_channel[Link](1)
        self._waiting[credential.credential_id] = _Waiting(choice, theirs.peer_id, receive, send)
        try:
            await framed.send(mine)
            if reservation is not None and pair is not None:
                # the dialer punches as soon as it has our offer: so do we
                self._nursery.start_soon(self._punch_accept, reservation[0], pair[1])
                reservation = None  # the punch task closes it
            with trio.fail_after(timeout + self.config.torchdist_timeout_s):
                decision = await framed.receive()
                if isinstance(decision, Error):
                    raise PeerUnreachable(f"dialer gave up: {decision.message}")
                if not isinstance(decision, Decision):
                    raise RemoteProtocolError("expected the dialer's decision")
                if (
                    decision.backend == "libp2p"
                    and "libp2p" in mine.backends
                    and "libp2p" not in mine.deny
                ):
                    await handshake.listen_async(
                        framed.send, framed.receive, self._verifier(theirs.peer_id)
                    )
                    link: Link = StreamLink(framed, theirs.peer_id)
                else:
                    if decision.backend != choice.backend:
                        raise RemoteProtocolError(
                            f"dialer chose {decision.backend}, we computed {choice.backend}"
                        )
                    link = await receive.receive()
                    self._seal_accepted(link, decision, theirs)
                self._accepted.setdefault(theirs.peer_id, []).append(link)
                return self._record(link, decision.reason, blocking)
        except trio.TooSlowError:
            raise ConnectTimeout("the dialer did not complete the link in time") from None
        finally:
            if reservation is not None:
                reservation[0].close()
            self._waiting.pop(credential.credential_id, None)
            self.book.consume(credential.credential_id)
            while True:  # a link delivered after we gave up must not leak
                try:
                    late = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                self._nursery.start_soon(late.aclose)

    def _encrypts(self, theirs: Offer) -> bool:
        """Whether a tcp link with the peer of ``theirs`` is sealed (the dialer's rule)."""
        mode = self.config.tcp_encryption
        if self.config.require_encryption or theirs.require_encryption:  # issue 45
            return True
        return mode == "always" or (mode == "auto" and theirs.host_id != self._host_id)

    def _seal_accepted(self, link: Link, decision: Decision, theirs: Offer) -> None:
        """Seal an accepted link as the dialer decided (before it reads anything)."""
        if not isinstance(link, TcpLink):
            if decision.encrypted:
                raise RemoteProtocolError(f"only tcp links are sealed, not {link.backend}")
            return
        if decision.encrypted:
            link.seal()
        elif self.config.tcp_encryption == "always" or self.config.require_encryption:
            raise RemoteProtocolError("the dialer would not seal a link we require sealed")

    def _verifier(self, dialer_id: str | None) -> handshake.Verifier:
        def verify(hello: Hello, nonce: bytes, mac: bytes) -> Credential | None:
            if dialer_id is not None and hello.peer_id != dialer_id:
                self.book.lookup(hello.credential_id)
                return None
            return self.book.verify(hello.credential_id, hello.peer_id, hello.nonce, nonce, mac)

        return verify

    async def _serve_tcp(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await listener.bind((self.config.tcp_host, 0))
        listener.listen(128)
        host, port = listener.getsockname()[:2]
        self._endpoints["tcp"] = self._endpoints["torchdist"] = f"{host}:{port}"
        task_status.started()
        await self._accept_loop(listener, stream=True)

    async def _serve_shm(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        name = f"\0hetmesh-shm-{secrets.token_hex(12)}"
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        await listener.bind(name)
        listener.listen(128)
        self._endpoints["shm"] = name[1:]
        task_status.started()
        await self._accept_loop(listener, stream=False)

    async def _accept_loop(self, listener: trio.socket.SocketType, *, stream: bool) -> None:
        with listener:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, address = await listener.accept()
                    except OSError as exc:
                        # out of descriptors or memory: the node keeps serving and
                        # tries again once pending connections have gone
                        log.warning("data-plane accept failed: %r", exc)
                        await trio.sleep(0.1)
                        continue
                    # a unix socket's peer has no address: one bucket for the host
                    source = address[0] if isinstance(address, tuple) else "local"
                    if not self._gate.admit(source):
                        self._refused += 1  # closed before a byte of it is read
                        conn.close()
                        continue
                    nursery.start_soon(self._handle, conn, source, stream)

    async def _handle(self, conn: trio.socket.SocketType, source: str, stream: bool) -> None:
        """One incoming data connection: authenticate it, then hand the link to ``accept``.

        Until the dialer has proven its credential this runs in trio on a
        bounded read (no worker thread, ``preauth_timeout_s``); only then is
        the socket handed to a thread to become a link.
        """
        c = self.config
        sock: socket.socket | None = None
        try:
            try:
                with trio.fail_after(c.preauth_timeout_s):
                    credential, waiting, keys = await self._authenticate(conn, stream)
            finally:
                self._gate.release(source)
            sock = socket.socket(fileno=conn.detach())
            setup = self._setup_tcp if stream else self._setup_shm
            with trio.fail_after(c.handshake_timeout_s + c.torchdist_timeout_s):
                link = await in_thread(setup, sock, credential, waiting, keys)
        except (MeshError, OSError, trio.TooSlowError) as exc:
            self._refused += 1
            log.warning("refused a data connection from %s: %r", source, exc)
            _close(conn, sock)
            return
        except Exception:
            self._refused += 1
            log.exception("data connection handler failed")
            _close(conn, sock)
            return
        try:
            waiting.deliver.send_nowait(link)
        except (trio.WouldBlock, trio.BrokenResourceError):
            await link.aclose()

    async def _authenticate(
        self, conn: trio.socket.SocketType, stream: bool
    ) -> tuple[Credential, _Waiting, tuple[bytes, bytes]]:
        """The listener's half of the handshake, reading only bounded Hello/Proof frames."""
        limits = self.config.limits

        async def send(frame: Frame) -> None:
            data = memoryview(encode_bytes(frame, limits))
            while data:  # a packet socket takes the whole frame in one send
                data = data[await conn.send(data) :]

        async def receive() -> Frame:
            if stream:
                head = handshake.check_preauth_head(await _receive_exact(conn, PREFIX_BYTES))
                header = await _receive_exact(conn, head.header_bytes)
            else:
                packet = await conn.recv(PREFIX_BYTES + handshake.PREAUTH_LIMITS.max_header_bytes)
                if not packet:
                    raise StreamReset("peer closed the doorbell socket")
                return handshake.parse_preauth(packet)
            return parse_header(head, header, handshake.PREAUTH_LIMITS).build()

        credential, hello, nonce = await handshake.listen_async(send, receive, self._verifier(None))
        waiting = self._waiting.get(credential.credential_id)
        if waiting is None:
            raise AuthenticationFailed("credential is no longer awaited")
        to_listener, to_dialer = link_keys(credential, hello.nonce, nonce)
        return credential, waiting, (to_dialer, to_listener)

    def _setup_tcp(
        self,
        sock: socket.socket,
        credential: Credential,
        waiting: _Waiting,
        keys: tuple[bytes, bytes],
    ) -> Link:
        c = self.config
        sock.settimeout(c.handshake_timeout_s)
        tune_tcp(sock, c.socket_buffer_bytes)
        # the handshake read exactly its frames: nothing of the peer's is buffered yet
        reader = BufferedReader(sock, c.limits, BufferPool())
        if waiting.choice.backend == "torchdist":
            from hetmesh.transport.torchdist import TorchDistLink, listen_group

            pg, store = listen_group(
                sock,
                credential.credential_id.hex(),
                c.tcp_host,
                c.torchdist_timeout_s,
                c.device if self._cuda else None,
            )
            sock.settimeout(None)
            link: Link = TorchDistLink(
                sock,
                reader,
                pg,
                store,
                0,
                waiting.remote_peer_id,
                c.limits,
                c.device if self._cuda else None,
            )
            return link
        if waiting.choice.backend != "tcp":
            raise AuthenticationFailed("credential was issued for another backend")
        sock.settimeout(None)
        return TcpLink(sock, waiting.remote_peer_id, c.limits, reader, keys)

    def _setup_shm(
        self,
        sock: socket.socket,
        credential: Credential,
        waiting: _Waiting,
        keys: tuple[bytes, bytes],
    ) -> Link:
        c = self.config
        if waiting.choice.backend != "shm":
            raise AuthenticationFailed("credential was issued for another backend")
        sock.settimeout(None)
        return ShmLink(
            sock,
            waiting.remote_peer_id,
            c.limits,
            budget_bytes=c.shm_budget_bytes,
            mappings=self._mappings,
        )


def _close(conn: trio.socket.SocketType, sock: socket.socket | None) -> None:
    conn.close()
    if sock is not None:  # the descriptor moved to it once authenticated
        sock.close()


async def _receive_exact(conn: trio.socket.SocketType, n: int) -> bytes:
    """Exactly ``n`` bytes (no read-ahead: what follows is the link's)."""
    data = b""
    while len(data) < n:
        chunk = await conn.recv(n - len(data))
        if not chunk:
            raise StreamReset("peer closed the connection")
        data += chunk
    return data


def link_start(link: Link, blocking: bool, spin_us: float = 0.0) -> None:
    start = getattr(link, "start", None)
    if start is not None:
        start(blocking, spin_us)
    elif blocking:
        raise LocalProtocolError(f"{link.backend} links have no blocking mode")


def _choose(relayed: bool, dialer: Offer, listener: Offer) -> Choice:
    """The backend rule, except that a link both ends would hole-punch is plain tcp
    (a punched socket carries no shm doorbell nor torchdist store)."""
    both = candidate_of(dialer.endpoints) and candidate_of(listener.endpoints)
    if relayed and both:
        from dataclasses import replace

        dialer = replace(dialer, deny=(*dialer.deny, "shm", "torchdist"))
        listener = replace(listener, deny=(*listener.deny, "shm", "torchdist"))
    return choose_backend(dialer, listener)


def _only_libp2p(offer: Offer) -> Offer:
    """``offer`` with every backend but libp2p denied (the fallback after a failed dial)."""
    from dataclasses import replace

    others = tuple(b for b in BACKENDS if b != "libp2p")
    return replace(offer, deny=(*offer.deny, *others))


def dial_tcp(
    endpoint: str, credential: Credential, limits: Limits, buffer_bytes: int, timeout_s: float
) -> socket.socket:
    """Blocking: connect to a tcp endpoint and prove the credential."""
    return _dial_tcp(endpoint, credential, limits, buffer_bytes, timeout_s)[0]


def _dial_tcp(
    endpoint: str, credential: Credential, limits: Limits, buffer_bytes: int, timeout_s: float
) -> tuple[socket.socket, BufferedReader, tuple[bytes, bytes]]:
    """:func:`dial_tcp`, the reader the handshake used (the link must keep reading
    through it: the listener's next frame may already be in its buffer) and the
    handshake's (dialer, listener) nonces."""
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except TimeoutError as exc:
        raise ConnectTimeout(f"tcp connect to {endpoint} timed out") from exc
    except (OSError, ValueError) as exc:
        raise PeerUnreachable(f"tcp connect to {endpoint} failed: {exc}") from exc
    try:
        reader, nonces = _prove_tcp(sock, credential, limits, buffer_bytes, timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock, reader, nonces


def _prove_tcp(
    sock: socket.socket, credential: Credential, limits: Limits, buffer_bytes: int, timeout_s: float
) -> tuple[BufferedReader, tuple[bytes, bytes]]:
    """Blocking: the dialer's handshake on a connected socket (dialled or hole-punched)."""
    sock.settimeout(timeout_s)
    tune_tcp(sock, buffer_bytes)
    reader = BufferedReader(sock, limits, BufferPool())
    nonces = handshake.dial_blocking(*blocking_framer(sock, limits, reader), credential)
    sock.settimeout(None)
    return reader, nonces


def _torchdist_dial(
    sock: socket.socket, reader: BufferedReader, credential: Credential, c: DataPlaneConfig
) -> Link:
    from hetmesh.transport.torchdist import TorchDistLink, dial_group, nccl_available

    device = c.device if c.device and c.device.startswith("cuda") and nccl_available() else None
    # the handshake's reader: the listener sends the store endpoint right after its
    # proof, so both may have arrived in one recv (a fresh reader lost the endpoint
    # and waited out the 60 s timeout)
    sock.settimeout(c.torchdist_timeout_s)
    pg, store = dial_group(
        reader, credential.credential_id.hex(), c.tcp_host, c.torchdist_timeout_s, device
    )
    sock.settimeout(None)
    return TorchDistLink(sock, reader, pg, store, 1, credential.listener_id, c.limits, device)


def dial_shm(
    endpoint: str,
    credential: Credential,
    peer: str,
    limits: Limits,
    budget_bytes: int,
    timeout_s: float,
    mappings: PeerMappings | None = None,
) -> ShmLink:
    """Blocking: connect to a shm doorbell socket and prove the credential."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + endpoint)
        handshake.dial_blocking(*packet_framer(sock, limits), credential)
        sock.settimeout(None)
    except OSError as exc:
        sock.close()
        raise PeerUnreachable(f"shm connect to {endpoint!r} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return ShmLink(sock, peer, limits, budget_bytes=budget_bytes, mappings=mappings)


@contextlib.asynccontextmanager
async def open_data_plane(config: DataPlaneConfig) -> AsyncIterator[DataPlane]:
    """Start this node's data-plane listeners; yields the :class:`DataPlane`."""
    if not config.peer_id:
        raise LocalProtocolError("a data plane needs our peer id")
    try:
        async with trio.open_nursery() as nursery:
            plane = DataPlane(config, nursery)
            usable = set(config.backends) - set(config.deny)
            if usable & {"tcp", "torchdist"}:  # under require_encryption: tcp, sealed
                await nursery.start(plane._serve_tcp)
            if "shm" in usable and not config.require_encryption:
                await nursery.start(plane._serve_shm)
            try:
                yield plane
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The listeners only stop by cancellation: surface the body's own error unwrapped.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


__all__ = [
    "DataPlane",
    "DataPlaneConfig",
    "DataPlaneStatistics",
    "dial_shm",
    "dial_tcp",
    "host_identity",
    "open_data_plane",
]
