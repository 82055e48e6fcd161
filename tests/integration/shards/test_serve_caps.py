"""A holder answers a bounded number of shard requests at once, streaming each reply
from disk (real libp2p hosts)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from hetmesh.discovery.table import Health
from hetmesh.node.daemon import Node, run_node
from hetmesh.shards.fetch import SHARDS_PROTOCOL, Shards, request_bytes
from hetmesh.shards.manifest import load_or_build
from hetmesh.shards.serve_caps import MAX_REQUESTS_PER_PEER
from tests.integration.discovery.discovery_nodes import in_process_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def _until(predicate: Callable[[], object], timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the daemons' own tasks change it
            await trio.sleep(0.05)


async def test_a_peer_holding_requests_open_is_refused_more_until_it_lets_go(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """B opens as many shard requests as a peer may have and sends none of them; its
    next request is refused at once (before the fix it was answered: any number of
    requests, each holding a tensor in memory), and answered once B lets go."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    manifest = load_or_build(folder)
    async with trio.open_nursery() as nursery:
        a: Node = await nursery.start(run_node, in_process_config(tmp_path, "a"))
        b: Node = await nursery.start(
            run_node, in_process_config(tmp_path, "b", a.discovery.addrs[0])
        )
        await _until(lambda: b.discovery.table.health_of(a.peer_id) is Health.ALIVE, 60)
        shards = Shards(a.discovery, folder, manifest, partial=False)
        a.discovery.add_handler(SHARDS_PROTOCOL, shards.handle)

        async def ask() -> bytes | None:
            return await request_bytes(
                b.discovery, a.peer_id, manifest.id, "manifest", "", max_bytes=1 << 20
            )

        assert await ask() == manifest.canonical()  # answered while nothing is held
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        silent: list[Any] = []
        for _ in range(MAX_REQUESTS_PER_PEER):  # open, then silence
            silent.append(
                await b.discovery.host.new_stream(
                    ID.from_base58(a.peer_id), [TProtocol(SHARDS_PROTOCOL)]
                )
            )
        await _until(lambda: shards.caps.in_flight == MAX_REQUESTS_PER_PEER, 30)
        assert await ask() is None  # refused: busy
        assert shards.caps.refused == 1
        for stream in silent:
            await stream.reset()
        await _until(lambda: shards.caps.in_flight == 0, 30)
        assert await ask() == manifest.canonical()
        a.request_stop()
        b.request_stop()


async def test_a_reply_is_streamed_from_disk_and_a_reader_that_stops_costs_a_chunk(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest tensor (12 MiB) comes back whole and equal to the checkpoint's bytes;
    a requester that stops reading after the first chunk made the holder read a few
    chunks, not the tensor (before: the whole tensor was read before a byte was sent)."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from hetmesh.discovery import wire
    from hetmesh.partition.checkpoint import CheckpointReader
    from hetmesh.shards import serve

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    manifest = load_or_build(folder)
    big = max(manifest.tensors, key=lambda t: t.nbytes)
    assert big.nbytes > 8 * serve.CHUNK_BYTES
    read: list[int] = []
    original = serve.read_span

    def counted(span: Any, offset: int = 0, size: int | None = None) -> bytes:
        data = original(span, offset, size)
        read.append(len(data))
        return data

    monkeypatch.setattr(serve, "read_span", counted)
    async with trio.open_nursery() as nursery:
        a: Node = await nursery.start(run_node, in_process_config(tmp_path, "a"))
        b: Node = await nursery.start(
            run_node, in_process_config(tmp_path, "b", a.discovery.addrs[0])
        )
        await _until(lambda: b.discovery.table.health_of(a.peer_id) is Health.ALIVE, 60)
        shards = Shards(a.discovery, folder, manifest, partial=False)
        a.discovery.add_handler(SHARDS_PROTOCOL, shards.handle)

        got = await request_bytes(
            b.discovery, a.peer_id, manifest.id, "tensor", big.name, max_bytes=big.nbytes
        )
        with CheckpointReader(folder) as reader:
            assert got == reader.stored_bytes(big.name)
        assert max(read) <= serve.CHUNK_BYTES

        read.clear()
        stream = await b.discovery.host.new_stream(
            ID.from_base58(a.peer_id), [TProtocol(SHARDS_PROTOCOL)]
        )
        request = {"manifest": manifest.id, "kind": "tensor", "name": big.name}
        await wire.write_frame(stream, wire.encode(request))
        await stream.read(1024)  # the reply has begun; then this requester stops reading
        await stream.reset()
        await _until(lambda: shards.caps.in_flight == 0, 60)
        print(f"read {sum(read)} of {big.nbytes} bytes for a requester that stopped")
        assert sum(read) < big.nbytes // 2
        a.request_stop()
        b.request_stop()
