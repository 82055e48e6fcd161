"""A tcp link between two hosts (network namespaces) is sealed by default and exact."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetmesh.testbed.netns import open_testbed, unavailable_reason
from tests.integration.discovery.discovery_nodes import REPO, node_env

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_tcp_link_between_two_hosts_is_sealed_and_bit_exact() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    script = [sys.executable, "-m", "tests.integration.transport.sealed_peer"]
    with open_testbed(2) as bed:
        server_ip, port = bed.hosts[1].ip, "7411"
        listener = bed.popen(
            1,
            [*script, "listen", server_ip, port],
            stdout=subprocess.PIPE,
            text=True,
            env=node_env(),
            cwd=str(REPO),
        )
        assert listener.stdout is not None
        assert listener.stdout.readline().strip() == "READY"
        dialer = bed.popen(
            0,
            [*script, "dial", server_ip, port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=node_env(),
            cwd=str(REPO),
        )
        out, _ = dialer.communicate(timeout=120)
        assert dialer.returncode == 0, out
        assert "SEALED True" in out, out
        assert listener.wait(timeout=60) == 0
