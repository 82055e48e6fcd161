"""Standby replicas: devices a latency plan leaves idle back up one of its stages.

A latency plan uses the fewest, fastest devices; the rest would sit idle. Each
spare device that can hold one of the primary pipeline's stages becomes a
replica of it: the plan gains a pipeline equal to the primary one with that
stage swapped for the spare device (the other stages are shared). The router
prefers the faster primary while it is healthy; when a stage's peer dies or
stalls, its sessions are replayed through the replica at once instead of
waiting for a new plan and a fresh stage load.

A plan that needs every device leaves none spare. :func:`with_standby` then
looks for a placement that frees one device at a small latency cost (at most
``STANDBY_MAX_COST``, 10%): a failure then costs a replay instead of a new
plan and a stage load, and measurements that differ by noise (devices that
share a machine, a calibration taken while others start) no longer decide
between a slightly faster plan and a fault-tolerant one.

Pure: placement in, plan out, scored by :func:`~hetmesh.scheduler.planner.evaluate`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler.cost import sort_devices
from hetmesh.scheduler.planner import evaluate, placement, plan
from hetmesh.scheduler.records import Plan, PlanConstraints

Placed = tuple[str, str, int, int]  # (peer_id, device, start, end)

STANDBY_MAX_COST = 0.1  # latency a standby replica is worth: 10% of the best plan's
_MAX_TRIED = 16  # devices tried as the spare (slowest first) when every one is used


def with_standby(
    best: Plan,
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    constraints: PlanConstraints,
    max_cost: float = STANDBY_MAX_COST,
    previous: Plan | None = None,
) -> Plan:
    """``best`` with standby replicas; if it uses every device, maybe a plan that frees one.

    The alternative leaves one device out, is planned afresh on the rest and
    must predict at most ``max_cost`` more latency than ``best``; the freed
    device then backs one of its stages up. Without such a plan, ``best``
    plus whatever replicas fit (none, if no device is spare). ``previous``: the
    plan followed so far (see :func:`add_standby_replicas`).
    """
    backed = add_standby_replicas(
        best, devices, links, model, constraints=constraints, previous=previous
    )
    if backed is not best or best.objective != "latency" or len(best.pipelines) != 1:
        return backed
    used = {(s.peer_id, s.device) for s in best.pipelines[0].stages}
    if any((d.peer_id, d.device) not in used for d in devices):
        return backed  # a spare exists but backs nothing up (too small for any stage)
    limit = best.decode_latency_s * (1.0 + max_cost)
    found: Plan | None = None
    slowest_first = sorted(sort_devices(devices), key=lambda d: d.matmul_flops)
    for spare in slowest_first[:_MAX_TRIED]:
        rest = [d for d in devices if d is not spare]
        try:
            alternative = plan(
                rest,
                links,
                model,
                objective="latency",
                constraints=constraints,
                epoch=best.epoch,
            )
        except InsufficientCapacity:
            continue
        if alternative.decode_latency_s > limit:
            continue
        replicated = add_standby_replicas(
            alternative, devices, links, model, constraints=constraints, previous=previous
        )
        if len(replicated.pipelines) > 1 and (
            found is None or replicated.decode_latency_s < found.decode_latency_s
        ):
            found = replicated
    return found if found is not None else best


def add_standby_replicas(
    plan: Plan,
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    constraints: PlanConstraints,
    previous: Plan | None = None,
) -> Plan:
    """``plan`` plus one replica pipeline per spare device that can hold a stage.

    Each spare device (in the cost model's device order) replicates the stage
    with the fewest replicas so far, breaking ties by whether it held that very
    stage in ``previous`` (the plan followed so far: a device demoted from the
    primary keeps the stage it has loaded, and nothing reloads) and then by the
    replica pipeline's predicted latency. Latency plans only: a throughput plan
    already spends every useful device on replicas of its own. Deterministic.
    """
    if plan.objective != "latency" or not plan.pipelines:
        return plan
    base = [list(p) for p in placement(plan)]
    primary = base[0]
    used = {(peer, dev) for pipeline in base for peer, dev, _, _ in pipeline}
    spare = [d for d in sort_devices(devices) if (d.peer_id, d.device) not in used]
    replicas = {(a, b): 0 for _, _, a, b in primary}
    held = (
        {(s.peer_id, s.device, s.start, s.end) for p in previous.pipelines for s in p.stages}
        if previous is not None
        else set()
    )
    added: list[list[Placed]] = []
    for device in spare:
        best: tuple[tuple[int, bool, float, int], list[Placed]] | None = None
        for i, (_, _, start, end) in enumerate(primary):
            candidate = list(primary)
            candidate[i] = (device.peer_id, device.device, start, end)
            scored = evaluate(
                [candidate], devices, links, model, objective="latency", constraints=constraints
            )
            if scored is None:
                continue  # the spare device cannot hold this stage
            kept = (device.peer_id, device.device, start, end) in held
            rank = (replicas[(start, end)], not kept, scored.decode_latency_s, i)
            if best is None or rank < best[0]:
                best = (rank, candidate)
        if best is not None:
            added.append(best[1])
            _, _, start, end = primary[best[0][3]]
            replicas[(start, end)] += 1
    if not added:
        return plan
    combined = evaluate(
        base + added,
        devices,
        links,
        model,
        objective="latency",
        constraints=constraints,
        strategy=f"{plan.strategy}+standby",
        epoch=plan.epoch,
    )
    return combined if combined is not None else plan


def standby_takeovers(old: Plan | None, new: Plan) -> frozenset[str]:
    """Peers a new latency plan demotes from its primary pipeline to standby.

    A peer of ``old``'s primary that is not in ``new``'s primary but still
    holds the same stage in ``new`` (a standby replica of it): a standby took
    its place while it is alive — typically a re-plan on measured step times
    found it slow. Its stage stays loaded and ready, so nothing retires it and
    its running sessions would stay on the slow peer: the gateway moves them
    off it, KV and all (:meth:`~hetmesh.node.gateway.Gateway.move_off`).
    Peers whose stage the new plan drops are not named: their stage retires
    once the new ones are loaded, and that moves its sessions.
    """
    if old is None or old.objective != "latency" or new.objective != "latency":
        return frozenset()
    kept = {(s.peer_id, s.start, s.end) for p in new.pipelines for s in p.stages}
    primary = new.pipelines[0].peers
    return frozenset(
        s.peer_id
        for s in old.pipelines[0].stages
        if s.peer_id not in primary and (s.peer_id, s.start, s.end) in kept
    )


__all__ = ["STANDBY_MAX_COST", "add_standby_replicas", "standby_takeovers", "with_standby"]
