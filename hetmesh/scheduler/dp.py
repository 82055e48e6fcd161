"""Dynamic programs over contiguous unit ranges.

A :class:`Problem` fixes what "cost" means for one objective:

- ``latency``: stage cost = one-token decode step, edge = activation latency,
  costs add up (min-sum);
- ``throughput``: stage cost = micro-batch step, edge = link occupancy, the
  pipeline is as slow as its slowest part (min-max).

:func:`order_dp` is exact for a fixed device order in which every device gets at
least one unit. :func:`skip_dp` is exact for a fixed order whose first device is
mandatory and whose other devices may be dropped (given no units).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetmesh.scheduler.cost import INF, Assignment, CostModel, FloatArray
from hetmesh.scheduler.records import Objective


@dataclass(frozen=True, slots=True)
class Solution:
    """A single pipeline found by a search: its objective cost and its stages."""

    cost: float  # latency: seconds per token; throughput: bottleneck seconds per micro-batch
    stages: tuple[Assignment, ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(s.device for s in self.stages)


class Problem:
    """Cost terms of one objective over one :class:`CostModel`."""

    def __init__(self, cost: CostModel, objective: Objective) -> None:
        self.cost = cost
        self.objective: Objective = objective
        self.additive = objective == "latency"
        self.tokens = 1 if self.additive else cost.constraints.micro_batch_tokens
        self.n = cost.n
        self._cols = np.arange(self.n + 1)
        self._edges: dict[tuple[int, int], float] = {}

    def stage(self, dev: int) -> FloatArray:
        return self.cost.step_matrix(dev, self.tokens)

    def edge(self, src: int, dst: int) -> float:
        key = (src, dst)
        got = self._edges.get(key)
        if got is None:
            if self.additive:
                got = self.cost.link_latency_s(src, dst)
            else:
                got = self.cost.link_occupancy_s(src, dst, self.tokens * self.cost.hidden_bytes)
            self._edges[key] = got
        return got

    def ret(self, last: int, first: int) -> float:
        if self.additive:
            return self.cost.return_latency_s(last, first)
        return self.cost.link_occupancy_s(last, first, self.tokens * self.cost.token_bytes)

    def join(self, a: float, b: float) -> float:
        return a + b if self.additive else max(a, b)

    def extend(self, dp: FloatArray, matrix: FloatArray) -> tuple[FloatArray, np.ndarray]:
        """``new[b] = min_a dp[a] ⊕ matrix[a, b]`` and the minimising ``a`` per ``b``."""
        # every row at once: an unreachable ``a`` (inf) only adds inf, and selecting the
        # finite rows first cost more than it saved (the planner's hot spot, ~2x)
        before, sub = dp[: self.n, None], matrix[: self.n]
        total = before + sub if self.additive else np.maximum(before, sub)
        best = total.argmin(axis=0)
        return total[best, self._cols], best

    def shift(self, dp: FloatArray, value: float) -> FloatArray:
        return dp + value if self.additive else np.maximum(dp, value)


def order_dp(problem: Problem, order: Sequence[int]) -> Solution | None:
    """The best split of all units over ``order``, every device getting ≥ 1 unit."""
    n = problem.n
    dp = problem.stage(order[0])[0].copy()
    back: list[np.ndarray] = []
    for prev, dev in itertools.pairwise(order):
        dp, arg = problem.extend(problem.shift(dp, problem.edge(prev, dev)), problem.stage(dev))
        back.append(arg)
    if not np.isfinite(dp[n]):
        return None
    cost = problem.join(float(dp[n]), problem.ret(order[-1], order[0]))
    return Solution(cost, unwind(order, back, n))


def unwind(order: Sequence[int], back: Sequence[np.ndarray], n: int) -> tuple[Assignment, ...]:
    """Stages from the argmin arrays of a fixed-order DP (``back[j-1]`` for device ``j``)."""
    stages: list[Assignment] = []
    end = n
    for j in range(len(order) - 1, 0, -1):
        start = int(back[j - 1][end])
        stages.append(Assignment(order[j], start, end))
        end = start
    stages.append(Assignment(order[0], 0, end))
    return tuple(reversed(stages))


def skip_dp(problem: Problem, order: Sequence[int]) -> Solution | None:
    """The best pipeline along ``order``: ``order[0]`` first, any others dropped or kept."""
    n, k = problem.n, len(order)
    dps = np.full((k, n + 1), INF)
    dps[0] = problem.stage(order[0])[0]
    from_a = np.zeros((k, n + 1), dtype=np.int64)
    from_i = np.zeros((k, n + 1), dtype=np.int64)
    cols = np.arange(n + 1)
    for j in range(1, k):
        edges = np.array([problem.edge(order[i], order[j]) for i in range(j)])
        cand = dps[:j] + edges[:, None] if problem.additive else np.maximum(dps[:j], edges[:, None])
        source = np.argmin(cand, axis=0)
        incoming = cand[source, cols]
        dps[j], arg = problem.extend(incoming, problem.stage(order[j]))
        from_a[j] = arg
        from_i[j] = source[arg]
    finals = dps[:, n]
    best_j, best = -1, INF
    for j in range(k):
        if np.isfinite(finals[j]):
            value = problem.join(float(finals[j]), problem.ret(order[j], order[0]))
            if value < best:
                best_j, best = j, value
    if best_j < 0:
        return None
    stages: list[Assignment] = []
    j, end = best_j, n
    while j != 0:
        start = int(from_a[j][end])
        stages.append(Assignment(order[j], start, end))
        j, end = int(from_i[j][end]), start
    stages.append(Assignment(order[0], 0, end))
    return Solution(best, tuple(reversed(stages)))


def refine(problem: Problem, solution: Solution) -> Solution:
    """Among the splits of ``solution``'s devices with the same bottleneck, the lowest latency.

    Only meaningful for the throughput objective (min-max has many optima); returns
    ``solution`` unchanged for the latency objective.
    """
    if problem.additive:
        return solution
    cost = problem.cost
    limit = solution.cost * (1 + 1e-9) + 1e-15
    latency = Problem(cost, "latency")
    order = solution.devices
    for prev, dev in itertools.pairwise(order):
        if problem.edge(prev, dev) > limit:
            return solution
    n = problem.n
    masked = [np.where(problem.stage(d) <= limit, latency.stage(d), INF) for d in order]
    dp = masked[0][0].copy()
    back: list[np.ndarray] = []
    for j in range(1, len(order)):
        dp, arg = latency.extend(dp + latency.edge(order[j - 1], order[j]), masked[j])
        back.append(arg)
    if not np.isfinite(dp[n]):
        return solution
    return Solution(solution.cost, unwind(order, back, n))


def balance(problem: Problem, solution: Solution, tolerance: float) -> Solution:
    """``solution``'s devices, in its order, with the cut whose slowest stage is fastest
    among those at most ``tolerance`` slower per token than ``solution``.

    For the latency objective only (the throughput objective's min-max already
    balances; ``solution`` is returned unchanged for it). A single stream's latency
    is the sum of the stages' steps, so on devices of equal speed every cut costs
    about the same and the search keeps whichever it met first (a 7/16/9 cut on three
    equal nodes): the slowest stage then bounds what concurrent streams and a
    pipelined prefill gain. This picks, among the near-equal cuts, the one whose
    units go in proportion to each device's measured speed, as far as their memory
    allows (a masked stage is one that does not fit).
    """
    if not problem.additive or len(solution.stages) < 2 or tolerance < 0:
        return solution
    cost = problem.cost
    order = solution.devices
    limit = solution.cost * (1.0 + tolerance)
    steps = Problem(cost, "throughput")  # a micro-batch step per stage: what bounds throughput
    bounds = [steps.stage(d) for d in order]
    lat = [problem.stage(d) for d in order]
    now = max(steps.stage(s.device)[s.start, s.end] for s in solution.stages)
    values = np.unique(np.concatenate([m[np.isfinite(m)] for m in bounds]))
    values = values[values < now]
    best = solution

    def within(bound: float) -> Solution | None:
        masked = [np.where(b <= bound, m, INF) for b, m in zip(bounds, lat, strict=True)]
        dp = masked[0][0].copy()
        back: list[np.ndarray] = []
        for j in range(1, len(order)):
            dp, arg = problem.extend(dp + problem.edge(order[j - 1], order[j]), masked[j])
            back.append(arg)
        if not np.isfinite(dp[problem.n]):
            return None
        total = float(dp[problem.n]) + problem.ret(order[-1], order[0])
        return None if total > limit else Solution(total, unwind(order, back, problem.n))

    lo, hi = 0, len(values) - 1  # the least bound in values that still meets the limit
    while lo <= hi:
        mid = (lo + hi) // 2
        found = within(float(values[mid]))
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid - 1
    return best


__all__ = ["Problem", "Solution", "balance", "order_dp", "refine", "skip_dp", "unwind"]
