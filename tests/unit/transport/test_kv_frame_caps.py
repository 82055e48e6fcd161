"""A KVBlock's declared size is checked against its session's KV before its payload is
allocated (issue 45, item 6): on the header alone, and over a real tcp link."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import trio

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport import DataPlaneConfig, open_data_plane
from hetmesh.transport.frames import (
    DEFAULT_LIMITS,
    PREFIX_BYTES,
    KVBlock,
    encode_parts,
    parse_header,
    parse_prefix,
)
from tests.unit.transport.test_links import link_pair

EXPECTED = {"awaited": 2 * 3 * 16 * 8 * 4}  # 2 (keys, values) x 3 layers x 16 tokens x 8 x f32


def kv_bytes(session_id: str) -> int | None:
    return EXPECTED.get(session_id)


LIMITS = dataclasses.replace(DEFAULT_LIMITS, kv_block_bytes=kv_bytes)


def block(session_id: str, tokens: int) -> KVBlock:
    keys = torch.zeros(3, 1, tokens, 8)
    return KVBlock(session_id=session_id, first_layer=0, start=0, tensors=(keys, keys.clone()))


def parsed(frame: KVBlock):
    head, _, _ = encode_parts(frame, DEFAULT_LIMITS)
    prefix = parse_prefix(head, LIMITS)
    return parse_header(prefix, memoryview(head)[PREFIX_BYTES:], LIMITS)


def test_a_kvblock_that_fits_its_sessions_kv_passes() -> None:
    assert parsed(block("awaited", 16)).values["session_id"] == "awaited"
    assert parsed(block("awaited", 5)).specs[0].shape == (3, 1, 5, 8)


@pytest.mark.parametrize(
    ("session_id", "tokens", "why"),
    [
        ("awaited", 17, "whose KV here is at most"),
        ("awaited", 4096, "whose KV here is at most"),
        ("never-opened", 1, "no KV of session 'never-opened' is expected here"),
    ],
)
def test_a_kvblock_beyond_its_sessions_kv_is_refused_on_its_header(
    session_id: str, tokens: int, why: str
) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        parsed(block(session_id, tokens))


async def test_an_oversized_kvblock_is_refused_before_its_payload_is_allocated() -> None:
    config = {"backends": ("tcp", "libp2p"), "limits": LIMITS}
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", **config)) as a,  # type: ignore[arg-type]
        open_data_plane(DataPlaneConfig(peer_id="B", **config)) as b,  # type: ignore[arg-type]
    ):
        la, lb = await link_pair(a, b)
        assert lb.backend == "tcp"
        with trio.fail_after(30):
            await la.send(block("awaited", 16))  # fits: arrives
            frame = await lb.receive()
            lb.release(frame)
            allocated = lb.pool.statistics().allocations
            async with trio.open_nursery() as nursery:

                async def send_big() -> None:
                    with contextlib.suppress(Exception):  # the receiver gives up on the link
                        await la.send(block("awaited", 64 << 10))  # 48 MiB for 6 KiB of KV

                nursery.start_soon(send_big)
                with pytest.raises(RemoteProtocolError, match="at most"):
                    await lb.receive()
                nursery.cancel_scope.cancel()
        assert lb.pool.statistics().allocations == allocated  # nothing allocated for it
        await la.aclose()
        await lb.aclose()
