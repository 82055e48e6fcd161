"""``ThreadedLink.sink``: a frame taken on the link's reader thread never reaches trio.

A stage's fast lane (hetmesh.node.stage_lane) takes decode steps there. The sink
is asked only while trio holds every earlier frame of the link, so whichever way
each frame goes, none overtakes an earlier one.
"""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from hetmesh.transport import Activations, Frame
from hetmesh.transport.links import ThreadedLink
from tests.unit.transport.test_links import link_pair, planes, wait_until


def _frame(step: int) -> Activations:
    tensor = torch.full((576,), float(step))
    return Activations(session_id="s", step=step, positions=(step,), tensors=(tensor,))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_sink_takes_frames_on_the_reader_thread_and_never_overtakes_trio(
    backend: str,
) -> None:
    async with planes(backend) as (a, b):
        la, lb = await link_pair(a, b)
        assert isinstance(lb, ThreadedLink)
        offered: list[int] = []
        taken: list[Frame] = []
        threads: set[str] = set()
        refuse = {3}

        def sink(frame: Frame) -> bool:
            assert isinstance(frame, Activations)
            threads.add(threading.current_thread().name)
            offered.append(frame.step)
            if frame.step in refuse:
                return False
            taken.append(frame)
            return True

        lb.sink = sink
        for step in range(3):
            await la.send(_frame(step))
        await wait_until(lambda: len(taken) == 3)
        assert [f.step for f in taken] == [0, 1, 2]
        assert all(f == _frame(f.step) for f in taken)  # bit for bit
        assert threads
        assert all("reader" in name for name in threads)
        assert lb.statistics().frames_received == 3
        # 3 is refused: it goes to trio, and 4 and 5 follow it there unasked (trio has
        # not received 3 yet, so the sink would overtake it)
        for step in (3, 4, 5):
            await la.send(_frame(step))
        # trio receives nothing until the reader has handed all three over: were 3
        # received first, 4 would rightly be offered to the sink (trio holds all before it)
        await wait_until(lambda: lb._handed == 3)
        got = []
        for _ in range(3):
            with trio.fail_after(10):
                frame = await lb.receive()
            got.append(frame)
        assert [f.step for f in got] == [3, 4, 5]
        assert offered == [0, 1, 2, 3]
        # trio has everything earlier: the sink is asked again
        await la.send(_frame(6))
        await wait_until(lambda: len(taken) == 4)
        assert offered == [0, 1, 2, 3, 6]
        assert taken[-1].step == 6
        for frame in [*taken, *got]:
            lb.release(frame)
        await wait_until(lambda: lb.statistics().in_use_bytes == 0)
        assert lb.statistics().frames_received == 7
