"""A paced sender for probe tests: a shaped link emulated on a loopback socket."""

from __future__ import annotations

import socket
import struct
import time

RATE = 8e6  # bytes/s the paced sender keeps to (a shaped link)
NBYTES = 4 * 1024 * 1024


def paced_sender(port: int, out: dict[str, float], prefix: bytes = b"") -> None:
    """Send ``prefix``, then ``NBYTES`` at ``RATE`` (like a token bucket: time lost is
    not made up), then read the probe's ``b"K"`` and tail seconds into ``out["tail_s"]``.

    A loaded machine can slow the sender below ``RATE``; ``out["sent_bps"]`` is
    the rate it really kept over the three quarters the probe times.
    """
    chunk = bytes(64 * 1024)
    count = NBYTES // len(chunk)
    sent_at: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(prefix)
        due = time.perf_counter()
        for _ in range(count):
            due = max(due, time.perf_counter()) + len(chunk) / RATE
            sock.sendall(chunk)  # returns at once: the receive buffer holds it all
            sent_at.append(time.perf_counter())
            time.sleep(max(0.0, due - time.perf_counter()))
        reply = b""
        while len(reply) < 9:
            reply += sock.recv(9 - len(reply))
        assert reply[:1] == b"K"
        (out["tail_s"],) = struct.unpack(">d", reply[1:])
    first = count // 4  # the probe's clock starts once a quarter has arrived
    out["sent_bps"] = (count - first) * len(chunk) / (sent_at[-1] - sent_at[first - 1])


def backlog_listener() -> socket.socket:
    """A loopback listener whose connections can buffer a whole probe unread."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)  # room for a backlog
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener
