"""The gateway's turn (a decode token in -> its next step out), lane on against off,
alternating round by round inside one in-process mesh (two daemons cutting the tiny
test model, shaped like the default one, in two, as
tests/integration/node/test_gateway_lane_mesh.py builds them).

Timestamps (time.perf_counter) are taken where the gateway first sees a token (the
lane's offer: a link's reader thread, or this node's last stage's device thread) and
where a one-position step leaves the gateway for the first stage (the lane's
send_now, or the gateway's trio send); the turn is their difference per token.
Between rounds the lane is switched by giving it its send_now or None.

Usage: PYTHONPATH=. .venv/bin/python docs/journal/2026-12-06-fast-cut-2-turn.py [rounds] [tokens]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from hetmesh.node.config import ServingConfig
from hetmesh.transport.frames import Activations, Tokens
from tests.integration.node.inprocess_mesh import PROMPT_IDS, generate, open_mesh, stage_servers

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 32


async def main() -> None:
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    with tempfile.TemporaryDirectory() as tmp:
        from hetmesh.partition.store import default_cache_dir, resolve_model
        from tests.tiny_model import build_tiny_model

        tiny = build_tiny_model(resolve_model(None), default_cache_dir())
        async with open_mesh(Path(tmp), serving, 2, model=tiny) as mesh:
            servers = stage_servers(mesh.nodes)
            assert len(servers) == 2, "the model must be cut in two"
            plan = mesh.nodes[0].serving.plan
            assert plan is not None and [len(p.stages) for p in plan.pipelines] == [2], plan
            node = mesh.nodes[0]
            gateway = node.serving.gateway
            pool = node.serving.pool
            lane = gateway.lane
            send_now = lane._send_now
            arrived: dict[tuple[str, int], float] = {}
            left: dict[tuple[str, int], float] = {}
            offer = lane.offer

            def peek(sender: str, frame: Any) -> None:
                if type(frame) is Tokens:
                    arrived.setdefault((frame.session_id, frame.step), time.perf_counter())
                offer(sender, frame)

            def note(frame: Any) -> None:
                if isinstance(frame, Activations) and len(frame.positions) == 1:
                    left.setdefault((frame.session_id, frame.step), time.perf_counter())

            def lane_send(peer: str, frame: Any) -> bool:
                note(frame)
                return bool(send_now(peer, frame))

            send = gateway._send

            async def trio_send(peer: str, frame: Any) -> None:
                note(frame)
                await send(peer, frame)

            lane.offer = peek  # type: ignore[method-assign]
            pool.peek = peek
            gateway._send = trio_send
            turns: dict[str, list[float]] = {"on": [], "off": []}
            outputs: dict[str, list[int]] = {}
            for r in range(ROUNDS):
                for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    lane._send_now = lane_send if arm == "on" else None
                    arrived.clear()
                    left.clear()
                    ids = await generate(mesh.addr, TOKENS)
                    outputs.setdefault(arm, ids)
                    assert outputs[arm] == ids
                    spans = [
                        (left[(sid, step + 1)] - t) * 1e3
                        for (sid, step), t in arrived.items()
                        if (sid, step + 1) in left
                    ]
                    turns[arm].append(statistics.median(spans))
                print(r, {k: round(v[-1], 3) for k, v in turns.items()}, os.getloadavg()[0])
            assert outputs["on"] == outputs["off"]
            print(
                json.dumps(
                    {
                        "median_turn_ms": {
                            k: round(statistics.median(v), 3) for k, v in turns.items()
                        },
                        "lane_steps": lane.sent,
                    }
                )
            )


trio.run(main)
