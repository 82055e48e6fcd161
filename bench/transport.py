"""Data-plane benchmark: every backend against plain blocking sockets, in the same run.

    python bench/transport.py                 # table
    python bench/transport.py --json          # one JSON object
    python bench/transport.py --backends tcp shm --sizes 8KiB 4MiB

Two OS processes per measurement (this one and a spawned server). For each
backend and payload (8 KiB, 256 KiB, 4 MiB, 64 MiB, float32):

* throughput: N frames one way, then a 1-token ack; bytes / time.
* latency: round trip of one frame (the server echoes it), median.

The baseline is two plain blocking Python sockets doing ``sendall`` and
``recv_into`` a preallocated buffer (the same pattern: N messages + ack, and
echo), measured in the same run; every figure comes with its ratio to it.
``shm_handoff_us_64MiB`` is the one-way time from ``send`` of a tensor
already in shared memory to the receiver holding it (monotonic clock shared
by both processes), median.

``tcp-sealed`` is tcp with every frame encrypted and authenticated (what
links between hosts do by default), forced here on loopback;
``tcp_encrypted_throughput_ratio_*`` and ``tcp_encrypted_rtt_ratio_*`` divide
its figures by plain tcp's (throughput: the trio API; RTT: the blocking API),
measured after the full runs by one client and one server holding a plain and
a sealed link side by side, used in alternating blocks (bench/sealing.py,
``paired_sealing``: the median of the block pairs' ratios;
``tcp_encrypted_pairs`` lists them); ``tcp_encrypted_added_us_per_hop_*`` is
the same pairs' round trips as a difference (sealed minus plain, per hop: half
a round trip), in µs.

What one round trip does, plain and sealed alike: the client encodes an
``Activations`` of one float32 tensor (``encode_parts``) and writes it
(``send_blocking``); the server reads it (``receive_blocking``: the head is
parsed and the tensor is a buffer of the link's pool, filled from the wire),
writes the same frame back (encoded again; sealed again on a sealed link) and
releases it; the client reads the echo the same way and releases it. The
tensor's bytes reach the pool buffer by a copy from the reader's staging buffer
(plain), or by AES-GCM opening the record straight into it (sealed, once a
record of that size and layout was seen; the first is opened into the staging
buffer and copied). Neither side computes on the tensor between hops, as a stage
would with torch: the AVX-512 after-effect that the sealed hops' AES-GCM has
(docs/journal/2026-12-08-sealing-4.md), which torch's own kernels have too, is
charged in full to sealing here.

Socket backends are measured twice: through the async (trio) API and through
the blocking API a stage loop uses from its worker thread
(``receive_blocking`` / ``send_blocking``). ``*_rtt_*`` and ``*_handoff_*``
keys are the blocking API; ``*_async_rtt_*`` / ``*_async_handoff_*`` the
trio API; throughput is always the trio API. By default the client and the
server are pinned to two different CPUs (both for the baseline and for us):
unpinned runs on a 2-vCPU box are bimodal (DATAPLANE.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import replace
from typing import Any

SIZES = {"8KiB": 8 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
ALL_BACKENDS = ("tcp", "tcp-sealed", "shm", "torchdist", "libp2p")
SEALED = "tcp-sealed"  # tcp with every frame sealed (AES-256-GCM), forced on loopback


PIN: list[int] = []  # [client cpu, server cpu] when pinned
SPIN_US: list[float] = []  # [DataPlaneConfig.spin_us] when --spin-us is given
# handoffs per size: no byte is copied, so the count does not shrink with the size
# (it did: 5 samples at 64 MiB gave a median that swung by 10x under load)
HANDOFFS, WARMUP = 60, 10


def _pin(index: int) -> None:
    if PIN:
        os.sched_setaffinity(0, {PIN[index]})


def _count(nbytes: int, backend: str) -> tuple[int, int]:
    """(throughput frames, round trips) so each cell takes well under a second or two."""
    slow = backend == "libp2p"
    frames = max(8, min(2000, (512 << 20) // nbytes // (8 if slow else 1)))
    trips = max(3, min(300, (64 << 20) // nbytes // (8 if slow else 1)))
    return frames, trips


# --- baseline: plain blocking sockets ------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("closed")
        got += n


def _baseline_server(port_out: Any, pin: list[int]) -> None:
    PIN[:] = pin
    _pin(1)
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(16)
    buffers: dict[int, memoryview] = {}
    while True:
        try:
            _recv_exact(conn, memoryview(head))
        except ConnectionError:
            return
        mode, size, count = (
            int.from_bytes(head[:4]),
            int.from_bytes(head[4:10]),
            int.from_bytes(head[10:16]),
        )
        view = buffers.setdefault(size, memoryview(bytearray(size)))
        for _ in range(count):
            _recv_exact(conn, view)
            if mode == 1:
                conn.sendall(view)
        if mode == 0:
            conn.sendall(b"k")


def baseline(sizes: dict[str, int], counts: dict[str, tuple[int, int]]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_baseline_server, args=(child, PIN), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out: dict[str, Any] = {}
        for name, size in sizes.items():
            frames, trips = counts[name]
            data = memoryview(bytearray(size))
            back = memoryview(bytearray(size))
            ack = memoryview(bytearray(1))
            sock.sendall((0).to_bytes(4) + size.to_bytes(6) + frames.to_bytes(6))
            t0 = time.perf_counter()
            for _ in range(frames):
                sock.sendall(data)
            _recv_exact(sock, ack)
            out[f"throughput_{name}"] = size * frames / (time.perf_counter() - t0)
            sock.sendall((1).to_bytes(4) + size.to_bytes(6) + trips.to_bytes(6))
            rtts = []
            for _ in range(trips):
                t0 = time.perf_counter()
                sock.sendall(data)
                _recv_exact(sock, back)
                rtts.append(time.perf_counter() - t0)
            out[f"rtt_{name}"] = statistics.median(rtts)
        sock.close()
        return out
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


# --- hetmesh links -----------------------------------------------------------------


def _config(peer_id: str, backend: str) -> Any:
    from hetmesh.transport import DataPlaneConfig

    if backend == SEALED:
        config = DataPlaneConfig(peer_id=peer_id, backends=("tcp",), tcp_encryption="always")
    else:
        config = DataPlaneConfig(peer_id=peer_id, backends=(backend,), gloo=True)
    return replace(config, spin_us=SPIN_US[0]) if SPIN_US else config


async def _serve_link(link: Any) -> None:
    from hetmesh.transport import Activations, Goodbye, Tokens
    from hetmesh.transport.links import now_ns

    while True:
        frame = await link.receive()
        if isinstance(frame, Goodbye):
            return
        if isinstance(frame, Tokens):
            await link.send(Tokens(session_id="ack", step=frame.step, token_ids=(0,)))
        elif isinstance(frame, Activations) and frame.step == 1:
            await link.send(frame)
        elif isinstance(frame, Activations) and frame.step == 2:
            stamp = now_ns()
            link.release(frame)
            await link.send(Tokens(session_id="ack", step=2, token_ids=(stamp,)))
            continue
        link.release(frame)


def _serve_blocking(link: Any) -> None:
    from hetmesh.transport import Activations, Goodbye, Tokens

    while True:
        frame = link.receive_blocking()
        if isinstance(frame, Goodbye):
            return
        if isinstance(frame, Tokens):
            link.send_blocking(Tokens(session_id="ack", step=frame.step, token_ids=(0,)))
        elif isinstance(frame, Activations) and frame.step == 1:
            link.send_blocking(frame)
        elif isinstance(frame, Activations) and frame.step == 2:
            stamp = time.perf_counter_ns()
            link.release(frame)
            link.send_blocking(Tokens(session_id="ack", step=2, token_ids=(stamp,)))
            continue
        link.release(frame)


def _link_server(backend: str, pipe: Any, pin: list[int], spin: list[float]) -> None:
    import torch
    import trio

    from hetmesh.transport.links import in_thread

    PIN[:] = pin
    SPIN_US[:] = spin
    _pin(1)

    from hetmesh.transport import Libp2pStream, open_data_plane

    torch.set_num_threads(1)

    async def main() -> None:
        async with open_data_plane(_config("server", backend)) as plane:
            if backend == "libp2p":
                from hetmesh.transport.p2p import PROTOCOL_ID, guarded, open_p2p_host

                done = trio.Event()

                async def handler(stream: Any) -> None:
                    link = await plane.accept(Libp2pStream(stream))
                    await _serve_link(link)
                    done.set()

                async with open_p2p_host() as host:
                    host.set_stream_handler(PROTOCOL_ID, guarded(handler))
                    pipe.send(f"{host.get_addrs()[0]}")
                    await done.wait()
                return
            listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
            pipe.send(listener.socket.getsockname()[1])
            for blocking in (False, True):
                control = await listener.accept()
                link = await plane.accept(control, blocking=blocking)
                if blocking:
                    await in_thread(_serve_blocking, link)
                else:
                    await _serve_link(link)
                await link.aclose()

    trio.run(main)


async def _measure_link(
    backend: str, sizes: dict[str, int], counts: dict[str, tuple[int, int]]
) -> tuple[dict[str, Any], str]:
    import torch
    import trio

    from hetmesh.transport import Activations, Tokens, open_data_plane
    from hetmesh.transport.links import now_ns

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_link_server, args=(backend, child, PIN, SPIN_US), daemon=True)
    proc.start()
    out: dict[str, Any] = {}
    try:
        address = await trio.to_thread.run_sync(parent.recv)
        async with open_data_plane(_config("client", backend)) as plane:
            if backend == "libp2p":
                from hetmesh.transport.p2p import open_p2p_host, p2p_connect

                hosts = open_p2p_host()
                host = await hosts.__aenter__()
                control: Any = await p2p_connect(host, address)
            else:
                hosts = None
                control = await trio.open_tcp_stream("127.0.0.1", address)
            link = await plane.connect(control)
            reason = link.reason

            async def ack(step: int) -> Any:
                await link.send(Tokens(session_id="ack", step=step, token_ids=(0,)))
                while True:
                    frame = await link.receive()
                    if isinstance(frame, Tokens):
                        return frame
                    link.release(frame)

            for name, size in sizes.items():
                frames, trips = counts[name]
                tensor = torch.ones(size // 4, dtype=torch.float32)
                frame = Activations(session_id="b", step=0, positions=(0,), tensors=(tensor,))
                for _ in range(min(frames, 4)):  # warm up pools and segments
                    await link.send(frame)
                await ack(0)
                t0 = time.perf_counter()
                for _ in range(frames):
                    await link.send(frame)
                await ack(0)
                out[f"throughput_{name}"] = size * frames / (time.perf_counter() - t0)
                echo = Activations(session_id="b", step=1, positions=(0,), tensors=(tensor,))
                rtts = []
                for _ in range(trips + 1):
                    t0 = time.perf_counter()
                    await link.send(echo)
                    back = await link.receive()
                    rtts.append(time.perf_counter() - t0)
                    link.release(back)
                out[f"rtt_{name}"] = statistics.median(rtts[1:])
                if backend == "shm":
                    handoffs = []
                    for _ in range(HANDOFFS):
                        slab = link.allocate(torch.float32, (size // 4,))  # type: ignore[attr-defined]
                        start = now_ns()
                        await link.send(
                            Activations(session_id="b", step=2, positions=(0,), tensors=(slab,))
                        )
                        got = await link.receive()
                        assert isinstance(got, Tokens)
                        handoffs.append((got.token_ids[0] - start) / 1e3)
                    out[f"handoff_us_{name}"] = statistics.median(handoffs[WARMUP:])
            await link.aclose()
            if backend != "libp2p":
                control = await trio.open_tcp_stream("127.0.0.1", address)
                link = await plane.connect(control, blocking=True)
                await trio.to_thread.run_sync(_blocking_client, link, sizes, counts, out)
                await link.aclose()
            if hosts is not None:
                await hosts.__aexit__(None, None, None)
    finally:
        await trio.to_thread.run_sync(proc.join, 20)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out, reason


def _blocking_client(
    link: Any, sizes: dict[str, int], counts: dict[str, tuple[int, int]], out: dict[str, Any]
) -> None:
    """Round trips through the blocking API (a stage loop in its worker thread)."""
    import torch

    from hetmesh.transport import Activations, Tokens

    for name, size in sizes.items():
        frames, trips = counts[name]
        tensor = torch.ones(size // 4, dtype=torch.float32)
        sink = Activations(session_id="b", step=0, positions=(0,), tensors=(tensor,))
        for _ in range(min(frames, 4)):  # warm up pools and segments
            link.send_blocking(sink)
        link.send_blocking(Tokens(session_id="ack", step=0, token_ids=(0,)))
        link.release(link.receive_blocking())
        t0 = time.perf_counter()
        for _ in range(frames):
            link.send_blocking(sink)
        link.send_blocking(Tokens(session_id="ack", step=0, token_ids=(0,)))
        link.release(link.receive_blocking())
        out[f"sync_throughput_{name}"] = size * frames / (time.perf_counter() - t0)
        echo = Activations(session_id="b", step=1, positions=(0,), tensors=(tensor,))
        rtts = []
        for _ in range(trips + 1):
            t0 = time.perf_counter()
            link.send_blocking(echo)
            back = link.receive_blocking()
            rtts.append(time.perf_counter() - t0)
            link.release(back)
        out[f"sync_rtt_{name}"] = statistics.median(rtts[1:])
        if link.backend == "shm":
            handoffs = []
            for _ in range(HANDOFFS):
                slab = link.allocate(torch.float32, (size // 4,))
                start = time.perf_counter_ns()
                link.send_blocking(
                    Activations(session_id="b", step=2, positions=(0,), tensors=(slab,))
                )
                got = link.receive_blocking()
                handoffs.append((got.token_ids[0] - start) / 1e3)
            out[f"sync_handoff_us_{name}"] = statistics.median(handoffs[WARMUP:])


def run(backends: list[str], sizes: dict[str, int], rounds: int = 3) -> dict[str, Any]:
    """``rounds`` full runs (baseline, then ours, per backend); each figure is the median
    over rounds of that round's value, each ratio the median of the per-round ratios."""
    runs = [run_once(backends, sizes) for _ in range(rounds)]
    result: dict[str, Any] = {"rounds": rounds}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            result[key] = round(statistics.median(r[key] for r in runs), 3)
        else:
            result[key] = value
    if "tcp" in backends and SEALED in backends:
        from sealing import paired_sealing  # bench/sealing.py

        result.update(paired_sealing(sizes, rounds, PIN, SPIN_US))
    return result


def run_once(backends: list[str], sizes: dict[str, int]) -> dict[str, Any]:
    import torch
    import trio

    torch.set_num_threads(1)
    _pin(0)
    from hetmesh.transport import DataPlaneConfig

    spin = SPIN_US[0] if SPIN_US else DataPlaneConfig(peer_id="x").spin_us
    result: dict[str, Any] = {"pinned_cpus": list(PIN), "spin_us": spin}
    for backend in backends:
        counts = {name: _count(size, backend) for name, size in sizes.items()}
        base = baseline(sizes, counts)
        ours, reason = trio.run(_measure_link, backend, sizes, counts)
        result[f"{backend}_reason"] = reason
        for name in sizes:
            tput, rtt = ours[f"throughput_{name}"], ours[f"rtt_{name}"]
            result[f"{backend}_throughput_GBps_{name}"] = round(tput / 1e9, 3)
            result[f"baseline_{backend}_throughput_GBps_{name}"] = round(
                base[f"throughput_{name}"] / 1e9, 3
            )
            result[f"{backend}_throughput_ratio_{name}"] = round(
                tput / base[f"throughput_{name}"], 3
            )
            if f"sync_throughput_{name}" in ours:
                sync = ours[f"sync_throughput_{name}"]
                result[f"{backend}_sync_throughput_GBps_{name}"] = round(sync / 1e9, 3)
                result[f"{backend}_sync_throughput_ratio_{name}"] = round(
                    sync / base[f"throughput_{name}"], 3
                )
            result[f"baseline_{backend}_rtt_us_{name}"] = round(base[f"rtt_{name}"] * 1e6, 1)
            result[f"{backend}_async_rtt_us_{name}"] = round(rtt * 1e6, 1)
            result[f"{backend}_async_rtt_ratio_{name}"] = round(rtt / base[f"rtt_{name}"], 3)
            rtt = ours.get(f"sync_rtt_{name}", rtt)
            result[f"{backend}_rtt_us_{name}"] = round(rtt * 1e6, 1)
            result[f"{backend}_rtt_ratio_{name}"] = round(rtt / base[f"rtt_{name}"], 3)
            if f"handoff_us_{name}" in ours:
                result[f"{backend}_async_handoff_us_{name}"] = round(ours[f"handoff_us_{name}"], 1)
                handoff = ours.get(f"sync_handoff_us_{name}", ours[f"handoff_us_{name}"])
                result[f"{backend}_handoff_us_{name}"] = round(handoff, 1)
    return result


def _table(result: dict[str, Any], backends: list[str], sizes: dict[str, int]) -> str:
    lines = [
        "| backend | payload | GB/s | baseline GB/s | ratio | RTT µs (blocking API) "
        "| RTT µs (async API) | baseline RTT µs | ratio (blocking) | ratio (async) "
        "| shm handoff µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in backends:
        for n in sizes:
            lines.append(
                f"| {b} | {n} | {result[f'{b}_throughput_GBps_{n}']} "
                f"| {result[f'baseline_{b}_throughput_GBps_{n}']} "
                f"| {result[f'{b}_throughput_ratio_{n}']} | {result[f'{b}_rtt_us_{n}']} "
                f"| {result[f'{b}_async_rtt_us_{n}']} "
                f"| {result[f'baseline_{b}_rtt_us_{n}']} | {result[f'{b}_rtt_ratio_{n}']} "
                f"| {result[f'{b}_async_rtt_ratio_{n}']} "
                f"| {result.get(f'{b}_handoff_us_{n}', '')} |"
            )
    for b in backends:
        lines.append(f"\n{b}: {result[f'{b}_reason']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--backends", nargs="+", default=list(ALL_BACKENDS))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=3, help="repeat and take medians")
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin client and server to separate CPUs"
    )
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="DataPlaneConfig.spin_us for both ends (default: the config's default; 0: never poll)",
    )
    args = parser.parse_args()
    if args.spin_us is not None:
        SPIN_US[:] = [args.spin_us]
    cpus = sorted(os.sched_getaffinity(0))
    if not args.no_pin and len(cpus) >= 2:
        PIN[:] = cpus[:2]
    sizes = {name: SIZES[name] for name in args.sizes}
    result = run(args.backends, sizes, args.rounds)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(_table(result, args.backends, sizes))


if __name__ == "__main__":
    main()
