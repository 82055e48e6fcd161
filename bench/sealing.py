"""What sealing adds per hop, without scheduling: write + read of one frame in one thread.

Plain and sealed links' own write and read paths (``encode_parts`` and
``write_frame`` or ``Sealer.send``; a
:class:`~hetmesh.transport.readers.BufferedReader`, or the
:class:`~hetmesh.transport.readers.SealedReader` when sealed) over a socket
pair (frames up to 64 KiB, which its buffer takes whole), alternating
plain and sealed blocks; medians per block, then the
median over blocks. Prints one JSON object: µs per write and per read, and
``added_us_per_hop`` (sealed write + read minus plain write + read).

    .venv/bin/python bench/sealing.py --sizes 8192 --frames 3000 --blocks 4

Also here: :func:`paired_sealing`, sealing's cost through the data plane
itself (two processes), which bench/transport.py reports as
``tcp_encrypted_*`` when run with both ``tcp`` and ``tcp-sealed``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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
    from hetmesh.transport.links import BufferedReader, SealedReader, write_frame
    from hetmesh.transport.sealed import Sealer

    key = os.urandom(32)
    left, right = socket.socketpair()
    pool = BufferPool()
    reader = BufferedReader(right, DEFAULT_LIMITS, pool)
    frame = Activations(session_id="b", step=1, positions=(0,), tensors=(torch.ones(size // 4),))
    write: Callable[[], Any]
    if sealed:
        reader = SealedReader(right, key, DEFAULT_LIMITS, pool)
        sealer = Sealer(key)

        def write() -> None:
            head, buffers, total = encode_parts(frame, DEFAULT_LIMITS)
            sealer.send(left, head, buffers, total)
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


SEALED = "tcp-sealed"  # bench/transport.py's name for tcp with every frame sealed


def _transport(pin: list[int] | None = None, spin: list[float] | None = None) -> Any:
    """bench/transport.py as a module (a second copy when it runs as ``__main__``),
    pinned and spinning as given."""
    import transport

    if pin is not None:
        transport.PIN[:] = pin
    if spin is not None:
        transport.SPIN_US[:] = spin
    return transport


PAIRS = 8  # block pairs per size in the sealing comparison


def paired_sealing(
    sizes: dict[str, int], rounds: int, pin: list[int], spin: list[float]
) -> dict[str, Any]:
    """What sealing costs: one client and one server process hold a plain and a sealed
    link side by side and use them in alternating blocks, the order swapping by pair.
    A pair's ratio compares two blocks a few ms apart (the load moves in seconds); the
    figure is the median over ``PAIRS * rounds`` pairs, listed in ``tcp_encrypted_pairs``.
    ``tcp_encrypted_added_us_per_hop_*``: the same pairs' round trips as a difference,
    sealed minus plain, halved (a round trip is two hops), in µs."""
    import trio

    T = _transport(pin, spin)
    ratios: dict[str, list[float]] = {}
    for name, size in sizes.items():
        got = trio.run(_measure_paired, size, T._count(size, "tcp"), PAIRS * rounds)
        for kind, pairs in got.items():
            key = "added_us_per_hop" if kind == "added_us" else f"{kind}_ratio"
            ratios[f"tcp_encrypted_{key}_{name}"] = pairs
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
    out["tcp_encrypted_pairs"] = {k: [round(x, 3) for x in v] for k, v in ratios.items()}
    return out


def _paired_server(pipe: Any, pin: list[int], spin: list[float]) -> None:
    """A plain and a sealed data plane; serves the four links the client opens (each
    plane: async, then blocking) at once."""
    import torch
    import trio

    from hetmesh.transport import open_data_plane
    from hetmesh.transport.links import in_thread

    T = _transport(pin, spin)
    T._pin(1)
    torch.set_num_threads(1)

    async def serve(link: Any, blocking: bool) -> None:
        await (in_thread(T._serve_blocking, link) if blocking else T._serve_link(link))
        await link.aclose()

    async def main() -> None:
        async with (
            open_data_plane(T._config("server", "tcp")) as plain,
            open_data_plane(T._config("server", SEALED)) as sealed,
        ):
            listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
            pipe.send(listener.socket.getsockname()[1])
            async with trio.open_nursery() as nursery:
                for blocking in (False, True):
                    for plane in (plain, sealed):
                        link = await plane.accept(await listener.accept(), blocking=blocking)
                        nursery.start_soon(serve, link, blocking)

    trio.run(main)


async def _measure_paired(size: int, count: tuple[int, int], pairs: int) -> dict[str, list[float]]:
    """Per block pair, sealed / plain: throughput (trio API) and median round trip
    (blocking API) of an ``Activations`` of ``size`` bytes."""
    import torch
    import trio

    from hetmesh.transport import Activations, Tokens, open_data_plane

    T = _transport()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_paired_server, args=(child, T.PIN, T.SPIN_US), daemon=True)
    proc.start()
    frames, trips = max(4, count[0] // 4), max(3, count[1] // 3)
    tensor = torch.ones(size // 4, dtype=torch.float32)
    sink = Activations(session_id="b", step=0, positions=(0,), tensors=(tensor,))
    echo = Activations(session_id="b", step=1, positions=(0,), tensors=(tensor,))
    try:
        port = await trio.to_thread.run_sync(parent.recv)
        async with (
            open_data_plane(T._config("client", "tcp")) as plain,
            open_data_plane(T._config("client", SEALED)) as sealed,
        ):
            links: dict[tuple[str, bool], Any] = {}
            for blocking in (False, True):
                for backend, plane in (("tcp", plain), (SEALED, sealed)):
                    control = await trio.open_tcp_stream("127.0.0.1", port)
                    link = await plane.connect(control, blocking=blocking)
                    if link.encrypted != (backend == SEALED):
                        raise RuntimeError(f"{backend} link: {link.reason}")
                    links[backend, blocking] = link

            async def ack(link: Any) -> None:
                await link.send(Tokens(session_id="ack", step=0, token_ids=(0,)))
                while not isinstance(frame := await link.receive(), Tokens):
                    link.release(frame)

            async def throughput(link: Any) -> float:
                t0 = time.perf_counter()
                for _ in range(frames):
                    await link.send(sink)
                await ack(link)
                return size * frames / (time.perf_counter() - t0)

            def round_trip(link: Any) -> float:
                rtts = []
                for _ in range(trips + 1):
                    t0 = time.perf_counter()
                    link.send_blocking(echo)
                    back = link.receive_blocking()
                    rtts.append(time.perf_counter() - t0)
                    link.release(back)
                return statistics.median(rtts[1:])

            for backend in ("tcp", SEALED):  # warm up pools, buffers, code
                await throughput(links[backend, False])
                await trio.to_thread.run_sync(round_trip, links[backend, True])
            out: dict[str, list[float]] = {"throughput": [], "rtt": [], "added_us": []}
            for p in range(pairs):
                order = ("tcp", SEALED) if p % 2 == 0 else (SEALED, "tcp")
                tput = {b: await throughput(links[b, False]) for b in order}
                rtt = {b: await trio.to_thread.run_sync(round_trip, links[b, True]) for b in order}
                out["throughput"].append(tput[SEALED] / tput["tcp"])
                out["rtt"].append(rtt[SEALED] / rtt["tcp"])
                out["added_us"].append((rtt[SEALED] - rtt["tcp"]) / 2 * 1e6)
            for link in links.values():
                await link.aclose()
    finally:
        await trio.to_thread.run_sync(proc.join, 20)
        if proc.is_alive():
            proc.kill()
            proc.join()
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
