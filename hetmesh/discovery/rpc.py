"""One request, one reply: the control-plane call on a libp2p stream.

Every control RPC of the mesh (session control, pings, the tests' own
protocols) opens a fresh stream, writes one length-prefixed msgpack message
and reads one back (the framing of :mod:`hetmesh.discovery.wire`). This is the
only place that translates libp2p's failures of such a call into our tree:

- :class:`~hetmesh.errors.ConnectTimeout`: the stream did not open, or the
  reply did not come, within ``timeout_s``;
- :class:`~hetmesh.errors.PeerUnreachable`: there is no connection to the peer
  and libp2p could not make one;
- :class:`~hetmesh.errors.StreamReset`: the peer is connected but refused the
  protocol, or the stream broke before the whole reply arrived;
- :class:`~hetmesh.errors.RemoteProtocolError`: the reply is over
  ``max_reply_bytes`` or (for :func:`call`) not a msgpack map.

Callers decide what a failure means (the gateway fails over, a test asserts).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery import wire
from hetmesh.errors import ConnectTimeout, MeshError, PeerUnreachable, StreamReset
from hetmesh.resources import PeerId

if TYPE_CHECKING:
    from libp2p.abc import IHost, INetStream


def connected(host: IHost, peer: PeerId) -> bool:
    """Whether ``host`` holds a connection to ``peer`` now."""
    from libp2p.peer.id import ID

    return ID.from_base58(peer) in host.get_network().connections


async def open_stream(host: IHost, peer: PeerId, protocol: str, *, timeout_s: float) -> INetStream:
    """A new stream to ``peer`` speaking ``protocol`` (libp2p dials if not connected).

    Raises ``ConnectTimeout``, ``PeerUnreachable`` or ``StreamReset`` (see the module).
    """
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    try:
        with trio.fail_after(timeout_s):
            return await host.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
    except trio.TooSlowError:
        raise ConnectTimeout(f"opening {protocol} to {peer} timed out") from None
    except MeshError:
        raise
    except Exception as exc:  # libp2p's dial, security, muxer and multiselect errors
        # a live connection means we reached the peer: it is the protocol that failed
        if connected(host, peer):
            raise StreamReset(f"{peer} refused {protocol}: {exc!r}") from exc
        raise PeerUnreachable(f"cannot open {protocol} to {peer}: {exc!r}") from exc


async def request(
    host: IHost,
    peer: PeerId,
    protocol: str,
    payload: bytes,
    *,
    timeout_s: float,
    max_reply_bytes: int = wire.MAX_STATUS_BYTES,
) -> bytes:
    """Send ``payload`` as one frame and return the reply frame's bytes.

    ``timeout_s`` bounds opening the stream and, again, waiting for the reply.
    """
    stream = await open_stream(host, peer, protocol, timeout_s=timeout_s)
    try:
        await wire.write_frame(stream, payload)
        return await wire.read_frame(stream, max_bytes=max_reply_bytes, timeout_s=timeout_s)
    except trio.TooSlowError:
        raise ConnectTimeout(f"{protocol} to {peer}: no reply in {timeout_s} s") from None
    except MeshError:
        raise
    except Exception as exc:  # a write on a stream the peer reset
        raise StreamReset(f"{protocol} with {peer} failed: {exc!r}") from exc
    finally:
        with contextlib.suppress(Exception):
            await stream.close()


async def call(
    host: IHost,
    peer: PeerId,
    protocol: str,
    message: dict[str, Any],
    *,
    timeout_s: float,
    max_reply_bytes: int = wire.MAX_STATUS_BYTES,
) -> dict[str, Any]:
    """:func:`request` with msgpack maps on both sides."""
    raw = await request(
        host,
        peer,
        protocol,
        wire.encode(message),
        timeout_s=timeout_s,
        max_reply_bytes=max_reply_bytes,
    )
    return wire.decode_map(raw, max_bytes=max_reply_bytes)


__all__ = ["call", "connected", "open_stream", "request"]
