"""A brute-force reference optimum, for tests and benchmarks only (small meshes).

Written independently of :mod:`hetmesh.scheduler.exact`: every ordered subset of
the devices from ``itertools.permutations``, each scored by the fixed-order DP
(itself checked against a literal enumeration of every contiguous split,
:func:`all_splits`), and, for throughput, every set partition of the devices
into replicas. DP results of a prefix are memoised so that 7 devices stay fast.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from hetmesh.scheduler.cost import Assignment, FloatArray
from hetmesh.scheduler.dp import Problem


def all_splits(problem: Problem, order: Sequence[int]) -> float:
    """Literally every contiguous split of the units over ``order`` (≥ 1 unit each)."""
    n, k = problem.n, len(order)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        stages = [Assignment(order[i], bounds[i], bounds[i + 1]) for i in range(k)]
        best = min(best, score(problem, stages))
    return best


def score(problem: Problem, stages: Sequence[Assignment]) -> float:
    """The objective cost of one explicit pipeline under ``problem``."""
    value = 0.0
    for i, st in enumerate(stages):
        value = problem.join(value, float(problem.stage(st.device)[st.start, st.end]))
        if i + 1 < len(stages):
            value = problem.join(value, problem.edge(st.device, stages[i + 1].device))
    return problem.join(value, problem.ret(stages[-1].device, stages[0].device))


class _Prefixes:
    """Fixed-order DP vectors of every device prefix seen, memoised."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.cache: dict[tuple[int, ...], FloatArray] = {}

    def dp(self, order: tuple[int, ...]) -> FloatArray:
        got = self.cache.get(order)
        if got is None:
            p = self.problem
            if len(order) == 1:
                got = p.stage(order[0])[0].copy()
            else:
                before = p.shift(self.dp(order[:-1]), p.edge(order[-2], order[-1]))
                got = p.extend(before, p.stage(order[-1]))[0]
            self.cache[order] = got
        return got

    def cost(self, order: tuple[int, ...]) -> float:
        value = float(self.dp(order)[self.problem.n])
        return self.problem.join(value, self.problem.ret(order[-1], order[0]))


def best_pipeline(
    problem: Problem, devices: Sequence[int], prefixes: _Prefixes | None = None
) -> float:
    """Least cost of one pipeline over every ordered subset of ``devices``."""
    memo = prefixes or _Prefixes(problem)
    best = float("inf")
    for r in range(1, len(devices) + 1):
        for order in itertools.permutations(devices, r):
            best = min(best, memo.cost(order))
    return best


def _partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def optimum(problem: Problem, devices: Sequence[int]) -> float:
    """The optimal objective value: seconds per token (latency) or total tokens/s."""
    if problem.additive:
        return best_pipeline(problem, devices)
    memo = _Prefixes(problem)
    rate: dict[tuple[int, ...], float] = {}
    best = 0.0
    for part in _partitions(list(devices)):
        total = 0.0
        for block in part:
            key = tuple(sorted(block))
            if key not in rate:
                cost = best_pipeline(problem, key, memo)
                rate[key] = problem.tokens / cost if cost < float("inf") else 0.0
            total += rate[key]
        best = max(best, total)
    return best


__all__ = ["all_splits", "best_pipeline", "optimum", "score"]
