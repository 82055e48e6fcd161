"""A/B in one run (needs commit 8d7361f's shm.py, reverted): a decode hop's frame (1 x 576 float32) over an shm link pair,
inline in the doorbell packet (new) against a segment + release packet (old).

    PYTHONPATH=. .venv/bin/python docs/journal/2026-12-05-fast-cut-shm-ab.py [rounds] [trips]
"""

from __future__ import annotations

import statistics as st
import sys
import time

import torch
import trio

from hetmesh.transport.frames import Activations
from hetmesh.transport.shm import INLINE_MAX_BYTES
from tests.unit.transport.test_links import link_pair, planes

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
TRIPS = int(sys.argv[2]) if len(sys.argv) > 2 else 300


async def main() -> None:
    async with planes("shm") as (a, b):
        la, lb = await link_pair(a, b)
        x = torch.randn(1, 576)

        async def echo() -> None:
            while True:
                frame = await lb.receive()
                await lb.send(frame)
                lb.release(frame)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            results: dict[str, list[float]] = {"segment (old)": [], "inline (new)": []}
            order = [("segment (old)", 0), ("inline (new)", INLINE_MAX_BYTES)]
            for r in range(ROUNDS):
                for name, inline in order if r % 2 else order[::-1]:  # alternating
                    la._inline_max = lb._inline_max = inline
                    trips = []
                    for step in range(TRIPS):
                        began = time.perf_counter()
                        await la.send(
                            Activations(session_id="s", step=step, positions=(step,), tensors=(x,))
                        )
                        got = await la.receive()
                        trips.append(time.perf_counter() - began)
                        assert torch.equal(got.tensors[0], x)
                        la.release(got)
                    results[name].append(st.median(trips))
            nursery.cancel_scope.cancel()
    old, new = results["segment (old)"], results["inline (new)"]
    print("median RTT µs per round, old:", [round(v * 1e6) for v in old])
    print("median RTT µs per round, new:", [round(v * 1e6) for v in new])
    print("new/old per round:", [round(n / o, 3) for n, o in zip(new, old)])
    print(f"median of ratios: {st.median([n / o for n, o in zip(new, old)]):.3f}")


trio.run(main)
