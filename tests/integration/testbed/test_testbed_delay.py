"""A delayed access link: hosts a round trip of 4 × the delay apart, both ways, torn down after."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetmesh.testbed.netns import open_testbed, unavailable_reason

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

# both ends at a real-time priority: the figure is the link's, not the time a loaded
# machine takes to wake a process that slept 20 ms (p90 ~10 ms at load 8 on two cores)
REAL_TIME = (
    "import os\n"
    "try: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(5))\n"
    "except OSError: pass\n"
)
ECHO_SERVER = REAL_TIME + (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], 7001)); print('up', flush=True)\n"
    "c, _ = s.accept()\n"
    "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "while (b := c.recv(100)):\n"
    "    c.sendall(b)\n"
)
# median of 30 one-byte round trips over one TCP connection, in ms
PING_CLIENT = REAL_TIME + (
    "import socket, statistics, sys, time\n"
    "c = socket.create_connection((sys.argv[1], 7001), timeout=5)\n"
    "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "rtts = []\n"
    "for _ in range(30):\n"
    "    t = time.perf_counter(); c.sendall(b'x'); c.recv(1)\n"
    "    rtts.append(time.perf_counter() - t)\n"
    "print(round(statistics.median(rtts) * 1e3, 2))\n"
)


def median_rtt_ms(delays_s: dict[int, float] | None) -> float:
    with open_testbed(2, delays_s=delays_s) as bed:
        server = bed.popen(
            0,
            [sys.executable, "-c", ECHO_SERVER, bed.hosts[0].ip],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "up"
        client = bed.popen(
            1,
            [sys.executable, "-c", PING_CLIENT, bed.hosts[0].ip],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = client.communicate(timeout=60)
        assert client.returncode == 0
        forwarders = [p for p in bed.processes if "hetmesh.testbed.delay" in " ".join(p.args)]
        assert len(forwarders) == len(delays_s or {})
    assert all(p.poll() is not None for p in forwarders)  # stopped with the testbed
    return float(out)


def test_delayed_links_make_a_wan_round_trip() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    wan = median_rtt_ms({0: 0.005, 1: 0.005})  # 20 ms: 5 ms each way on each host's link
    lan = median_rtt_ms(None)
    assert 19.5 <= wan <= 30, wan
    assert lan < 5, lan
