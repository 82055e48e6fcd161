"""What the HTTP API shows of the mesh leaves out the hashes of clients' prompts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from hetmesh.node.api_serve import serve_http
from tests.unit.node.test_api import FakeBackend

SUMMARY = "18feb42200000007"  # two blocks' truncated hashes, as a stage announces them


class AnnouncingBackend(FakeBackend):
    def view(self) -> dict[str, Any]:
        extra = {"prefix_summaries": [[0, 16, SUMMARY], [16, 30, ""]], "plan": {"epoch": 3}}
        record = {"extra": extra}
        return {"self": "A", "peers": [{"peer_id": "B", "health": "alive", "record": record}]}


async def test_status_and_the_dashboard_feed_show_counts_not_prefix_hashes(
    nursery: trio.Nursery,
) -> None:
    """Before the fix /v1/hetmesh/status returned the stages' summaries whole: a client
    could hash a guessed prompt and confirm another client had sent it."""
    url = await nursery.start(
        lambda task_status: serve_http(AnnouncingBackend(), task_status=task_status)
    )
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        status = (await http.get("/v1/hetmesh/status")).json()
        async with http.stream("GET", "/v1/hetmesh/events") as events:
            snapshot = ""
            async for line in events.aiter_lines():
                if line.startswith("data:") and "peers" in line:
                    snapshot = line
                    break
    extra = status["peers"][0]["record"]["extra"]
    assert extra["prefix_summaries"] == [[0, 16, 2], [16, 30, 0]]
    assert extra["plan"] == {"epoch": 3}  # the rest as it was
    for text in (json.dumps(status), snapshot):
        assert "18feb422" not in text
    assert snapshot
