"""``discover_mdns`` leaves nothing of its mDNS service running in the caller's trio run.

py-libp2p's mDNS service runs a trio system task that sleeps a minute between clean-ups;
stopping the service cancels it. Stopped from a worker thread, that cancel could go
unseen until the sleep ended, and ``Client(mdns=True)`` then sat a minute in
``trio.run`` after it had found its node. Here nothing answers (a short limit on a
machine with no node), so the call ends in ``ConnectTimeout`` and the service is
stopped on that path too.
"""

from __future__ import annotations

import pytest
import trio

from hetmesh.client.mesh import discover_mdns
from hetmesh.errors import ConnectTimeout

pytestmark = pytest.mark.slow  # zeroconf starts and stops: a few seconds on a loaded machine


def _system_tasks() -> list[str]:
    root = trio.lowlevel.current_root_task()
    assert root is not None
    return [task.name for nursery in root.child_nurseries for task in nursery.child_tasks]


def _cleanup_tasks() -> list[str]:
    return [name for name in _system_tasks() if "cleanup_loop" in name]


async def test_discover_mdns_stops_its_cleanup_task_when_it_returns() -> None:
    assert _cleanup_tasks() == []
    with pytest.raises(ConnectTimeout, match="mDNS"):
        await discover_mdns("a secret no node here has", timeout_s=0.5)
    # the cancel is seen at the task's next checkpoint: a few scheduler passes, never
    # the 60 s sleep (the deadline is generous for a loaded machine, and far below it)
    with trio.move_on_after(30):
        for _ in range(100_000):  # polled: the task is the library's, with no event to wait on
            if not _cleanup_tasks():
                break
            await trio.sleep(0.05)
    assert _cleanup_tasks() == [], "the mDNS clean-up task outlived discover_mdns"
