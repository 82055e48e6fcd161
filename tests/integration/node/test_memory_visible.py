"""A real node process holding a stage announces the memory it really uses beside
the plan's charge (issue 42, item 4), and the two agree.

One node serves the default model whole (one stage, ``[0, 32)``). Its record's
``memory`` entry (hetmesh.node.memory) must say what the operating system says
of the process (its RSS: no cgroup of its own here), and what the plan charged
it plus the runtime it used before holding any stage must cover it: the plan
never charges a node less than it really uses for its stage.

Not (yet) within 15 %: measured here, 440 MiB in use against a 225 MiB charge
plus a 408 MiB runtime — the runtime is not charged by the planner at all, the
charge's KV budget is not resident until sessions fill it, and its reserve is
headroom (docs/journal/2026-12-05-fast-cut-2.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.discovery.discovery_nodes import fetch_view, wait_for
from tests.integration.node.mesh_nodes import running_mesh, wait_serving

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.model]

MIB = 1 << 20


def _memory(view: dict[str, Any]) -> dict[str, Any] | None:
    me = next(p for p in view["peers"] if p["peer_id"] == view["self"])
    entry = ((me.get("record") or {}).get("extra") or {}).get("memory")
    return entry if isinstance(entry, dict) and entry.get("charged") else None


def test_a_node_holding_a_stage_shows_its_real_memory_beside_the_plans_charge(
    tmp_path: Path,
) -> None:
    extra = ("--max-memory", "2GiB", "--max-sessions", "2", "--max-context", "512")
    with running_mesh(tmp_path, 1, *extra) as (node,):
        wait_serving(node)
        found: dict[str, Any] = {}
        process = psutil.Process(node.proc.pid)

        def announced() -> bool:
            # the entry follows the process: within 10 % of its RSS once the stage is in
            # (published every profile update, after a move of more than 2 %)
            entry = _memory(fetch_view(node.addr))
            if entry is None:
                return False
            found.update(entry, rss=process.memory_info().rss)
            return abs(entry["in_use"] - found["rss"]) <= 0.10 * found["rss"]

        wait_for(announced, 90, "the node to announce its memory beside a charge")
        rss = found["rss"]
        assert found["source"] == "rss"
        assert found["charged"] > 0
        assert found["runtime"] > 100 * MIB  # an interpreter with torch and libp2p
        assert found["charged"] + found["runtime"] >= max(found["in_use"], rss), found
