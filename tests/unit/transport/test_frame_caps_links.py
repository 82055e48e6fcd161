"""Over real links, a frame larger than its kind may carry ends the link on its prefix."""

from __future__ import annotations

import pytest
import torch

from hetmesh.errors import MeshError
from hetmesh.transport import Activations, KVBlock
from hetmesh.transport.frames import Limits

from .test_links import link_pair, planes

CAPPED = Limits(max_kv_block_bytes=1 << 20, max_activation_bytes=1 << 20)


@pytest.mark.parametrize("backend", ["tcp", "shm", "libp2p"])
async def test_an_oversized_kv_block_ends_the_link_and_a_fitting_one_passes(backend: str) -> None:
    async with planes(backend, limits=CAPPED) as (a, b):
        la, lb = await link_pair(a, b)
        fits = torch.zeros(2, 256, 512)  # 512 KiB a tensor, 1 MiB in all
        kv = KVBlock(session_id="s", first_layer=0, start=0, tensors=(fits[0], fits[1]))
        await la.send(kv)
        got = await lb.receive()
        assert got == kv
        lb.release(got)
        big = torch.zeros(2, 256, 513)  # just past the cap
        await la.send(KVBlock(session_id="s", first_layer=0, start=0, tensors=(big[0], big[1])))
        with pytest.raises(MeshError, match="can need"):
            await lb.receive()
        await la.aclose()
        await lb.aclose()
        # and activations on a new link are judged by their own cap
        la, lb = await link_pair(a, b)
        await la.send(Activations(session_id="s", step=0, positions=(0,), tensors=(fits[0],)))
        got = await lb.receive()
        assert got.tensors[0].shape == fits[0].shape
        lb.release(got)
        await la.aclose()
        await lb.aclose()
