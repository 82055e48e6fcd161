"""The node's libp2p host, built with every fix from LIBP2P.md.

- noise only (no plaintext, no secio, no TLS), yamux, one connection per peer
  (which also removes the 250 ms happy-eyeballs delay on connect);
- the auto-connector is disabled (it redials departed peers forever);
- the private-network key (psk) is derived from the mesh secret, always: a node
  with no secret uses the key of the empty secret, so "missing" and "wrong"
  secrets both fail the same way, fast (:func:`dial` bounds every handshake);
- every stream handler is wrapped by :func:`guarded_handler`: an exception is
  logged and resets that stream only;
- the ``libp2p`` logger is configured after the import that resets it;
- an accepted connection gives back its place under libp2p's inbound cap when
  it closes (:mod:`hetmesh.discovery.inbound`), and a host that stops closes
  its connections (:func:`open_host`);
- the identity is an ed25519 key persisted in the node's data directory.

Callers handle :class:`~hetmesh.errors.AuthenticationFailed`,
:class:`~hetmesh.errors.PeerUnreachable` and :class:`~hetmesh.errors.ConnectTimeout`
from :func:`dial`; nothing else escapes it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from hetmesh.discovery.inbound import release_closed_inbound
from hetmesh.errors import AuthenticationFailed, ConnectTimeout, PeerUnreachable

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.ed25519"
PSK_LABEL = b"hetmesh/pnet/v1\x00"
DEFAULT_DIAL_TIMEOUT_S = 3.0
# how long a host leaving takes at most to close its connections
CLOSE_TIMEOUT_S = 2.0

StreamHandler = Callable[[Any], Awaitable[None]]


def derive_psk(secret: str | None) -> str:
    """The 32-byte private-network key (hex) for a mesh secret; ``None`` means ``""``."""
    return hashlib.sha256(PSK_LABEL + (secret or "").encode()).hexdigest()


def mesh_fingerprint(secret: str | None) -> str:
    """A short public tag of the mesh (safe to broadcast; not the key)."""
    return hashlib.sha256(b"hetmesh/mdns/v1\x00" + derive_psk(secret).encode()).hexdigest()[:10]


def configure_libp2p_logging(level: int = logging.WARNING) -> None:
    """Route the ``libp2p`` logger through ours; call after ``import libp2p``."""
    import libp2p  # noqa: F401  (the import resets the logger; configure after it)

    lg = logging.getLogger("libp2p")
    lg.handlers.clear()
    lg.propagate = True
    lg.setLevel(level)
    # these log routine churn (a peer went away, a redial was refused) as errors;
    # discovery reports membership changes itself
    for noisy in (
        "libp2p.discovery.mdns",
        "libp2p.network.swarm",
        "libp2p.transport",
        "libp2p.stream_muxer",
    ):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


def load_or_create_identity(data_dir: Path) -> Any:
    """The node's ed25519 key pair, created on first use and kept in ``data_dir``."""
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.crypto.keys import KeyPair

    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / IDENTITY_FILE
    if path.exists():
        private = Ed25519PrivateKey.from_bytes(path.read_bytes())
    else:
        private = Ed25519PrivateKey.new()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private.to_bytes())
        tmp.replace(path)
    return KeyPair(private, private.get_public_key())


def new_mesh_host(
    key_pair: Any,
    *,
    psk: str,
    dial_timeout_s: float = DEFAULT_DIAL_TIMEOUT_S,
    negotiate_timeout_s: float | None = None,
) -> Any:
    """A libp2p host: noise only, yamux, one connection per peer, psk, no auto-connector.

    ``negotiate_timeout_s`` bounds agreeing on a protocol for a new stream on a
    connection already open (``dial_timeout_s`` when not given): a client that
    waits minutes for a busy node's answer need not give up on its stream after
    a dial's few seconds.
    """
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    configure_libp2p_logging()
    # py-libp2p's yamux answers every read with a window update (a frame of its
    # own, encrypted and sent) unless told to batch them as go-yamux does (one per
    # half window consumed); membership traffic is many small frames, and the
    # per-read updates were ~a fifth of an idle node's CPU (py-spy, 16 nodes)
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)
    config = ConnectionConfig(
        max_connections_per_peer=1,
        dial_timeout=dial_timeout_s,
        outbound_upgrade_timeout=dial_timeout_s,
        inbound_upgrade_timeout=dial_timeout_s,
        outbound_stream_protocol_negotiation_timeout=negotiate_timeout_s or dial_timeout_s,
        inbound_stream_protocol_negotiation_timeout=negotiate_timeout_s or dial_timeout_s,
    )
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_ID: noise},
        muxer_preference="YAMUX",
        connection_config=config,
        psk=psk,
    )

    async def _no_auto_connect(*_args: Any, **_kwargs: Any) -> None:
        return None

    network = host.get_network()
    auto = getattr(network, "auto_connector", None)
    if auto is not None:
        auto.maybe_connect = _no_auto_connect
        auto.start = _no_auto_connect

        async def _no_background(*_args: Any, **_kwargs: Any) -> None:
            return None

        auto.run_background_task = _no_background

    # libp2p identifies both ends of every new connection (a stream each way and a
    # signed peer record); our members learn addresses and protocols from their
    # records, and at start-up on a loaded machine N nodes meeting at once spent
    # seconds in it (the 3 s identify timeouts in their logs) while probes ran.
    # The identify handler stays: a peer that asks is answered.
    if hasattr(host, "_schedule_identify"):

        def _no_identify(*_args: Any, **_kwargs: Any) -> None:
            return None

        host._schedule_identify = _no_identify
    # an accepted connection frees its place under the inbound cap when it closes
    release_closed_inbound(network)
    return host


@contextlib.asynccontextmanager
async def open_host(
    key_pair: Any,
    *,
    psk: str,
    listen: Sequence[str],
    dial_timeout_s: float = DEFAULT_DIAL_TIMEOUT_S,
    negotiate_timeout_s: float | None = None,
) -> AsyncIterator[Any]:
    """Run a mesh host listening on ``listen`` (multiaddr strings) for the block.

    libp2p runs the block inside its own nursery, which wraps whatever the
    block raises in exception groups; a lone exception is unwrapped here so
    callers see our errors (``InvalidRequest``, ``StreamReset``...) as raised.

    On the way out the host's connections are closed: leaving ``host.run``
    alone cancels the swarm's tasks but leaves its sockets open, so each
    client host a process opened and left (``open_mesh_client``, a status
    poll) kept one connection on the node it dialled, and a node refuses every
    inbound connection once about 250 are held (libp2p's inbound cap).
    """
    from multiaddr import Multiaddr

    host = new_mesh_host(
        key_pair, psk=psk, dial_timeout_s=dial_timeout_s, negotiate_timeout_s=negotiate_timeout_s
    )
    try:
        async with host.run(listen_addrs=[Multiaddr(a) for a in listen]):
            try:
                yield host
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                    await _close_connections(host)
    except BaseExceptionGroup as group:
        lone = _lone_exception(group)
        if lone is None:
            raise
        raise lone from None


async def _close_connections(host: Any) -> None:
    """Close every connection of ``host`` at once (best effort: a peer may be gone
    already). libp2p's yamux sleeps 0.1 s after it closed the socket, twice per
    connection; the host is going away, so each close ends once its muxer is."""

    async def close(conn: Any) -> None:
        closed = getattr(getattr(conn, "muxed_conn", None), "event_closed", None)
        async with trio.open_nursery() as nursery:
            if closed is not None:

                async def until_closed() -> None:
                    await closed.wait()  # set once the socket is closed
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_closed)
            try:
                await conn.close()
            except Exception:
                log.debug("closing a connection failed", exc_info=True)
            nursery.cancel_scope.cancel()

    network = host.get_network()
    async with trio.open_nursery() as nursery:
        for conns in list(network.connections.values()):
            for conn in list(conns):
                nursery.start_soon(close, conn)


def _lone_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The single leaf of nested one-member groups, if that is what ``group`` is."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup):
        if len(inner.exceptions) != 1:
            return None
        inner = inner.exceptions[0]
    return inner


def guarded_handler(name: str, handler: StreamHandler) -> StreamHandler:
    """Wrap a stream handler so that no exception reaches libp2p (it would kill the host).

    The stream is always closed (reset on error); ``trio.Cancelled`` propagates.
    """

    async def wrapped(stream: Any) -> None:
        try:
            await handler(stream)
        except trio.Cancelled:
            with contextlib.suppress(Exception):
                await stream.reset()
            raise
        except Exception:
            log.debug("handler %s failed", name, exc_info=True)
            with contextlib.suppress(Exception):
                await stream.reset()
        else:
            with contextlib.suppress(Exception):
                await stream.close()

    return wrapped


def _tcp_endpoint(addr: Any) -> tuple[str, int] | None:
    for proto in ("ip4", "ip6", "dns4", "dns"):
        with contextlib.suppress(Exception):
            host = addr.value_for_protocol(proto)
            if host:
                return str(host), int(addr.value_for_protocol("tcp"))
    return None


def _reachable(endpoint: tuple[str, int], timeout_s: float) -> bool | None:
    """True: TCP accepted; False: refused/unreachable; None: timed out."""
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return True
    except TimeoutError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ETIMEDOUT,):
            return None
        return False


DialFallback = Callable[[Any, float], Awaitable[bool]]
# per host: how to reach a peer its addresses do not (hetmesh.nat.relay: through a relay)
_dial_fallbacks: weakref.WeakKeyDictionary[Any, DialFallback] = weakref.WeakKeyDictionary()


def set_dial_fallback(host: Any, fallback: DialFallback) -> None:
    """Have :func:`dial` try ``fallback(peer_info, timeout_s)`` when a direct dial fails."""
    _dial_fallbacks[host] = fallback


async def dial(host: Any, peer_info: Any, *, timeout_s: float = DEFAULT_DIAL_TIMEOUT_S) -> None:
    """Connect to a peer within ``timeout_s``, translating failures into our errors.

    A TCP port that accepts but a libp2p handshake that does not complete means
    the two sides do not share the mesh secret: :class:`AuthenticationFailed`.
    When the direct dial fails, the host's dial fallback (a relay) is tried.
    """
    who = str(peer_info.peer_id)
    try:
        with trio.fail_after(timeout_s):
            await host.connect(peer_info)
        return
    except trio.TooSlowError:
        failure: BaseException | None = None
    except Exception as exc:
        failure = exc
    fallback = _dial_fallbacks.get(host)
    if fallback is not None:
        try:
            if await fallback(peer_info, timeout_s):
                return
        except Exception as exc:  # libp2p's upgrade errors included: reported as ours below
            log.debug("dial fallback to %s failed", who, exc_info=True)
            failure = exc
    endpoints = [e for e in map(_tcp_endpoint, peer_info.addrs) if e is not None]
    verdicts = [await trio.to_thread.run_sync(_reachable, e, 1.0) for e in endpoints[:3]]
    if any(v is True for v in verdicts):
        # a mismatched psk hangs (LIBP2P.md), as does a peer too starved to answer
        how = (
            f"did not complete within {timeout_s:.1f} s"
            if failure is None
            else f"failed ({type(failure).__name__}: {str(failure)[:200]})"
        )
        raise AuthenticationFailed(
            f"handshake with {who} at {', '.join(f'{h}:{p}' for h, p in endpoints)} {how}: "
            "the port answers but the peer does not accept us - "
            "the mesh secret differs (or it is not a hetmesh node, or too busy to answer)"
        ) from failure
    if all(v is False for v in verdicts):
        raise PeerUnreachable(f"peer {who} is unreachable at {endpoints}") from failure
    raise ConnectTimeout(f"connecting to {who} timed out after {timeout_s:.1f} s") from failure


def parse_peer_addr(addr: str) -> Any:
    """A PeerInfo from ``/ip4/H/tcp/P/p2p/ID``; ``ValueError`` if it lacks the peer id."""
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    try:
        return info_from_p2p_addr(Multiaddr(addr))
    except Exception as exc:
        raise ValueError(
            f"not a peer address (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID): {addr!r}"
        ) from exc


__all__ = [
    "DEFAULT_DIAL_TIMEOUT_S",
    "configure_libp2p_logging",
    "derive_psk",
    "dial",
    "guarded_handler",
    "load_or_create_identity",
    "mesh_fingerprint",
    "new_mesh_host",
    "open_host",
    "parse_peer_addr",
    "set_dial_fallback",
]
