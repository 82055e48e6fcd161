"""Two daemons in one trio run: the public API the node issue builds on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from hetmesh.discovery import wire
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import Load
from hetmesh.errors import StreamReset
from hetmesh.node.daemon import Node, run_node
from tests.integration.discovery.discovery_nodes import in_process_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # a few seconds; generous for load


async def _until(predicate: object, timeout_s: float) -> None:
    assert callable(predicate)
    with trio.fail_after(timeout_s):
        while True:
            if predicate():
                return
            await trio.sleep(0.05)


async def test_node_daemons_publish_and_see_each_other_and_leave_cleanly(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        a: Node = await nursery.start(run_node, in_process_config(tmp_path, "a"))
        b: Node = await nursery.start(
            run_node, in_process_config(tmp_path, "b", a.discovery.addrs[0])
        )
        events = a.discovery.subscribe()

        # what the stage runtime will publish
        b.discovery.set_stages([{"model": "m", "start": 0, "end": 4, "ready": True}])
        b.discovery.set_load(Load(queue_depth=2, active_sessions=1))
        b.discovery.set_extra("plan", {"epoch": 7})

        def b_published() -> bool:
            entry = a.discovery.table.entries.get(b.peer_id)
            return bool(entry and entry.record and entry.record.extra.get("plan"))

        await _until(b_published, 60)  # a deadline: generous for a loaded machine
        (member,) = a.discovery.members()
        assert member.peer_id == b.peer_id
        assert member.record is not None
        assert member.record.stages[0]["end"] == 4
        assert member.record.load.queue_depth == 2
        assert member.record.devices[0].matmul_flops > 0

        # a new RPC: registered on one node, called from the other
        async def shout(stream: Any) -> None:
            text = await wire.read_frame(stream, max_bytes=1024, timeout_s=5)
            await wire.write_frame(stream, text.upper() + str(stream.muxed_conn.peer_id).encode())

        a.discovery.add_handler("/test/shout/1", shout)
        reply = await b.discovery.request(a.peer_id, "/test/shout/1", b"hi ")
        assert reply == b"HI " + b.peer_id.encode()
        with pytest.raises(StreamReset):  # a protocol nobody serves
            await b.discovery.request(a.peer_id, "/test/nothing/1", b"x", timeout_s=2)
        assert a.discovery.members()  # a failed RPC does not hurt membership

        b.request_stop()
        with trio.fail_after(30):
            async for event in events:
                if event.peer_id == b.peer_id and event.new is Health.LEFT:
                    break
        assert a.discovery.members() == []
        a.request_stop()
