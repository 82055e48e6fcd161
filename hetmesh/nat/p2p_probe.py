"""Link probes over a libp2p stream: RTT and bandwidth where no TCP probe gets through.

Discovery measures links with a plain TCP probe to the peer's announced
address (:mod:`hetmesh.discovery.probe`); a member behind NAT has no address
anyone outside reaches, so its links would stay unmeasured and the planner
would price them as default links. This probe runs the same measurement over
a libp2p stream instead — over a relayed connection that is the relayed path,
relay hop and both routers' uplinks included, which is what the data plane
over that link will get.

Protocol on :data:`P2P_PROBE_PROTOCOL` (the stream is already authenticated):
``b"P"`` pings echoed by ``b"p"``, then ``b"B"`` + an 8-byte length + that
many bytes, answered by ``b"K"`` and the receiver's float64 seconds between
the first quarter's and the last byte's arrival (the tail, as the TCP probe
times it, keeping the start-up burst out of the figure). The receiver's clock is
in user space here, so the asker never reports more than its own whole-transfer
figure (:func:`stream_bandwidth`).
"""

from __future__ import annotations

import statistics
import struct
import time
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery.host import dial
from hetmesh.discovery.probe import LinkMeasurement, TailClock, tail_bandwidth
from hetmesh.discovery.rpc import open_stream
from hetmesh.errors import MeshError, PeerUnreachable, RemoteProtocolError

if TYPE_CHECKING:
    from hetmesh.discovery.service import Discovery

P2P_PROBE_PROTOCOL = "/hetmesh/p2p-probe/1.0.0"
MAX_P2P_PROBE_BYTES = 16 * 1024 * 1024
_LEN = struct.Struct(">Q")
_SECONDS = struct.Struct(">d")
_CHUNK = 256 * 1024


async def _read_exact(stream: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise RemoteProtocolError("probe stream closed early")
        buf += chunk
    return bytes(buf)


async def handle_p2p_probe(stream: Any) -> None:
    """Serve one probe session (a guarded libp2p handler; see ``guarded_handler``)."""
    with trio.move_on_after(30):
        while True:
            op = await stream.read(1)
            if op == b"P":
                await stream.write(b"p")
            elif op == b"B":
                (n,) = _LEN.unpack(await _read_exact(stream, _LEN.size))
                if n > MAX_P2P_PROBE_BYTES:
                    raise RemoteProtocolError(f"probe of {n} bytes")
                clock = TailClock(n)  # user-space arrivals: a stream has no kernel's
                while clock.remaining:
                    chunk = await stream.read(min(clock.remaining, _CHUNK))
                    if not chunk:
                        raise RemoteProtocolError("probe stream closed mid-transfer")
                    clock.read(len(chunk), None)
                await stream.write(b"K" + _SECONDS.pack(clock.seconds()))
            else:
                return


async def probe_over_libp2p(
    discovery: Discovery, peer_id: str, *, nbytes: int, timeout_s: float = 20.0
) -> LinkMeasurement:
    """Measure RTT (median of 5 pings) and bandwidth to ``peer_id`` over a libp2p stream.

    Dials the peer first if needed (through its relay when it announces one).
    Raises :class:`PeerUnreachable` (also on timeout) or :class:`RemoteProtocolError`.
    """
    host = discovery.host
    try:
        with trio.fail_after(timeout_s):
            if peer_id not in {str(p) for p in host.get_network().connections}:
                entry = discovery.table.entries.get(peer_id)
                info = discovery._peer_info(peer_id, entry.addrs if entry else ())
                await dial(host, info, timeout_s=discovery.config.dial_timeout_s)
            stream = await open_stream(host, peer_id, P2P_PROBE_PROTOCOL, timeout_s=timeout_s)
            try:
                rtts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    await stream.write(b"P")
                    await _read_exact(stream, 1)
                    rtts.append(time.perf_counter() - t0)
                rtt = statistics.median(rtts)
                t0 = time.perf_counter()
                await stream.write(b"B" + _LEN.pack(nbytes))
                payload, remaining = bytes(_CHUNK), nbytes
                while remaining:
                    piece = payload[: min(remaining, _CHUNK)]
                    await stream.write(piece)
                    remaining -= len(piece)
                reply = await _read_exact(stream, 1 + _SECONDS.size)
                elapsed = time.perf_counter() - t0
            finally:
                await stream.close()
    except trio.TooSlowError as exc:
        raise PeerUnreachable(f"libp2p link probe to {peer_id} timed out") from exc
    except MeshError:
        raise
    except Exception as exc:  # libp2p's stream errors
        raise PeerUnreachable(f"libp2p link probe to {peer_id} failed: {exc!r}") from exc
    if reply[:1] != b"K":
        raise RemoteProtocolError("probe peer did not acknowledge")
    (tail_s,) = _SECONDS.unpack(reply[1:])
    return LinkMeasurement(rtt_s=rtt, bandwidth_bps=stream_bandwidth(nbytes, tail_s, elapsed))


def stream_bandwidth(nbytes: int, tail_s: float, elapsed_s: float) -> float:
    """The link's rate from one probe over a stream: the receiver's tail figure, never
    above the asker's whole one (``nbytes`` over ``elapsed_s``, from the first byte
    written to the acknowledgement read).

    The receiver reads the stream after the muxer buffered it, so its clock is in user
    space: a receiver that got no CPU for a while drains the backlog at once and times
    it as a fast link (a relayed 12.5 MB/s path once read as 31 MB/s). The asker's
    figure cannot be fooled that way: no acknowledgement comes back before every byte
    has crossed the link.
    """
    return min(tail_bandwidth(nbytes, tail_s, elapsed_s), nbytes / max(elapsed_s, 1e-6))


__all__ = ["P2P_PROBE_PROTOCOL", "handle_p2p_probe", "probe_over_libp2p", "stream_bandwidth"]
