"""Baseline placements with the planner's interface, scored by the same cost model.

- ``even``: every usable device in canonical order, the units split evenly;
- ``memory-proportional``: exo's approach — devices by free memory (largest
  first), units in proportion to the memory each offers; compute and links
  ignored;
- ``greedy``: Petals-style bottleneck filling for one chain — the fastest device
  (by per-layer time) takes as many of the still-uncovered units as its memory
  holds, then the next fastest, until the model is covered.

Each gives a single pipeline and raises
:class:`~hetmesh.errors.InsufficientCapacity` if its placement does not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler.cost import Assignment, CostModel
from hetmesh.scheduler.dp import Solution
from hetmesh.scheduler.planner import build_plan, shortfall_bytes, usable_devices
from hetmesh.scheduler.records import Objective, Plan, PlanConstraints


def _split(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` units in proportion to ``weights`` (largest remainder; ties to the earlier)."""
    total = sum(weights)
    if total <= 0:
        return [0] * len(weights)
    raw = [n * w / total for w in weights]
    sizes = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - sizes[i]), i))
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _chain(order: Sequence[int], sizes: Sequence[int]) -> list[Assignment]:
    out: list[Assignment] = []
    start = 0
    for dev, size in zip(order, sizes, strict=True):
        if size > 0:
            out.append(Assignment(dev, start, start + size))
            start += size
    return out


def _finish(
    cost: CostModel, stages: list[Assignment], objective: Objective, strategy: str, epoch: int
) -> Plan:
    if not stages or stages[-1].end != cost.n or not cost.feasible(stages):
        missing = (
            shortfall_bytes(cost)
            if not stages
            else max(
                1,
                max(
                    cost.stage_memory_bytes(s.device, s.start, s.end)
                    - cost.devices[s.device].memory_free_bytes
                    for s in stages
                ),
            )
        )
        raise InsufficientCapacity(
            f"the {strategy} placement does not fit these devices", missing_bytes=missing
        )
    return build_plan(
        cost, [Solution(0.0, tuple(stages))], objective=objective, strategy=strategy, epoch=epoch
    )


def even_split(
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    objective: Objective = "latency",
    constraints: PlanConstraints | None = None,
    epoch: int = 0,
) -> Plan:
    cost = CostModel(model, devices, links, constraints or PlanConstraints())
    order = usable_devices(cost)[: cost.n]
    return _finish(
        cost, _chain(order, _split(cost.n, [1.0] * len(order))), objective, "even", epoch
    )


def memory_proportional(
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    objective: Objective = "latency",
    constraints: PlanConstraints | None = None,
    epoch: int = 0,
) -> Plan:
    cost = CostModel(model, devices, links, constraints or PlanConstraints())
    order = sorted(usable_devices(cost), key=lambda d: (-cost.usable_bytes(d), d))
    sizes = _split(cost.n, [float(cost.usable_bytes(d)) for d in order])
    return _finish(cost, _chain(order, sizes), objective, "memory-proportional", epoch)


def greedy_fill(
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    *,
    objective: Objective = "latency",
    constraints: PlanConstraints | None = None,
    epoch: int = 0,
) -> Plan:
    cost = CostModel(model, devices, links, constraints or PlanConstraints())
    probe = (1, 2) if cost.n > 2 else (0, cost.n)
    order = sorted(usable_devices(cost), key=lambda d: (cost.step_s(d, *probe), d))
    stages: list[Assignment] = []
    start = 0
    for dev in order:
        if start >= cost.n:
            break
        end = start
        while end < cost.n and cost.fits(dev, start, end + 1):
            end += 1
        if end > start:
            stages.append(Assignment(dev, start, end))
            start = end
    return _finish(cost, stages, objective, "greedy", epoch)


Baseline = Callable[..., Plan]
BASELINES: dict[str, Baseline] = {
    "even": even_split,
    "memory-proportional": memory_proportional,
    "greedy": greedy_fill,
}

__all__ = ["BASELINES", "Baseline", "even_split", "greedy_fill", "memory_proportional"]
