"""The SDK finds a mesh over mDNS alone (two hosts in network namespaces)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetmesh.testbed.netns import open_testbed, unavailable_reason
from tests.integration.api.api_mesh import SECRET
from tests.integration.discovery.discovery_nodes import REPO, NodeFactory, node_env

pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

CLIENT = """
import json, sys
from hetmesh import Client, Timeout
with Client(mdns=True, mesh_secret=sys.argv[1], timeout=Timeout(connect=30)) as mesh:
    view = mesh.status()
print(json.dumps({"self": view["self"], "peers": len(view["peers"])}))
"""


def test_client_connects_by_mdns_and_reads_status(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    factory = NodeFactory(tmp_path)
    try:
        with open_testbed(2) as testbed:
            ip = testbed.hosts[0].ip

            def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
                proc: subprocess.Popen[bytes] = testbed.popen(0, argv, **kwargs)
                return proc

            node = factory.start(
                "--listen",
                f"/ip4/{ip}/tcp/4001",
                popen=popen,
                placement=testbed.placement(0),
                name="h0",
            )
            node.wait_ready(60)
            done = subprocess.run(
                testbed.argv(1, [sys.executable, "-c", CLIENT, SECRET]),
                capture_output=True,
                text=True,
                env=node_env(),
                cwd=str(REPO),
                timeout=90,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            answer = json.loads(done.stdout.strip().splitlines()[-1])
            assert answer == {"self": node.peer_id, "peers": 1}
    finally:
        factory.close()
