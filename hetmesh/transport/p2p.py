"""libp2p glue for the data plane: a byte-stream adapter and a minimal host.

:class:`Libp2pStream` turns a libp2p ``INetStream`` into the trio-style byte
stream the data plane negotiates over (``send_all`` / ``receive_some`` /
``aclose``), translating libp2p's exceptions and chunking writes (yamux
refuses frames over 16 MiB). :func:`open_p2p_host` runs a noise-only, yamux,
one-connection-per-peer host without the auto-connector (LIBP2P.md
pitfalls 1, 2, 4); discovery has its own host helper and the two may be
folded together. :func:`guarded` wraps a stream handler so nothing it raises
reaches libp2p (pitfall 3).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from hetmesh.errors import StreamReset

log = logging.getLogger(__name__)
PROTOCOL_ID = "/hetmesh/dataplane/1"
_CHUNK = 1 << 20


# the attributes a libp2p stream's connection layers hold the layer below in
_INNER = ("muxed_conn", "secured_conn", "conn", "_conn", "_wrapped", "stream")


# set on the byte stream under a libp2p connection hole-punched through NAT
# (hetmesh.nat.punch_control): like a relayed one, it reaches a peer whose
# announced endpoints sit behind its router
PUNCHED_MARK = "_hetmesh_punched"


def control_path(stream: Any) -> str:
    """How a libp2p stream's connection reaches the peer: ``relayed`` (through a relay,
    hetmesh.nat.relay), ``hole-punched`` (a punched TCP connection,
    hetmesh.nat.punch_control) or ``direct``.

    Walks the layers under the stream (yamux, noise, private network) down to
    the raw connection and the byte stream under it; anything unexpected reads
    as direct.
    """
    seen: set[int] = set()
    layer = stream
    for _ in range(12):
        if layer is None or id(layer) in seen:
            return "direct"
        seen.add(id(layer))
        kind = getattr(layer, "_connection_type", None)
        if getattr(kind, "name", "") == "RELAYED":
            return "relayed"
        if getattr(layer, PUNCHED_MARK, False) is True:
            return "hole-punched"
        layer = next(
            (getattr(layer, a) for a in _INNER if getattr(layer, a, None) is not None), None
        )
    return "direct"


def connection_is_relayed(stream: Any) -> bool:
    """Whether a libp2p stream's connection crosses NAT (relayed or hole-punched): the
    peer's announced endpoints are then not dialable, so the data plane punches a
    link of its own or rides the stream (see :func:`control_path`)."""
    return control_path(stream) != "direct"


class Libp2pStream:
    """A libp2p stream as a trio-style byte stream."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._read_cut = False  # a read was cancelled: bytes may have been lost

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        from libp2p.network.stream.exceptions import StreamError

        view = memoryview(data)
        try:
            for i in range(0, len(view), _CHUNK):
                await self.stream.write(bytes(view[i : i + _CHUNK]))
        except StreamError as exc:
            raise StreamReset(f"libp2p stream failed: {exc!r}") from exc

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        """The next bytes (``b""`` at EOF). :class:`StreamReset` if the stream broke.

        Not cancel-safe underneath: py-libp2p's yamux ``read`` can take bytes
        from its buffer and then be cancelled at a later checkpoint, losing
        them. So a cancelled read ends reading: every later call raises
        :class:`StreamReset` rather than hand out bytes with a gap in them.
        """
        from libp2p.network.stream.exceptions import StreamEOF, StreamError

        if self._read_cut:
            raise StreamReset("an earlier read on this libp2p stream was cancelled")
        try:
            return bytes(await self.stream.read(max_bytes))
        except StreamEOF:
            return b""
        except StreamError as exc:
            raise StreamReset(f"libp2p stream failed: {exc!r}") from exc
        except trio.Cancelled:
            self._read_cut = True
            raise

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.stream.close()


def guarded(handler: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """A stream handler that never lets an exception reach libp2p (it would kill the host)."""

    async def wrapped(stream: Any) -> None:
        try:
            await handler(stream)
        except trio.Cancelled:
            with contextlib.suppress(Exception):
                await stream.reset()
            raise
        except Exception:
            log.warning("data-plane stream handler failed", exc_info=True)
            with contextlib.suppress(Exception):
                await stream.reset()

    return wrapped


@contextlib.asynccontextmanager
async def open_p2p_host(listen: str = "/ip4/127.0.0.1/tcp/0") -> AsyncIterator[Any]:
    """A running noise-only libp2p host with a fresh identity (tests and benchmarks)."""
    from libp2p import generate_new_ed25519_identity, new_host
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from multiaddr import Multiaddr

    logging.getLogger("libp2p").setLevel(logging.ERROR)
    key_pair = generate_new_ed25519_identity()
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_ID: NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)},
        muxer_preference="YAMUX",
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )

    async def _nothing(*_args: Any, **_kwargs: Any) -> None:
        return None

    auto = getattr(host.get_network(), "auto_connector", None)
    if auto is not None:
        auto.maybe_connect = _nothing
    async with host.run(listen_addrs=[Multiaddr(listen)]):
        yield host


def p2p_address(host: Any) -> str:
    """The host's first listen address with its peer id (``/ip4/.../p2p/<id>``)."""
    return f"{host.get_addrs()[0]}"


async def p2p_connect(host: Any, address: str) -> Libp2pStream:
    """Connect to ``address`` and open a data-plane stream."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    info = info_from_p2p_addr(Multiaddr(address))
    await host.connect(info)
    stream = await host.new_stream(info.peer_id, [TProtocol(PROTOCOL_ID)])
    return Libp2pStream(stream)
