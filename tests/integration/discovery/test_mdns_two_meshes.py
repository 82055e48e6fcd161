"""Two meshes with different secrets on one LAN (four hosts on one bridge) stay apart.

Each host is a network namespace on a shared bridge, so every node hears every
other's mDNS advertisements; only the mesh secret keeps the two pairs apart.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hetmesh.testbed.netns import NetnsTestbed, open_testbed, unavailable_reason
from tests.integration.discovery.discovery_nodes import (
    REPO,
    NodeFactory,
    NodeProc,
    node_env,
    wait_for,
)

pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

SECRETS = ("mesh-one-secret", "mesh-two-secret")
_ALIVE = re.compile(r"INFO hetmesh\.discovery\.service: peer (\S+): \S+ -> alive")


def _met(node: NodeProc) -> set[str]:
    """Peers this node ever saw alive, from its log."""
    return {m.group(1) for m in _ALIVE.finditer(node.log())}


def _start(factory: NodeFactory, testbed: NetnsTestbed, host: int, secret: str) -> NodeProc:
    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = testbed.popen(host, argv, **kwargs)
        return proc

    ip = testbed.hosts[host].ip
    # no --bootstrap: mDNS is the only way these nodes can meet
    return factory.start(
        "--listen",
        f"/ip4/{ip}/tcp/4001",
        secret=secret,
        popen=popen,
        placement=testbed.placement(host),
        name=f"h{host}",
    )


def _alive_in_view(testbed: NetnsTestbed, host: int, node: NodeProc, secret: str) -> set[str]:
    argv = [sys.executable, "-m", "hetmesh", "status", "--mesh", node.addr, "--json"]
    out = subprocess.run(
        testbed.argv(host, [*argv, "--mesh-secret", secret]),
        capture_output=True,
        env=node_env(),
        cwd=str(REPO),
        timeout=60,
        check=True,
    )
    view: dict[str, Any] = json.loads(out.stdout)
    return {p["peer_id"] for p in view["peers"] if p["health"] in ("self", "alive", "suspect")}


def test_two_meshes_with_different_secrets_on_one_lan_stay_apart(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    factory = NodeFactory(tmp_path)
    try:
        with open_testbed(4) as testbed:
            # hosts 0 and 2 in mesh one, 1 and 3 in mesh two: interleaved on the bridge
            secret_of = {i: SECRETS[i % 2] for i in range(4)}
            nodes = [_start(factory, testbed, i, secret_of[i]) for i in range(4)]
            for node in nodes:
                node.wait_ready(90)
            ids = [n.peer_id for n in nodes]
            partner = {0: 2, 2: 0, 1: 3, 3: 1}

            def partners_met() -> bool:
                return all(ids[partner[i]] in _met(n) for i, n in enumerate(nodes))

            wait_for(partners_met, 60, "each node to find its own mesh over mDNS", every_s=0.5)
            # a few more announcement rounds, in which a leak would show up
            time.sleep(3)
            for i, node in enumerate(nodes):
                assert _met(node) == {ids[partner[i]]}, node.log()[-3000:]
                seen = _alive_in_view(testbed, i, node, secret_of[i])
                assert seen == {ids[i], ids[partner[i]]}, (i, seen)
            # and the other mesh's secret is refused outright
            other = SECRETS[1] if secret_of[0] == SECRETS[0] else SECRETS[0]
            argv = [sys.executable, "-m", "hetmesh", "status", "--mesh", nodes[0].addr]
            refused = subprocess.run(
                testbed.argv(1, [*argv, "--mesh-secret", other]),
                capture_output=True,
                text=True,
                env=node_env(),
                cwd=str(REPO),
                timeout=60,
            )
            assert refused.returncode == 1, refused.stdout
            assert "secret" in refused.stderr.lower(), refused.stderr
    finally:
        factory.close()
