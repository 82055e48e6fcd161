"""A stage's inbox is bounded: a session's feeder that floods it with activations is
refused (``InvalidRequest``) past a few waiting steps, and the session still
computes the steps it took. Real stages of a seeded tiny Llama (``tiny_hops``)."""

from __future__ import annotations

import pytest
import torch
import trio

from hetmesh.errors import InvalidRequest
from hetmesh.node.control import OpenSession
from hetmesh.node.gateway import Hop
from hetmesh.node.stage_server import QUEUED_PER_SESSION
from hetmesh.partition.sampling import SamplingParams
from hetmesh.transport.frames import Activations
from tests.integration.node.tiny_hops import GATEWAY, Hops, save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-inbox"))


async def test_a_flooding_feeder_is_refused_and_the_session_carries_on(tiny_model):
    hops = Hops(tiny_model, {"a": (0, 2), "b": (2, 4)}, [(Hop("a", 0, 2), Hop("b", 2, 4))])
    server = hops.servers["a"]
    opened = server.handle(
        OpenSession(
            session_id="s",
            start=0,
            end=2,
            next_peer="b",
            gateway=GATEWAY,
            max_tokens=32,
            sampling=SamplingParams(),
        ),
        GATEWAY,
    )
    assert opened.ok, opened
    released: list[int] = []

    def step(i: int) -> Activations:
        ids = torch.tensor([3], dtype=torch.int64)
        return Activations(session_id="s", step=i, positions=(i,), tensors=(ids,))

    for i in range(QUEUED_PER_SESSION):  # the batching loop is not running: they wait
        server.submit(step(i), release=lambda: None, sender=GATEWAY)
    for i in range(QUEUED_PER_SESSION, QUEUED_PER_SESSION + 100):
        with pytest.raises(InvalidRequest, match="activations waiting here"):
            server.submit(step(i), release=lambda i=i: released.append(i), sender=GATEWAY)
    assert released == list(range(QUEUED_PER_SESSION, QUEUED_PER_SESSION + 100))
    assert server.statistics().queue_depth == QUEUED_PER_SESSION
    hops.servers["b"].handle(
        OpenSession(
            session_id="s",
            start=2,
            end=4,
            next_peer=GATEWAY,
            gateway=GATEWAY,
            previous_peer="a",
            max_tokens=32,
            sampling=SamplingParams(),
        ),
        GATEWAY,
    )
    tokens: list[int] = []
    all_out = trio.Event()

    def on_frame(frame, sender=None) -> None:  # the last stage's tokens, at the gateway
        tokens.append(frame.step)
        if len(tokens) == QUEUED_PER_SESSION:
            all_out.set()

    hops.gateway.on_frame = on_frame  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        with trio.fail_after(60):  # the waiting steps run, one a round, in order
            await all_out.wait()
        nursery.cancel_scope.cancel()
    assert tokens == list(range(QUEUED_PER_SESSION))
    assert server.statistics().items == QUEUED_PER_SESSION
    assert server.statistics().errors == 0
    # room again: the next step is taken
    server.submit(step(QUEUED_PER_SESSION), release=lambda: None, sender=GATEWAY)
