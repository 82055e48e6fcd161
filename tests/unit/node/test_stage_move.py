"""A node the plan moves from one stage to another (issue 43): where holding both
would exceed the memory it offers, the old stage goes before the new one loads;
where both fit, the old one serves until the new one is ready (the stage host with
the default model's real stages)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import trio

from hetmesh.node.config import ServingConfig
from hetmesh.node.stage_host import StageHost
from hetmesh.partition import stage as stage_module
from hetmesh.partition.materialise import LoadCancelled
from hetmesh.scheduler.records import Pipeline, Plan, PlanConstraints, Stage

pytestmark = [pytest.mark.model, pytest.mark.slow]

outcomes: list[tuple[str, tuple[int, int]]] = []  # loads that ended cancelled, in _move

ME, OTHER = "me", "other"
MIB = 1 << 20


def _plan(epoch: int, mine: tuple[int, int], units: int) -> Plan:
    def stage(peer: str, start: int, end: int) -> Stage:
        return Stage(
            peer_id=peer,
            device="cpu",
            start=start,
            end=end,
            decode_step_s=0.01,
            batch_step_s=0.01,
            prefill_s_per_1k=0.1,
            link_out_s=0.0,
            memory_bytes=600 * MIB,
            weights="int4",
        )

    cuts = sorted({0, *mine, units})
    stages = tuple(
        stage(ME if (a, b) == mine else OTHER, a, b) for a, b in itertools.pairwise(cuts)
    )
    pipeline = Pipeline(
        stages=stages,
        decode_latency_s=0.1,
        prefill_s_per_1k=1.0,
        bottleneck_s=0.1,
        throughput_tps=10.0,
    )
    return Plan(
        epoch=epoch,
        model_name="m",
        objective="latency",
        strategy="exact",
        pipelines=(pipeline,),
        objective_value=0.1,
        decode_latency_s=0.1,
        prefill_s_per_1k=1.0,
        throughput_tps=10.0,
    )


async def _move(
    model_dir: Path, capacity: int, monkeypatch: pytest.MonkeyPatch, *, mid_load: bool = False
) -> tuple[list[set[tuple[int, int]]], StageHost]:
    """Follow a plan giving us [0, 4), then (once it is served, or ``mid_load``: while
    it loads) one giving us [4, 8); returns the stages served when each load began,
    and the host."""
    served_at_load: list[set[tuple[int, int]]] = []
    outcomes.clear()
    real = stage_module.load_stage
    host: StageHost | None = None

    def observed(*args: Any, **kwargs: Any) -> Any:
        assert host is not None
        served_at_load.append(set(host.servers()))  # what this node holds as it loads
        if mid_load and len(served_at_load) == 1:  # the successor's plan, mid-load
            trio.from_thread.run_sync(host.follow, _plan(2, (4, 8), 32), ME)
        try:
            return real(*args, **kwargs)
        except LoadCancelled:
            outcomes.append(("cancelled", args[1:3]))
            raise

    monkeypatch.setattr(stage_module, "load_stage", observed)
    changed = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            host = StageHost(
                model_dir=model_dir,
                model_key="default",
                config=ServingConfig(max_sessions=1),
                constraints=PlanConstraints(max_context_tokens=64),
                device="cpu",
                device_limiter=trio.CapacityLimiter(1),
                send=lambda peer, frame: None,  # type: ignore[arg-type,return-value]
                send_now=lambda peer, frame: True,  # type: ignore[arg-type,return-value]
                held=lambda: None,
                changed=changed.set,
            )
            host.weights = "int4"
            host.capacity = lambda: capacity
            host.start(nursery)
            units = 32
            host.follow(_plan(1, (0, 4), units), ME)
            while not mid_load and set(host.servers()) != {(0, 4)}:
                await changed.wait()
                changed = trio.Event()
            if not mid_load:
                host.follow(_plan(2, (4, 8), units), ME)
            while (4, 8) not in host.servers():
                host.retire_idle()  # the node's plan loop does this every tick
                with trio.move_on_after(0.05):
                    await changed.wait()
                changed = trio.Event()
            host.retire_idle()
            nursery.cancel_scope.cancel()
    return served_at_load, host


async def test_a_move_that_would_not_fit_releases_the_old_stage_first(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads, host = await _move(default_model_dir, 1000 * MIB, monkeypatch)  # 600 + 600 > 1000
    assert loads == [set(), set()]  # [4, 8) loaded with [0, 4) gone
    assert set(host.servers()) == {(4, 8)}


async def test_a_move_that_fits_keeps_the_old_stage_serving_until_the_new_one_is_ready(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads, host = await _move(default_model_dir, 2000 * MIB, monkeypatch)
    assert loads == [set(), {(0, 4)}]  # [0, 4) still held while [4, 8) loaded
    assert set(host.servers()) == {(4, 8)}  # then it retired


@pytest.mark.parametrize("capacity_mib", [1000, 2000])
async def test_a_load_the_plan_left_behind_is_cancelled_and_the_new_one_loads(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capacity_mib: int
) -> None:
    """The bench's OOM of 12-05: a successor's plan moves a node still loading its
    first stage; that load is cancelled (not finished), nothing of it is served, and
    the new one loads with nothing held, whether or not both would fit."""
    loads, host = await _move(default_model_dir, capacity_mib * MIB, monkeypatch, mid_load=True)
    assert outcomes == [("cancelled", (0, 4))]
    assert host.cancelled_loads == 1
    assert loads == [set(), set()]
    assert set(host.servers()) == {(4, 8)}
