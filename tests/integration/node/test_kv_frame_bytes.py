"""What a stage tells its links a KVBlock of a session may carry (issue 45, item 6):
exactly a migration's KV for a session awaiting it, nothing for any other. Real
stage servers of a seeded tiny Llama (``tiny_hops``)."""

from __future__ import annotations

import pytest
import torch
import trio

from hetmesh.node.control import OpenSession
from hetmesh.node.migration import kv_frame
from hetmesh.partition.sampling import SamplingParams
from hetmesh.transport.frames import MAX_DRAFTS
from tests.integration.node.tiny_hops import GATEWAY, PROMPT, Hops, save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-kv-bytes"))


def opening(session_id: str, **kw: object) -> OpenSession:
    fields = {
        "session_id": session_id,
        "start": 0,
        "end": 4,
        "next_peer": GATEWAY,
        "gateway": GATEWAY,
        "max_tokens": 32,
        "prompt_tokens": len(PROMPT),
        "sampling": SamplingParams(max_new_tokens=4),
    } | kw
    return OpenSession(**fields)  # type: ignore[arg-type]


async def test_a_stage_bounds_a_kvblock_by_the_sessions_kv_it_awaits(tiny_model) -> None:
    hops = Hops(tiny_model, {"a": (0, 4), "b": (0, 4)}, [])
    source, target = hops.servers["a"], hops.servers["b"]
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        assert source.handle(opening("s"), GATEWAY).ok
        # the source computes the prompt (its KV is what a migration sends)
        kv = source.kv.get("s")
        with torch.inference_mode():
            source.stage.forward(torch.tensor(PROMPT), kv)
        sent = kv_frame("s", *kv.export())
        assert target.kv_frame_bytes("s") is None  # not open there yet
        assert target.handle(opening("s", migrate_from="a"), GATEWAY).ok
        per_token = sum(t.nbytes for t in sent.tensors) // len(PROMPT)
        # the prompt's KV, and room for a verify step's rejected drafts past it (the
        # source's tail, dropped on arrival: speculative decoding)
        assert target.kv_frame_bytes("s") == per_token * (len(PROMPT) + MAX_DRAFTS)
        assert target.kv_frame_bytes("other") is None
        assert source.kv_frame_bytes("s") is None  # it computes its own: none awaited
        nursery.cancel_scope.cancel()
