"""``plan(devices, links, model, ...) -> Plan``: where each unit range of the model runs.

Exact for meshes of up to ``SearchOptions.exact_device_limit`` usable devices
(every ordered subset × every contiguous split, see
:mod:`hetmesh.scheduler.exact`), heuristic with local search beyond (see
:mod:`hetmesh.scheduler.heuristic`). Pure and deterministic: the same inputs, in
any order, give the same plan.

Raises :class:`~hetmesh.errors.InsufficientCapacity` when no placement fits; the
coordinator reports it and keeps serving the previous plan, if any.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler.cost import Assignment, CostModel, objective_value
from hetmesh.scheduler.dp import Problem, Solution, balance, refine
from hetmesh.scheduler.exact import exact_latency, exact_throughput
from hetmesh.scheduler.heuristic import Heuristic, SearchOptions
from hetmesh.scheduler.records import Objective, Pipeline, Plan, PlanConstraints

_GIB = 1024**3


def usable_devices(cost: CostModel) -> list[int]:
    """Devices that can run at least one unit within their memory."""
    return [dev for dev in range(len(cost.devices)) if cost.holds_any_unit(dev)]


def shortfall_bytes(cost: CostModel) -> int:
    """How much memory the mesh lacks for the model (a lower bound).

    The model needs every unit's weights and KV budget plus a workspace; each device
    offers its free memory less its reserve. When the total would do but a single
    unit (say the LM head with its logits workspace) fits no device, the shortfall
    is what the best device lacks for that unit.
    """
    devices = range(len(cost.devices))
    available = sum(cost.usable_bytes(dev) for dev in devices)
    if cost.model_bytes() > available:
        return cost.model_bytes() - available
    worst_unit = 0
    for unit in range(cost.n):
        gap = min(
            (
                cost.stage_memory_bytes(dev, unit, unit + 1) - cost.devices[dev].memory_free_bytes
                for dev in devices
            ),
            default=0,
        )
        worst_unit = max(worst_unit, gap)
    return max(1, worst_unit)


def build_plan(
    cost: CostModel,
    solutions: Sequence[Solution],
    *,
    objective: Objective,
    strategy: str,
    epoch: int,
) -> Plan:
    """A :class:`Plan` record with the cost model's predictions for ``solutions``."""
    pipelines = [cost.pipeline(s.stages) for s in solutions]
    if objective == "throughput":
        pipelines.sort(key=lambda p: (-p.throughput_tps, p.key))
    else:
        pipelines.sort(key=lambda p: (p.decode_latency_s, p.key))
    fastest = min(pipelines, key=lambda p: (p.decode_latency_s, p.key))
    return Plan(
        epoch=epoch,
        model_name=cost.model.name,
        objective=objective,
        strategy=strategy,
        pipelines=tuple(pipelines),
        objective_value=objective_value(pipelines, objective),
        decode_latency_s=fastest.decode_latency_s,
        prefill_s_per_1k=fastest.prefill_s_per_1k,
        throughput_tps=sum(p.throughput_tps for p in pipelines),
        constraints=cost.constraints,
    )


def _raise_insufficient(cost: CostModel) -> None:
    missing = shortfall_bytes(cost)
    unmeasured = [
        d.peer_id for d in cost.devices if d.matmul_flops <= 0 or d.memory_bandwidth_bps <= 0
    ]
    if unmeasured and len(unmeasured) == len(cost.devices):
        raise InsufficientCapacity(
            f"no device has measured FLOP/s and memory bandwidth yet "
            f"({', '.join(sorted(set(unmeasured)))}); nothing can run {cost.model.name}",
            missing_bytes=missing,
        )
    formats = sorted({cost.weights(d) for d in range(len(cost.devices))})
    raise InsufficientCapacity(
        f"{cost.model.name} ({'/'.join(formats)} weights) does not fit on these "
        f"{len(cost.devices)} device(s): "
        f"{missing / _GIB:.2f} GiB more free memory is needed "
        f"(weights + KV budget + workspace {cost.model_bytes() / _GIB:.2f} GiB, "
        f"offered {sum(cost.usable_bytes(d) for d in range(len(cost.devices))) / _GIB:.2f} GiB "
        "after reserves)",
        missing_bytes=missing,
    )


def plan(
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    objective: Objective = "latency",
    constraints: PlanConstraints | None = None,
    epoch: int = 0,
    options: SearchOptions | None = None,
) -> Plan:
    """Place ``model`` on ``devices`` for ``objective``.

    ``latency`` gives one pipeline of least per-token decode latency;
    ``throughput`` gives data-parallel replicas of greatest total tokens/s.
    """
    if objective not in ("latency", "throughput"):
        raise ValueError(f"unknown objective {objective!r}")
    cons = constraints or PlanConstraints()
    opts = options or SearchOptions()
    cost = CostModel(model, devices, links, cons)
    usable = usable_devices(cost)
    problem = Problem(cost, objective)
    solutions: list[Solution] = []
    strategy = "exact" if len(usable) <= opts.exact_device_limit else "heuristic"
    if usable and strategy == "exact":
        if objective == "latency":
            found = exact_latency(problem, usable)
            solutions = [found] if found is not None else []
        else:
            solutions = exact_throughput(problem, usable)
    elif usable:
        search = Heuristic(problem, usable, opts)
        if objective == "latency":
            found = search.latency()
            solutions = [found] if found is not None else []
        else:
            solutions = search.throughput()
    if not solutions:
        _raise_insufficient(cost)
    solutions = [balance(problem, refine(problem, s), opts.balance_tolerance) for s in solutions]
    return build_plan(cost, solutions, objective=objective, strategy=strategy, epoch=epoch)


def evaluate(
    stages: Sequence[Sequence[tuple[str, str, int, int]]],
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    objective: Objective = "latency",
    constraints: PlanConstraints | None = None,
    strategy: str = "given",
    epoch: int = 0,
) -> Plan | None:
    """Predictions for a given placement (``(peer_id, device, start, end)`` per stage).

    Returns ``None`` if the placement names a device not in ``devices``, does not
    cover the model, or no longer fits in memory: the replanning policy uses this
    to re-score the current plan under fresh measurements.
    """
    cons = constraints or PlanConstraints()
    cost = CostModel(model, devices, links, cons)
    index = {(d.peer_id, d.device): i for i, d in enumerate(cost.devices)}
    solutions: list[Solution] = []
    for pipeline in stages:
        assignment: list[Assignment] = []
        expected = 0
        for peer_id, device, start, end in pipeline:
            dev = index.get((peer_id, device))
            if dev is None or start != expected or end <= start or end > cost.n:
                return None
            assignment.append(Assignment(dev, start, end))
            expected = end
        if expected != cost.n or not cost.feasible(assignment):
            return None
        solutions.append(Solution(0.0, tuple(assignment)))
    if not solutions:
        return None
    return build_plan(cost, solutions, objective=objective, strategy=strategy, epoch=epoch)


def placement(plan_: Plan) -> list[list[tuple[str, str, int, int]]]:
    """The bare placement of a plan, the input :func:`evaluate` takes."""
    return [[(s.peer_id, s.device, s.start, s.end) for s in p.stages] for p in plan_.pipelines]


def pipeline_of(plan_: Plan, key: str) -> Pipeline | None:
    for p in plan_.pipelines:
        if p.key == key:
            return p
    return None


__all__ = [
    "build_plan",
    "evaluate",
    "pipeline_of",
    "placement",
    "plan",
    "shortfall_bytes",
    "usable_devices",
]
