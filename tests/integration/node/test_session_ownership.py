"""A session belongs to its route: a member off the route can neither feed, close,
cancel nor answer it, and the session carries on untouched.

Real stages of a seeded tiny Llama and a real gateway (``tiny_hops``). The
multi-process check over real links is in ``test_mesh_serving.py``.
"""

from __future__ import annotations

from contextlib import aclosing

import pytest
import torch
import trio

from hetmesh.errors import InvalidRequest
from hetmesh.node.control import CloseSession, OpenSession
from hetmesh.node.gateway import Hop
from hetmesh.partition.sampling import SamplingParams
from hetmesh.transport.frames import Activations, Error, Tokens
from tests.integration.node.tiny_hops import (
    GATEWAY,
    INTRUDER,
    PROMPT,
    Hops,
    reference,
    save_tiny_model,
)

TWO_STAGES = (Hop("a", 0, 2), Hop("b", 2, 4))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-owned"))


def two_stages(model_dir) -> Hops:
    return Hops(model_dir, {"a": (0, 2), "b": (2, 4)}, [TWO_STAGES])


async def test_a_member_off_the_route_cannot_touch_a_session(tiny_model):
    hops = two_stages(tiny_model)
    out: list[int] = []
    attacked = trio.Event()
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)

        async def attack(session_id: str) -> None:
            a, b = hops.servers["a"], hops.servers["b"]
            hidden = torch.zeros(1, 64)
            # activations for both stages, from a peer that feeds neither
            await hops.deliver(
                INTRUDER,
                "a",
                Activations(
                    session_id=session_id,
                    step=len(out),
                    positions=(len(PROMPT) + len(out),),
                    tensors=(torch.tensor([3]),),
                ),
            )
            await hops.deliver(
                INTRUDER,
                "b",
                Activations(session_id=session_id, step=0, positions=(0,), tensors=(hidden,)),
            )
            # a stage's own neighbour is still not the first stage's feeder
            with pytest.raises(InvalidRequest, match="takes activations from gw only"):
                a.submit(
                    Activations(session_id=session_id, step=0, positions=(0,), tensors=(hidden,)),
                    release=lambda: None,
                    sender="b",
                )
            # close or open it as someone else
            for server in (a, b):
                reply = server.handle(CloseSession(session_id=session_id), INTRUDER)
                assert not reply.ok
                assert "belongs to gateway gw" in reply.message
                with pytest.raises(InvalidRequest, match="belongs to gateway gw"):
                    server.check_control(session_id, INTRUDER)  # what a Cancel frame meets
            forged = OpenSession(
                session_id="forged",
                start=0,
                end=2,
                next_peer=INTRUDER,
                gateway=GATEWAY,
                max_tokens=8,
                sampling=SamplingParams(),
            )
            assert not a.handle(forged, INTRUDER).ok
            # a token the gateway did not ask for: dropped, not streamed
            hops.gateway.on_frame(
                Tokens(session_id=session_id, step=len(out), token_ids=(0,)), INTRUDER
            )
            hops.gateway.on_frame(Error(code=1, message="forged", session_id=session_id), INTRUDER)
            attacked.set()

        async def observe() -> None:
            async with aclosing(
                hops.gateway.generate(PROMPT, SamplingParams(max_new_tokens=12))
            ) as tokens:
                async for token in tokens:
                    out.append(token)
                    if len(out) == 4:
                        (session_id,) = hops.gateway.session_ids()
                        await attack(session_id)

        await observe()
        nursery.cancel_scope.cancel()
    assert attacked.is_set()
    assert out == reference(tiny_model, 12)  # untouched: not one token changed or lost
    assert len(hops.refused) == 2
    assert all("takes activations from" in m for m in hops.refused), hops.refused
    stats = hops.gateway.statistics()
    assert stats.foreign_frames == 2
    assert stats.recoveries == 0  # the forged error did not fail the step
    for server in hops.servers.values():
        assert server.statistics().kv.sessions == 0  # the gateway's own close still worked


async def test_the_sessions_own_route_is_obeyed(tiny_model):
    """Its gateway may close it; a node's own calls (no sender) are trusted."""
    hops = two_stages(tiny_model)
    server = hops.servers["a"]
    request = OpenSession(
        session_id="s",
        start=0,
        end=2,
        next_peer="b",
        gateway=GATEWAY,
        max_tokens=8,
        sampling=SamplingParams(),
    )
    assert server.handle(request, GATEWAY).ok
    frame = Activations(session_id="s", step=0, positions=(0,), tensors=(torch.tensor([1]),))
    server.submit(frame, release=lambda: None, sender=GATEWAY)
    server.submit(frame, release=lambda: None)  # from this node itself
    server.check_control("s", None)
    assert server.handle(CloseSession(session_id="s"), GATEWAY).ok
    assert server.statistics().kv.sessions == 0
    with pytest.raises(InvalidRequest, match="unknown session"):
        server.submit(frame, release=lambda: None, sender=GATEWAY)
