"""A standby takes over a stage that is alive but slow: its sessions move with their KV.

In-process tiny mesh (real stage servers, hops as function calls, as in
``test_kv_migration.py``): the plan's primary pipeline runs its middle stage
on b1, which serves slowly; a standby b2 holds the same units. A new plan
(the re-plan on measured step times, see ``test_standby_takeover.py``) puts
b2 in the primary and keeps b1 as a standby, so b1's stage stays ready and
nothing retires it. The serving loop hands both plans to
``Gateway.move_replaced``: the running stream moves from b1 to b2 with its
KV between two steps, without replaying its history, and its output equals
the single-process reference.
"""

from __future__ import annotations

import trio

from hetmesh.node.gateway import Gateway
from hetmesh.partition.sampling import SamplingParams
from hetmesh.scheduler.records import Pipeline, Plan, Stage
from hetmesh.transport.frames import Frame
from tests.integration.node.test_kv_migration import FIRST, SECOND, MovingMesh
from tests.integration.node.test_serving_inprocess import (  # the tiny model and helpers
    PROMPTS,
    collect,
    reference,
    tiny_model,
)

__all__ = ["tiny_model"]  # a fixture, used by name

SLOW_S = 0.05  # what b1 adds to every frame it sends: alive, answering pings, slow


class SlowMesh(MovingMesh):
    async def send(self, sender: str, peer: str, frame: Frame) -> None:
        if sender == "b1":
            await trio.sleep(SLOW_S)
        await super().send(sender, peer, frame)


def plan_of(*routes) -> Plan:
    """A latency plan whose pipelines are ``routes`` (the first is the primary)."""
    pipelines = tuple(
        Pipeline(
            stages=tuple(
                Stage(
                    peer_id=hop.peer_id,
                    device="cpu",
                    start=hop.start,
                    end=hop.end,
                    decode_step_s=0.01,
                    batch_step_s=0.01,
                    prefill_s_per_1k=1.0,
                    link_out_s=0.001,
                    memory_bytes=1,
                )
                for hop in route
            ),
            decode_latency_s=0.03,
            prefill_s_per_1k=3.0,
            bottleneck_s=0.01,
            throughput_tps=30.0,
        )
        for route in routes
    )
    return Plan(
        epoch=1,
        model_name="tiny",
        objective="latency",
        strategy="test+standby",
        pipelines=pipelines,
        objective_value=0.03,
        decode_latency_s=0.03,
        prefill_s_per_1k=3.0,
        throughput_tps=30.0,
    )


async def run_replaced(mesh: MovingMesh, gateway: Gateway, at: int, tokens: int) -> list[int]:
    before, after = plan_of(FIRST, SECOND), plan_of(SECOND, FIRST)

    def replan(n: int) -> None:
        if n == at:  # the new plan arrives while the stream runs on b1
            assert gateway.move_replaced(before, after) == 1

    async with trio.open_nursery() as nursery:
        for server in mesh.servers.values():
            await nursery.start(server.serve)
        out = await collect(
            gateway, PROMPTS[0], SamplingParams(max_new_tokens=tokens), on_token=replan
        )
        nursery.cancel_scope.cancel()
    return out


async def test_a_standby_replacing_a_slow_stage_takes_its_sessions_kv_and_all(tiny_model):
    mesh = SlowMesh(tiny_model)
    gateway = mesh.make_gateway()
    out = await run_replaced(mesh, gateway, at=6, tokens=16)
    assert out == reference(tiny_model, PROMPTS[0], 16)
    g = gateway.statistics()
    assert g.migrations >= 1
    assert (g.migration_fallbacks, g.move_replays, g.recoveries, g.preemptions) == (0, 0, 0, 0)
    b1, b2 = mesh.servers["b1"].statistics(), mesh.servers["b2"].statistics()
    assert (b2.kv.migrations, b1.kv.migrations_out) == (1, 1)
    # no replay: the standby computed only the steps after the move, which came after
    # the step already on its way when the sixth token was handed on (nine of sixteen)
    assert b2.tokens == 9
    assert b1.tokens == len(PROMPTS[0]) + 6
    for peer, server in mesh.servers.items():
        assert server.statistics().kv.sessions == 0, peer
