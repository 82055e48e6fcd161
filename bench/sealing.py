"""What sealing adds per hop, without scheduling: write + read of one frame in one thread.

Plain and sealed links' own write and read paths (``encode_parts`` and
``write_frame`` or the :class:`~hetmesh.transport.sealed.Sealer` with one
``sendall``; a :class:`~hetmesh.transport.links.BufferedReader`, over an
:class:`~hetmesh.transport.sealed.OpenedSocket` when sealed) over a socket
pair (frames up to 64 KiB, which its buffer takes whole), alternating
plain and sealed blocks; medians per block, then the
median over blocks. Prints one JSON object: µs per write and per read, and
``added_us_per_hop`` (sealed write + read minus plain write + read).

    .venv/bin/python bench/sealing.py --sizes 8192 --frames 3000 --blocks 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

MAX_SIZE = 64 << 10  # a frame the socket pair's buffer takes whole


def _block(sealed: bool, size: int, frames: int) -> tuple[float, float]:
    import torch

    from hetmesh.transport.codec import BufferPool
    from hetmesh.transport.frames import DEFAULT_LIMITS, Activations, encode_parts
    from hetmesh.transport.links import BufferedReader, write_frame
    from hetmesh.transport.sealed import OpenedSocket, Sealer

    key = os.urandom(32)
    left, right = socket.socketpair()
    pool = BufferPool()
    reader = BufferedReader(right, DEFAULT_LIMITS, pool)
    frame = Activations(session_id="b", step=1, positions=(0,), tensors=(torch.ones(size // 4),))
    write: Callable[[], Any]
    if sealed:
        reader._sock = OpenedSocket(right, key)  # type: ignore[assignment]
        sealer = Sealer(key)

        def write() -> None:
            head, buffers, total = encode_parts(frame, DEFAULT_LIMITS)
            left.sendall(sealer.seal_frame(head, buffers, total))
    else:

        def write() -> int:
            return write_frame(left, frame, DEFAULT_LIMITS)

    writes, reads = [], []
    with left, right:
        for _ in range(frames):
            t0 = time.perf_counter_ns()
            write()
            t1 = time.perf_counter_ns()
            got = reader.read_frame()
            t2 = time.perf_counter_ns()
            pool.release(got.tensors[0])
            writes.append(t1 - t0)
            reads.append(t2 - t1)
    skip = frames // 10  # warm-up
    return statistics.median(writes[skip:]) / 1e3, statistics.median(reads[skip:]) / 1e3


def measure(size: int, frames: int, blocks: int) -> dict[str, float]:
    got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for b in range(blocks):
        for sealed in (False, True) if b % 2 == 0 else (True, False):
            got[sealed].append(_block(sealed, size, frames))
    out = {}
    for sealed, name in ((False, "plain"), (True, "sealed")):
        out[f"{name}_write_us"] = round(statistics.median(w for w, _ in got[sealed]), 2)
        out[f"{name}_read_us"] = round(statistics.median(r for _, r in got[sealed]), 2)
    out["added_us_per_hop"] = round(
        out["sealed_write_us"]
        + out["sealed_read_us"]
        - out["plain_write_us"]
        - out["plain_read_us"],
        2,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8 << 10])
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    if max(args.sizes) > MAX_SIZE:
        parser.error(f"sizes up to {MAX_SIZE} bytes: one thread writes a frame, then reads it")
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {"load": round(os.getloadavg()[0], 1)}
    for size in args.sizes:
        result[str(size)] = measure(size, args.frames, args.blocks)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
