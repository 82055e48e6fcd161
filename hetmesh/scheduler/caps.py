"""Memory caps that make a model need exactly ``K`` stages: what the benchmarks and
``hetmesh demo`` give each node so the planner has to cut the model.

A mesh exists to serve a model that no single member can hold. On one machine
every node could hold a small model whole, and the planner (rightly) places
whole-model replicas; a cut is only measured if each node is offered less
memory than the model needs. :func:`stage_cap_bytes` computes that offer from
the model's bytes in the format the nodes serve in, the same way the planner
charges them (:class:`~hetmesh.scheduler.cost.CostModel`: weights, KV budget,
workspace, reserve):

- ``K`` nodes of that size hold the model (some ``K``-way cut fits, with a
  margin), and
- ``K - 1`` do not (no ``(K - 1)``-way cut fits), so every plan has at least
  ``K`` stages.

Between the two, the cap is set as high as the second allows: the planner keeps
the most room to balance the cut by speed (a stage holding the embedding or the
head weighs more in memory than in time).

Memory caps rather than a planner constraint on the stage count: a cap is what a
real member of a mesh has, every node already takes one (``--max-memory``), and
the plans, their checks by the other nodes and the loaders run exactly as they
do for a model too large for one machine; a minimum-stage constraint would be a
planner rule that no real mesh needs.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import dataclasses
import math

from hetmesh.resources import DeviceProfile, ModelProfile
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.records import PlanConstraints, WeightBytes, device_key

CAP_MARGIN = 0.05  # the cap sits this far below what K - 1 stages would need
_PROBE_BYTES = 1 << 50  # a device large enough to price any stage


def _resident(
    model: ModelProfile, weights: WeightBytes, constraints: PlanConstraints
) -> list[list[int]]:
    """``R[a][b]``: bytes a stage holding units ``[a, b)`` needs, without the reserve."""
    probe = DeviceProfile(
        peer_id="probe",
        device="cpu",
        backend="cpu",
        name="probe",
        memory_total_bytes=_PROBE_BYTES,
        memory_free_bytes=_PROBE_BYTES,
        matmul_flops=1.0,
        memory_bandwidth_bps=1.0,
    )
    cons = dataclasses.replace(
        constraints,
        weights_by_device={device_key("probe", "cpu"): weights},
        reserve_bytes=0,
        reserve_fraction=0.0,
    )
    cost = CostModel(model, [probe], [], cons)
    n = cost.n
    return [
        [cost.stage_memory_bytes(0, a, b) if b > a else 0 for b in range(n + 1)]
        for a in range(n + 1)
    ]


def min_max_stage_bytes(resident: list[list[int]], stages: int) -> int:
    """The least, over every cut of the model into ``stages`` contiguous stages, of the
    largest stage's bytes (``resident`` from the cost model; ``stages`` between 1 and
    the number of units)."""
    n = len(resident) - 1
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} stages of a model of {n} units")
    # best[k][b]: the least largest stage of units [0, b) cut into k stages
    worst = 1 << 62
    best = [[worst] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for b in range(k, n + 1):
            best[k][b] = min(
                (max(best[k - 1][a], resident[a][b]) for a in range(k - 1, b)), default=worst
            )
    return best[stages][n]


def stage_cap_bytes(
    model: ModelProfile,
    weights: WeightBytes,
    constraints: PlanConstraints,
    stages: int,
    *,
    margin: float = CAP_MARGIN,
) -> int:
    """The memory (total and free) to give each node so ``model`` in ``weights`` needs
    exactly ``stages`` of them; reserve included, as the planner charges it.

    With ``stages == 1`` the cap holds the whole model with ``margin`` to spare (a
    mesh of replicas). Raises ``ValueError`` where no cap separates ``stages`` from
    ``stages - 1`` (a model of too few units, or a stage that must hold a unit as
    large as the rest of the model).
    """
    if not 0.0 <= margin < 0.5:
        raise ValueError("margin must be in [0, 0.5)")
    resident = _resident(model, weights, constraints)
    need = min_max_stage_bytes(resident, stages)
    if stages == 1:
        usable = math.ceil(need * (1.0 + margin))
    else:
        fewer = min_max_stage_bytes(resident, stages - 1)
        usable = math.floor(fewer * (1.0 - margin))
        if usable < need * (1.0 + margin):
            raise ValueError(
                f"{model.name} ({weights.weights}) cannot be forced into {stages} stages by "
                f"memory: {stages} stages need {need} bytes each, {stages - 1} need {fewer}"
            )
    # the planner keeps max(reserve_bytes, reserve_fraction x total) of each device free
    fraction = constraints.reserve_fraction
    return max(usable + constraints.reserve_bytes, math.ceil(usable / (1.0 - fraction)) + 1)


def node_memory_cap(
    profile: ModelProfile,
    weights: WeightBytes,
    stages: int,
    *,
    max_context_tokens: int,
    max_sessions: int,
    reserve_bytes: int,
    margin: float = CAP_MARGIN,
) -> int:
    """:func:`stage_cap_bytes` for nodes started with these settings (``--max-context``,
    ``--max-sessions`` and the reserve they plan with), serving ``profile`` in a format
    of ``weights`` bytes: the value to pass each node as ``--max-memory``. The
    constraints are those a node plans with (:class:`~hetmesh.node.serving.Serving`)."""
    constraints = PlanConstraints(
        max_context_tokens=min(max_context_tokens, profile.max_context),
        max_sessions=max_sessions,
        reserve_bytes=reserve_bytes,
    )
    return stage_cap_bytes(profile, weights, constraints, stages, margin=margin)


__all__ = ["CAP_MARGIN", "min_max_stage_bytes", "node_memory_cap", "stage_cap_bytes"]
