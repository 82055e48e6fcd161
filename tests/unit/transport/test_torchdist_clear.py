"""torch.distributed links are never sealed (issue 45, item 11): under
``require_encryption`` they are refused and the link is tcp, sealed; without it a
torchdist link says in its reason that it is in clear. Real data planes in one
process (gloo on CPU stands in for NCCL), a real link, a frame across it."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

from hetmesh.transport import Activations, DataPlaneConfig, open_data_plane
from hetmesh.transport.links import TcpLink
from tests.unit.transport.test_links import link_pair

BACKENDS = ("torchdist", "tcp", "libp2p")


@asynccontextmanager
async def planes(a: dict[str, Any], b: dict[str, Any]) -> Any:
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", backends=BACKENDS, gloo=True, **a)) as pa,
        open_data_plane(DataPlaneConfig(peer_id="B", backends=BACKENDS, gloo=True, **b)) as pb,
    ):
        yield pa, pb


async def _round_trip(la: Any, lb: Any) -> None:
    t = torch.randn(512)
    with trio.fail_after(30):
        await la.send(Activations(session_id="s", step=1, positions=(0,), tensors=(t,)))
        frame = await lb.receive()
    assert torch.equal(frame.tensors[0], t)
    lb.release(frame)


async def test_a_torchdist_link_says_it_is_in_clear() -> None:
    async with planes({}, {}) as (a, b):
        la, lb = await link_pair(a, b)
        assert la.backend == lb.backend == "torchdist"
        assert "in clear" in la.reason
        assert lb.reason == la.reason
        await _round_trip(la, lb)
        await la.aclose()
        await lb.aclose()


@pytest.mark.parametrize("side", ["dialer", "listener", "both"])
async def test_require_encryption_refuses_torchdist_for_a_sealed_tcp_link(side: str) -> None:
    flag = {"require_encryption": True}
    a = flag if side in ("dialer", "both") else {}
    b = flag if side in ("listener", "both") else {}
    async with planes(a, b) as (pa, pb):
        la, lb = await link_pair(pa, pb)
        assert la.backend == lb.backend == "tcp"
        assert "torchdist: an encrypted data plane is required" in la.reason
        assert "never sealed" in la.reason
        assert "sealed (AES-256-GCM)" in la.reason  # same host: sealed all the same
        assert isinstance(la, TcpLink)
        assert isinstance(lb, TcpLink)
        assert la.encrypted
        assert lb.encrypted
        await _round_trip(la, lb)
        await la.aclose()
        await lb.aclose()
