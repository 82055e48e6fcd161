"""Three hosts in network namespaces: mDNS alone, a slow link, CPU quotas."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetmesh.testbed.netns import NetnsTestbed, open_testbed, unavailable_reason
from tests.integration.discovery.discovery_nodes import (
    REPO,
    SECRET,
    NodeFactory,
    NodeProc,
    health_changes,
    log_time,
    node_env,
    wait_for,
)

pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

LIMITED_BPS = 12.5e6  # 100 Mbit/s
SLACK_S = 2.0  # on top of the discovery target: a loaded machine delays the nodes


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeFactory]:
    factory = NodeFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


def _require(**needs: bool) -> None:
    reason = unavailable_reason(**needs)
    if reason:
        pytest.skip(reason)


def _start(nodes: NodeFactory, testbed: NetnsTestbed, host: int, *args: str) -> NodeProc:
    ip = testbed.hosts[host].ip

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = testbed.popen(host, argv, **kwargs)
        return proc

    return nodes.start(
        "--listen",
        f"/ip4/{ip}/tcp/4001",
        *args,
        popen=popen,
        placement=testbed.placement(host),
        name=f"h{host}",
    )


def _view_in(testbed: NetnsTestbed, host: int, addr: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "hetmesh", "status", "--mesh", addr, "--json"]
    out = subprocess.run(
        testbed.argv(host, [*argv, "--mesh-secret", SECRET]),
        capture_output=True,
        env=node_env(),
        cwd=str(REPO),
        timeout=30,
        check=True,
    )
    view: dict[str, Any] = json.loads(out.stdout)
    return view


def _first_alive(node: NodeProc, ids: set[str]) -> dict[str, float]:
    """peer id -> wall time this node first saw it alive, from its own log."""
    seen: dict[str, float] = {}
    for peer in ids - {node.peer_id}:
        alive = [t for t, new in health_changes(node, peer) if new == "alive"]
        if alive:
            seen[peer] = alive[0]
    return seen


def _listening_since(node: NodeProc) -> float:
    stamp = log_time(node, "listening on")
    assert stamp is not None, f"no 'listening on' line in:\n{node.log()}"
    return stamp


def test_mdns_alone_finds_three_nodes_and_a_slow_link_is_measured(nodes: NodeFactory) -> None:
    _require(need_tc=True)
    with open_testbed(3, rates={2: "100mbit"}) as testbed:
        started = [_start(nodes, testbed, i) for i in range(3)]  # no --bootstrap: mDNS only
        for node in started:
            node.wait_ready(60)
        # from the moment the last host was up and listening (imports take seconds)
        ready_at = max(_listening_since(n) for n in started)
        ids = {n.peer_id for n in started}

        def everyone_sees_everyone() -> bool:
            return all(set(_first_alive(n, ids)) >= ids - {n.peer_id} for n in started)

        # a deadline only: the time itself comes from the nodes' logs
        wait_for(everyone_sees_everyone, 60, "mDNS discovery", every_s=0.25)
        found_at = max(max(_first_alive(n, ids).values()) for n in started)
        print(f"mDNS: all three met {found_at - ready_at:.2f} s after the last one listened")
        took = found_at - ready_at
        assert took <= 10.0 + SLACK_S, f"took {took:.1f} s after start-up"

        slow = started[2].peer_id
        want = {(s, d) for s in ids for d in ids if s != d}
        last: dict[tuple[str, str], float] = {}

        def settled() -> bool:
            # each node publishes the best of its recent probes; wait until the
            # start-up contention (benchmarks, imports) has washed out
            view = _view_in(testbed, 0, started[0].addr)
            last.clear()
            last.update({(lk["src"], lk["dst"]): lk["bandwidth_bps"] for lk in view["links"]})
            return want <= set(last) and all(
                (abs(bw / LIMITED_BPS - 1) <= 0.3) if slow in key else bw >= 5 * LIMITED_BPS
                for key, bw in last.items()
            )

        try:
            wait_for(settled, 90, "every link to be measured", every_s=1.0)
        finally:
            print({f"{s[-4:]}->{d[-4:]}": round(bw / 1e6, 1) for (s, d), bw in last.items()})
        limited = [bw for (s, d), bw in last.items() if slow in (s, d)]
        unlimited = [bw for (s, d), bw in last.items() if slow not in (s, d)]
        assert len(limited) == 4
        assert len(unlimited) == 2
        assert max(limited) <= 1.3 * LIMITED_BPS
        assert min(limited) >= 0.7 * LIMITED_BPS
        assert min(unlimited) >= 5 * LIMITED_BPS

        view = _view_in(testbed, 1, started[1].addr)
        assert {p["peer_id"] for p in view["peers"] if p["health"] in ("self", "alive")} == ids
        assert all(p["record"]["devices"] for p in view["peers"])


def test_cpu_quota_lowers_measured_flops(nodes: NodeFactory) -> None:
    _require(need_cgroups=True)
    # host 0: two full cores; host 1: a quarter of one core
    with open_testbed(2, cpu_quota_us={0: 200_000, 1: 25_000}) as testbed:
        fast = _start(nodes, testbed, 0, "--no-mdns")
        fast.wait_ready(60)  # one at a time, so the two benchmarks do not overlap
        slow = _start(nodes, testbed, 1, "--no-mdns")
        slow.wait_ready(90)
        flops = {}
        for i, node in enumerate((fast, slow)):
            view = _view_in(testbed, i, node.addr)
            (me,) = [p for p in view["peers"] if p["health"] == "self"]
            cpu = me["record"]["devices"][0]
            flops[i] = cpu["matmul_flops"]
            if i == 1:
                assert cpu["cpu_cores_logical"] == 1  # 0.25 of a core, rounded up
        print(f"FLOP/s: unlimited {flops[0] / 1e9:.1f} G, 25% quota {flops[1] / 1e9:.1f} G")
        assert flops[0] >= 1.5 * flops[1]
