from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.resources import DeviceProfile
from hetmesh.scheduler.planner import plan
from hetmesh.scheduler.records import MeshLoad, PlanConstraints, RouteRequest
from hetmesh.scheduler.router import route
from hetmesh.scheduler.standby import add_standby_replicas

MODEL = model_profile(KNOWN_SHAPES["smollm2-135m"])
CONS = PlanConstraints(max_context_tokens=2048, max_sessions=4, reserve_bytes=64 << 20)


def cpu(peer: str, memory_mib: int, flops: float = 1e11) -> DeviceProfile:
    return DeviceProfile(
        peer_id=peer,
        device="cpu",
        backend="cpu",
        name="cpu",
        memory_total_bytes=memory_mib << 20,
        memory_free_bytes=memory_mib << 20,
        matmul_flops=flops,
        memory_bandwidth_bps=1e10,
    )


def test_standby_replicates_a_stage_on_the_spare_device():
    devices = [cpu(p, 500) for p in ("a", "b", "c", "d")]
    primary = plan(devices, [], MODEL, constraints=CONS)
    assert len(primary.pipelines) == 1
    used = {s.peer_id for s in primary.pipelines[0].stages}
    assert len(used) == 3  # the memory cap forces three stages; one device is spare
    spare = ({"a", "b", "c", "d"} - used).pop()
    full = add_standby_replicas(primary, devices, [], MODEL, constraints=CONS)
    assert len(full.pipelines) == 2
    first, second = full.pipelines
    assert first.key == primary.pipelines[0].key  # the primary stays first
    swapped = [(x, y) for x, y in zip(first.stages, second.stages, strict=True) if x != y]
    assert len(swapped) == 1
    assert swapped[0][1].peer_id == spare
    assert (swapped[0][0].start, swapped[0][0].end) == (swapped[0][1].start, swapped[0][1].end)
    # the router keeps the primary while healthy and fails over to the replica
    assert route(full, MeshLoad(), RouteRequest()).key == first.key
    down = swapped[0][0].peer_id
    assert route(full, MeshLoad(unhealthy_peers=(down,)), RouteRequest()).key == second.key


def test_standby_leaves_plans_without_spare_or_with_too_small_devices_alone():
    devices = [cpu(p, 500) for p in ("a", "b", "c")]
    primary = plan(devices, [], MODEL, constraints=CONS)
    assert add_standby_replicas(primary, devices, [], MODEL, constraints=CONS) == primary
    tiny = [*devices, cpu("z", 80)]  # cannot hold any stage of this plan
    primary = plan(tiny, [], MODEL, constraints=CONS)
    assert len(add_standby_replicas(primary, tiny, [], MODEL, constraints=CONS).pipelines) == 1


def test_standby_is_deterministic():
    devices = [
        cpu(p, 500, flops)
        for p, flops in (("a", 1e11), ("b", 2e11), ("c", 1e11), ("d", 5e10), ("e", 3e11))
    ]
    primary = plan(devices, [], MODEL, constraints=CONS)
    one = add_standby_replicas(primary, devices, [], MODEL, constraints=CONS)
    two = add_standby_replicas(primary, list(reversed(devices)), [], MODEL, constraints=CONS)
    assert one == two


def test_a_plan_using_every_device_frees_one_for_a_standby_if_that_costs_little():
    from hetmesh.scheduler.planner import evaluate
    from hetmesh.scheduler.standby import with_standby

    devices = [cpu(p, 500) for p in ("a", "b", "c", "d")]
    # every device busy: the embedding alone on "a" (what a skewed calibration once chose)
    placed = [("a", "cpu", 0, 1), ("b", "cpu", 1, 12), ("c", "cpu", 12, 23), ("d", "cpu", 23, 32)]
    busy = evaluate([placed], devices, [], MODEL, objective="latency", constraints=CONS)
    assert busy is not None
    alone = add_standby_replicas(busy, devices, [], MODEL, constraints=CONS)
    assert len(alone.pipelines) == 1  # no spare device: nothing to back up

    backed = with_standby(busy, devices, [], MODEL, constraints=CONS)
    assert len(backed.pipelines) == 2
    primary, replica = backed.pipelines
    assert len({s.peer_id for s in primary.stages}) == 3  # one device freed ...
    swapped = [(x, y) for x, y in zip(primary.stages, replica.stages, strict=True) if x != y]
    assert len(swapped) == 1  # ... backs one stage up
    assert swapped[0][1].peer_id not in {s.peer_id for s in primary.stages}
    assert primary.decode_latency_s <= busy.decode_latency_s * 1.1

    # the bound is on predicted latency: just under the freed plan's cost, keep the busy one
    extra = primary.decode_latency_s / busy.decode_latency_s - 1.0
    kept = with_standby(busy, devices, [], MODEL, constraints=CONS, max_cost=extra - 1e-6)
    assert kept == busy
    again = with_standby(busy, devices, [], MODEL, constraints=CONS, max_cost=extra + 1e-6)
    assert again == backed


def test_with_standby_keeps_a_plan_that_needs_every_device():
    from hetmesh.scheduler.standby import with_standby

    devices = [cpu(p, 500) for p in ("a", "b", "c")]  # the model needs all three
    primary = plan(devices, [], MODEL, constraints=CONS)
    assert with_standby(primary, devices, [], MODEL, constraints=CONS) == primary
    spare = [*devices, cpu("d", 500)]  # a spare device: the plain replica rule applies
    primary = plan(spare, [], MODEL, constraints=CONS)
    assert with_standby(primary, spare, [], MODEL, constraints=CONS) == add_standby_replicas(
        primary, spare, [], MODEL, constraints=CONS
    )
