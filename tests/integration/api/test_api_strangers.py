"""A stranger (no API key) against a real node's HTTP API: it cannot grow the node."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.api.api_mesh import free_port
from tests.integration.discovery.discovery_nodes import NodeFactory

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(400)]

KEY = "stranger-test-key"
REQUESTS = 20_000


async def test_twenty_thousand_requests_to_distinct_paths_grow_neither_metrics_nor_memory(
    tmp_path: Path,
) -> None:
    """Every answer (401 without the key, 404 with it) is counted under its route's
    template or ``unmatched``, never the raw path: /metrics stays within 1 MiB and the
    node's RSS within 50 MiB of their baselines (before the fix: +42 MB of /metrics,
    +34 MiB of RSS, linearly)."""
    import psutil

    factory = NodeFactory(tmp_path)
    try:
        port = free_port()
        args = ("--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0", "--api-key", KEY)
        node = factory.start(*args, "--api-port", str(port)).wait_ready(120)
        proc = psutil.Process(node.proc.pid)
        url = f"http://127.0.0.1:{port}"
        keyed = {"Authorization": f"Bearer {KEY}"}
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:

            async def metrics_size() -> int:
                reply = await http.get("/metrics", headers=keyed)
                assert reply.status_code == 200
                return len(reply.content)

            for i in range(200):  # warm: every label the stranger's answers could use
                assert (await http.get(f"/warm/{i}")).status_code == 401
                assert (await http.get(f"/warm/{i}", headers=keyed)).status_code == 404
            base_metrics = await metrics_size()
            base_rss = proc.memory_info().rss
            for i in range(REQUESTS):
                keyed_one = i % 4 == 0  # some with the key: 404, counted as well
                reply = await http.get(f"/x/{i:08x}", headers=keyed if keyed_one else None)
                assert reply.status_code == (404 if keyed_one else 401)
            grown_metrics = await metrics_size() - base_metrics
            grown_rss = proc.memory_info().rss - base_rss
            text = (await http.get("/metrics", headers=keyed)).text
        print(f"/metrics +{grown_metrics} B, RSS +{grown_rss / 2**20:.1f} MiB after {REQUESTS}")
        assert grown_metrics < 1 << 20, f"/metrics grew {grown_metrics} bytes"
        assert grown_rss < 50 << 20, f"RSS grew {grown_rss / 2**20:.0f} MiB"
        assert "/x/" not in text
        assert 'route="unmatched",status="401"' in text
        assert node.proc.poll() is None
    finally:
        factory.close()
