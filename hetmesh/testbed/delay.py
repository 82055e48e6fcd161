"""A link with latency for the testbed: two TAP devices joined by a process that waits.

The kernels our testbeds run on have no ``netem`` (``../shared/TESTBED.md``),
so a host's access link cannot be given a delay by ``tc``. Instead of a veth
pair, such a host gets two TAP devices: ``eth0`` in its namespace and its
port on the bridge in the bridge's namespace, and this process copies every
Ethernet frame from one to the other ``delay_s`` after it arrived, in both
directions, in order. Between two hosts so linked a packet waits twice each
way: the round trip is ``2 × (delay_a + delay_b)``.

Run as ``python -m hetmesh.testbed.delay NETNS_A NAME_A NETNS_B NAME_B DELAY_S``
(namespace paths under /run/netns) by root; it prints ``ready`` once both
devices exist and copies until it is killed or its parent goes. Python's
timers on a loaded machine add up to a millisecond or two to each wait.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import os
import select
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_MAX_FRAME = 65536
_MAX_QUEUED = 4096  # frames held per direction; past it a frame is dropped, as a full queue would


def setns(path: str) -> None:
    """Move this thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tap(name: str) -> int:
    """Create TAP device ``name`` in the current namespace; it lives while the fd is open."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def be_on_time() -> None:
    """Wake as soon as a frame is due, however loaded the machine: a real-time
    priority (the process sleeps in ``select`` between frames; the kernel caps
    real-time tasks at 95 % of a CPU), else the highest nice it may take. Under
    a load of 8 on two cores a nice of -10 still added ~3 ms to each wait."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(-10)


def forward(a: int, b: int, delay_s: float, parent: int) -> None:
    """Copy frames between ``a`` and ``b``, each ``delay_s`` late, until the parent goes."""
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        a: collections.deque(),
        b: collections.deque(),
    }  # keyed by the fd the frames are written to
    peer = {a: b, b: a}
    while os.getppid() == parent:
        now = time.monotonic()
        for out, queue in queues.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                # the device down or full: the frame is lost, as on a wire
                with contextlib.suppress(OSError):
                    os.write(out, frame)
        due = [q[0][0] for q in queues.values() if q]
        timeout = min(max(min(due) - time.monotonic(), 0.0), 1.0) if due else 1.0
        readable, _, _ = select.select([a, b], [], [], timeout)
        arrived = time.monotonic()
        for fd in readable:
            for _ in range(64):
                try:
                    frame = os.read(fd, _MAX_FRAME)
                except BlockingIOError:
                    break
                except OSError:
                    break  # not up yet
                queue = queues[peer[fd]]
                if len(queue) < _MAX_QUEUED:
                    queue.append((arrived + delay_s, frame))


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    netns_a, name_a, netns_b, name_b, delay = argv
    delay_s = float(delay)
    if not 0 <= delay_s <= 10:
        print(f"delay {delay_s} s is out of range", file=sys.stderr)
        return 2
    parent = os.getppid()
    setns(netns_a)
    fd_a = open_tap(name_a)
    setns(netns_b)
    fd_b = open_tap(name_b)
    be_on_time()
    print("ready", flush=True)
    forward(fd_a, fd_b, delay_s, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
