"""Exact search for small meshes: every ordered subset of devices × every contiguous split.

Ordered subsets are enumerated depth-first so that those sharing a prefix share its
DP (one vectorised step per tree node instead of one DP per ordered subset); the
split over each ordered subset is the exact DP of :mod:`hetmesh.scheduler.dp`.

- latency: the single pipeline of least per-token latency (branch and bound: a
  prefix whose every partial cost already exceeds the best is cut, costs being
  non-negative);
- throughput: the best pipeline for every set of devices, then the best way to
  split the mesh into data-parallel replicas (a DP over set partitions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetmesh.scheduler.cost import INF, FloatArray
from hetmesh.scheduler.dp import Problem, Solution, unwind


def _enumerate(
    problem: Problem,
    devices: Sequence[int],
    record: dict[int, Solution],
    *,
    prune: bool,
) -> None:
    """Fill ``record[mask]`` with the best pipeline using exactly the devices in ``mask``."""
    n = problem.n
    k = len(devices)
    best_any = [INF]

    def visit(path: list[int], mask: int, dp: FloatArray, back: list[np.ndarray]) -> None:
        order = [devices[p] for p in path]
        if np.isfinite(dp[n]):
            value = problem.join(float(dp[n]), problem.ret(order[-1], order[0]))
            held = record.get(mask)
            if held is None or value < held.cost:
                record[mask] = Solution(value, unwind(order, back, n))
            best_any[0] = min(best_any[0], value)
        if len(path) == k:
            return
        lowest = float(np.min(dp[:n]))
        if not np.isfinite(lowest) or (prune and lowest >= best_any[0]):
            return
        last = order[-1]
        for p in range(k):
            if mask >> p & 1:
                continue
            dev = devices[p]
            new, arg = problem.extend(
                problem.shift(dp, problem.edge(last, dev)), problem.stage(dev)
            )
            if not np.isfinite(new[1:]).any():
                continue
            back.append(arg)
            path.append(p)
            visit(path, mask | (1 << p), new, back)
            path.pop()
            back.pop()

    for p, dev in enumerate(devices):
        first = problem.stage(dev)[0].copy()
        if np.isfinite(first[1:]).any():
            visit([p], 1 << p, first, [])


def exact_latency(problem: Problem, devices: Sequence[int]) -> Solution | None:
    """The least-latency single pipeline over any ordered subset of ``devices``."""
    record: dict[int, Solution] = {}
    _enumerate(problem, devices, record, prune=True)
    best: Solution | None = None
    for mask in sorted(record):
        if best is None or record[mask].cost < best.cost:
            best = record[mask]
    return best


def exact_throughput(problem: Problem, devices: Sequence[int]) -> list[Solution]:
    """Replicas of greatest total throughput: a partition of ``devices`` into pipelines."""
    record: dict[int, Solution] = {}
    _enumerate(problem, devices, record, prune=False)
    k = len(devices)
    full = (1 << k) - 1
    tokens = float(problem.tokens)
    # best[m]: the best single pipeline using any subset of m (devices may be dropped)
    best_rate = [0.0] * (full + 1)
    best_mask = [0] * (full + 1)
    for m in range(1, full + 1):
        sol = record.get(m)
        if sol is not None and sol.cost > 0:
            best_rate[m], best_mask[m] = tokens / sol.cost, m
        for p in range(k):
            if m >> p & 1:
                sub = m & ~(1 << p)
                if best_rate[sub] > best_rate[m]:
                    best_rate[m], best_mask[m] = best_rate[sub], best_mask[sub]
    total = [0.0] * (full + 1)
    choice = [0] * (full + 1)
    for m in range(1, full + 1):
        low = m & -m
        rest = m & ~low
        sub = rest
        while True:
            block = sub | low
            value = best_rate[block] + total[m & ~block]
            if value > total[m]:
                total[m], choice[m] = value, block
            if sub == 0:
                break
            sub = (sub - 1) & rest
    out: list[Solution] = []
    m = full
    while m:
        block = choice[m]
        if block == 0:
            break
        if best_mask[block]:
            out.append(record[best_mask[block]])
        m &= ~block
    return out


__all__ = ["exact_latency", "exact_throughput"]
