"""The namespace testbed itself: hosts can talk over the bridge, nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetmesh.testbed.cgroups import CGROUP_ROOT, CPU, MEMORY, detect
from hetmesh.testbed.netns import open_testbed, unavailable_reason
from tests.integration.discovery.discovery_nodes import REPO

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]

ECHO_SERVER = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], 7000)); print('up', flush=True)\n"
    "c, _ = s.accept(); c.sendall(c.recv(100).upper())\n"
)
ECHO_CLIENT = (
    "import socket, sys\n"
    "c = socket.create_connection((sys.argv[1], 7000), timeout=5); c.sendall(b'ping')\n"
    "print(c.recv(100).decode())\n"
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_netns_testbed_connects_hosts_and_cleans_up() -> None:
    reason = unavailable_reason(need_cgroups=True, cgroup_needs=(CPU, MEMORY))
    if reason:
        pytest.skip(reason)
    hierarchy = detect()
    assert hierarchy is not None
    with open_testbed(2, cpu_quota_us={1: 50_000}, memory_limit_bytes={1: 1 << 30}) as bed:
        names = {bed.bridge_namespace, *(h.namespace for h in bed.hosts)}
        assert names <= _namespaces()
        assert all(n.startswith(bed.prefix) for n in names)
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
            [sys.executable, "-c", ECHO_CLIENT, bed.hosts[0].ip],
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
        )
        out, _ = client.communicate(timeout=20)
        assert out.strip() == "PING"
        cgroups = bed.hosts[1].cgroups
        if hierarchy.version == 1:
            assert (cgroups[0] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        else:
            assert (cgroups[0] / "cpu.max").read_text().split() == ["50000", "100000"]
        sleeper = bed.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
        for cg in cgroups:  # joined before exec, so already there
            assert str(sleeper.pid) in (cg / "cgroup.procs").read_text().split()
    assert sleeper.poll() is not None  # the testbed reaps what it started
    assert not names & _namespaces()
    assert all(not Path(cg).exists() for cg in cgroups)
    assert CGROUP_ROOT.is_dir()


def test_netns_testbed_explains_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import hetmesh.testbed.netns as netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable_reason() == "needs root (network namespaces, tc, cgroups)"
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda _name: None)
    reason = netns.unavailable_reason(need_tc=True)
    assert reason is not None
    assert "ip netns" in reason
