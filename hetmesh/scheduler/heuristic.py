"""Planning for meshes too large for exact search: candidates, sites, local search.

1. **Rank** devices by the time one decoder layer takes on them and by how many
   layers fit in their memory; devices that hold no layer are never used.
2. **Sites**: peers joined by links faster than ``site_link_s`` per token form a
   site (union-find over the measured links; devices of one peer always share
   one). Pipelines are built inside a site first, because every boundary that
   crosses a slow link costs its RTT on every token.
3. **Candidates**: the fastest devices of a pool until their memory holds the
   model, plus a few spares, bounded; ordered along the cheapest links
   (nearest neighbour from the fastest device).
4. **Exact split, local search over orders**: each order is scored by the exact
   DP that may drop any device but the first (a weak device that slows the
   pipeline is dropped); first-improvement moves swap, relocate, replace with an
   unused device, or insert one, within an evaluation budget.
5. **Latency** keeps the best pipeline over the most promising sites and the
   whole mesh. **Throughput** fills each site with replicas (fastest devices
   first, the fewest devices that hold the model), then pools the leftovers
   across sites.

Deterministic: every choice breaks ties by the devices' canonical index.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hetmesh.scheduler.cost import INF
from hetmesh.scheduler.dp import Problem, Solution, skip_dp


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """Knobs of the search (not of the cost model); defaults fit 1,000 devices in < 1 s."""

    exact_device_limit: int = 7  # exact search up to this many usable devices
    max_candidates: int = 8
    spare_candidates: int = 2
    local_search_evaluations: int = 120
    replica_local_search_evaluations: int = 6
    absorb_pipelines: int = 4  # pipelines a leftover device may join (its site's first)
    absorb_evaluations: int = 600
    exchange_evaluations: int = 600
    exchange_any_site_below: int = 12  # with fewer replicas, exchange across sites too
    regroup_evaluations: int = 400
    site_link_s: float = 2.0e-3  # links faster than this per token join one site
    sites_to_try: int = 3
    # a latency plan's cut may cost this much more per token (relative) to make its
    # slowest stage faster (dp.balance): near-equal cuts go by speed, not by search order.
    # 10%: three equal nodes on one machine calibrated 0.98, 1.32 and 1.40 times the
    # roofline (each measured while the others started); the fewest-latency cut then
    # filled the two "fast" ones and gave the third 3 units of 32 (bottleneck 30 ms a
    # token against 24 balanced, for 4% of predicted latency that was not real)
    balance_tolerance: float = 0.10


class Heuristic:
    """Heuristic planner state for one problem and one set of usable devices."""

    def __init__(self, problem: Problem, devices: Sequence[int], options: SearchOptions) -> None:
        self.problem = problem
        self.cost = problem.cost
        self.options = options
        n = problem.n
        probe = (1, 2) if n > 2 else (0, n)
        self.layer_s: dict[int, float] = {}
        self.capacity: dict[int, int] = {}
        for dev in devices:
            matrix = problem.stage(dev)
            step = float(matrix[probe])
            # units that fit from the start of the model (the embedding included)
            fits = int(np.count_nonzero(np.isfinite(matrix[0])))
            if np.isfinite(step) and fits > 0:
                self.layer_s[dev] = step - self.cost.stage_overhead_s(*probe)
                self.capacity[dev] = fits
        self.devices = sorted(self.layer_s, key=lambda d: (self.layer_s[d], d))
        self.evaluations = 0
        self._absorb_left = options.absorb_evaluations  # shared by every absorb pass
        self._scores: dict[tuple[int, ...], Solution | None] = {}

    # ----- structure ----------------------------------------------------------------
    def sites(self) -> list[list[int]]:
        """Groups of devices joined by fast links, fastest devices first in each."""
        parent: dict[str, str] = {}

        def find(x: str) -> str:
            root = x
            while parent.get(root, root) != root:
                root = parent[root]
            while parent.get(x, x) != root:
                parent[x], x = root, parent[x]
            return root

        hidden = self.cost.hidden_bytes
        peers = {self.cost.devices[d].peer_id for d in self.devices}
        for link in self.cost.measured_links():
            src, dst = link.src, link.dst
            if src not in peers or dst not in peers or link.bandwidth_bps <= 0:
                continue
            if hidden / link.bandwidth_bps + link.rtt_s / 2 <= self.options.site_link_s:
                a, b = find(src), find(dst)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        groups: dict[str, list[int]] = {}
        for dev in self.devices:
            groups.setdefault(find(self.cost.devices[dev].peer_id), []).append(dev)
        return sorted(groups.values(), key=lambda g: (self.estimate(g), g[0]))

    def estimate(self, pool: Sequence[int]) -> float:
        """Rough latency of filling the model with ``pool``'s fastest devices (inf: no fit)."""
        left, total = self.problem.n, 0.0
        for dev in pool:
            take = min(left, self.capacity[dev])
            total += take * self.layer_s[dev] + self.cost.constraints.stage_overhead_s
            left -= take
            if left <= 0:
                return total
        return INF

    def candidates(self, pool: Sequence[int], spares: int) -> list[int]:
        """The fastest devices of ``pool`` (already sorted) that hold the model, plus spares."""
        chosen: list[int] = []
        held = 0
        for dev in pool:
            if held >= self.problem.n and (
                spares <= 0 or len(chosen) >= self.options.max_candidates
            ):
                break
            if held >= self.problem.n:
                spares -= 1
            chosen.append(dev)
            held += self.capacity[dev]
        return chosen

    def initial_order(self, chosen: Sequence[int]) -> list[int]:
        """Nearest neighbour along the links, from the fastest device."""
        if not chosen:
            return []
        order = [chosen[0]]
        left = list(chosen[1:])
        while left:
            last = order[-1]
            nxt = min(left, key=lambda d: (self.problem.edge(last, d), self.layer_s[d], d))
            order.append(nxt)
            left.remove(nxt)
        return order

    # ----- search -------------------------------------------------------------------
    def _score(self, order: Sequence[int]) -> Solution | None:
        key = tuple(order)
        if key in self._scores:
            return self._scores[key]
        self.evaluations += 1
        found = skip_dp(self.problem, order)
        self._scores[key] = found
        return found

    def _moves(self, order: list[int], outside: Sequence[int]) -> Iterator[list[int]]:
        k = len(order)
        for i in range(k):
            for j in range(i + 1, k):
                moved = order.copy()
                moved[i], moved[j] = moved[j], moved[i]
                yield moved
        for dev in outside:
            for i in range(k):
                replaced = order.copy()
                replaced[i] = dev
                yield replaced
        for i in range(k):
            for j in range(k):
                if i != j and j != i + 1:
                    moved = order.copy()
                    moved.insert(j if j < i else j - 1, moved.pop(i))
                    yield moved
        for dev in outside:
            for i in range(k + 1):
                yield [*order[:i], dev, *order[i:]]

    def improve(
        self, order: list[int], pool: Sequence[int], budget: int, *, grow: bool = True
    ) -> Solution | None:
        """First-improvement local search over orders, scored by :func:`skip_dp`."""
        best = self._score(order)
        spent = 1
        improved = True
        while improved and spent < budget:
            improved = False
            inside = set(order)
            outside = [d for d in pool if d not in inside][: self.options.spare_candidates + 1]
            if not grow:
                outside = []
            for moved in self._moves(order, outside):
                sol = self._score(moved)
                spent += 1
                if sol is not None and (best is None or sol.cost < best.cost * (1 - 1e-12)):
                    best = sol
                    used = set(sol.devices)
                    order = list(sol.devices) + [d for d in moved if d not in used]
                    improved = True
                    break
                if spent >= budget:
                    break
        return best

    def best_pipeline(
        self, pool: Sequence[int], spares: int, budget: int, *, grow: bool = True
    ) -> Solution | None:
        """The best pipeline from ``pool``'s fastest devices; more join while none fits."""
        for extra in range(spares, spares + self.options.max_candidates):
            chosen = self.candidates(pool, extra)
            if sum(self.capacity[d] for d in chosen) < self.problem.n:
                return None
            found = self.improve(self.initial_order(chosen), pool, budget, grow=grow)
            if found is not None or len(chosen) == len(pool):
                return found
        return None

    def latency(self) -> Solution | None:
        """The best single pipeline found over the most promising sites and the whole mesh."""
        opts = self.options
        pools = [s for s in self.sites() if np.isfinite(self.estimate(s))][: opts.sites_to_try]
        if self.devices not in pools:
            pools.append(self.devices)
        best: Solution | None = None
        for pool in pools:
            sol = self.best_pipeline(pool, opts.spare_candidates, opts.local_search_evaluations)
            if sol is not None and (best is None or sol.cost < best.cost):
                best = sol
        return best

    def throughput(self) -> list[Solution]:
        """Replicas: fill each site with pipelines, pool the leftovers across sites, then
        let each still unused device join the pipeline it speeds up most."""
        opts = self.options
        taken: set[int] = set()
        out: list[Solution] = []
        sites = self.sites()
        site_of = {dev: i for i, site in enumerate(sites) for dev in site}

        def fill(pool_all: Sequence[int]) -> None:
            pool = [d for d in pool_all if d not in taken]
            while sum(self.capacity[d] for d in pool) >= self.problem.n:
                sol = self.best_pipeline(pool, 0, opts.replica_local_search_evaluations, grow=False)
                if sol is None:
                    return
                out.append(sol)
                taken.update(sol.devices)
                pool = [d for d in pool if d not in taken]

        for site in sites:
            fill(site)
        fill(self.devices)

        def unused() -> list[int]:
            used = {d for sol in out for d in sol.devices}
            return [d for d in self.devices if d not in used]

        self._absorb(unused(), out, site_of)
        self._exchange(out, site_of)
        self._absorb(unused(), out, site_of)
        if self._regroup(out):
            self._absorb(unused(), out, site_of)
        return out

    def _regroup(self, out: list[Solution]) -> bool:
        """Take one device out of a pipeline (or trade it for an unused one) when the
        devices left over can then form a new replica worth more than the loss.

        Returns whether anything changed (within ``regroup_evaluations``).
        """
        tokens = float(self.problem.tokens)
        budget = self.options.regroup_evaluations
        changed = False

        def rate(sol: Solution | None) -> float:
            return tokens / sol.cost if sol is not None and sol.cost > 0 else 0.0

        improved = True
        while improved and budget > 0:
            improved = False
            used = {d for sol in out for d in sol.devices}
            unused = [d for d in self.devices if d not in used]
            for i in range(len(out)):
                order = list(out[i].devices)
                for x in range(len(order)):
                    for swap in [None, *unused[: self.options.spare_candidates + 2]]:
                        if budget <= 0 or improved:
                            break
                        kept = order[:x] + ([swap] if swap is not None else []) + order[x + 1 :]
                        if not kept:
                            continue
                        sol = self._score(kept)
                        freed = sorted(
                            [d for d in unused if d != swap] + [order[x]],
                            key=lambda d: (self.layer_s[d], d),
                        )
                        budget -= 1
                        if sol is None or sum(self.capacity[d] for d in freed) < self.problem.n:
                            continue
                        extra = self.best_pipeline(
                            freed, 0, self.options.replica_local_search_evaluations, grow=False
                        )
                        budget -= 1 + self.options.replica_local_search_evaluations
                        if extra is None:
                            continue
                        if rate(sol) + rate(extra) > rate(out[i]) * (1 + 1e-9):
                            out[i] = sol
                            out.append(extra)
                            improved = changed = True
                    if improved or budget <= 0:
                        break
                if improved or budget <= 0:
                    break
        return changed

    def _exchange(self, out: list[Solution], site_of: dict[int, int]) -> None:
        """Move or swap devices between two pipelines of one site while the sum of their
        throughputs grows (first improvement, within ``exchange_evaluations``)."""
        tokens = float(self.problem.tokens)
        budget = self.options.exchange_evaluations

        def rate(sol: Solution | None) -> float:
            return tokens / sol.cost if sol is not None and sol.cost > 0 else 0.0

        improved = True
        while improved and budget > 0:
            improved = False
            for i, j in itertools.permutations(range(len(out)), 2):
                if budget <= 0 or improved:
                    break
                a, b = list(out[i].devices), list(out[j].devices)
                few = len(out) <= self.options.exchange_any_site_below
                if not few and site_of.get(a[0]) != site_of.get(b[0]):
                    continue
                before = rate(out[i]) + rate(out[j])
                trials: list[tuple[list[int], list[int]]] = []
                for x in range(len(a)):
                    rest = a[:x] + a[x + 1 :]
                    trials += [(rest, [*b[:y], a[x], *b[y:]]) for y in range(len(b) + 1)]
                    trials += [
                        ([*a[:x], b[y], *a[x + 1 :]], [*b[:y], a[x], *b[y + 1 :]])
                        for y in range(len(b))
                    ]
                for new_a, new_b in trials:
                    # a move may leave ``a`` unable to hold the model: it dissolves and
                    # its devices go back to the pool (absorbed afterwards)
                    sol_a = self._score(new_a) if new_a else None
                    sol_b = self._score(new_b)
                    budget -= 2
                    is_move = len(new_a) < len(a)
                    if sol_b is None or (sol_a is None and not is_move):
                        continue
                    if sol_a is None:  # a dissolves: its other devices may join b too
                        for dev in new_a:
                            sol_b, spent = self._best_insertion(sol_b, dev)
                            budget -= spent
                    if rate(sol_a) + rate(sol_b) > before * (1 + 1e-9):
                        out[j] = sol_b
                        if sol_a is None:
                            out.pop(i)
                        else:
                            out[i] = sol_a
                        improved = True
                        break
                    if budget <= 0:
                        break

    def _best_insertion(self, sol: Solution, dev: int) -> tuple[Solution, int]:
        """``sol`` with ``dev`` inserted where it helps most (or unchanged), and the cost."""
        order = list(sol.devices)
        best = sol
        for pos in range(len(order) + 1):
            found = self._score([*order[:pos], dev, *order[pos:]])
            if found is not None and found.cost < best.cost * (1 - 1e-12):
                best = found
        return best, len(order) + 1

    def _absorb(
        self, leftover: Sequence[int], out: list[Solution], site_of: dict[int, int]
    ) -> None:
        """Insert each leftover device where it raises total throughput most, if anywhere.

        Pipelines of the device's own site are tried first; at most
        ``absorb_pipelines`` pipelines per device, every insertion position.
        """
        if not out:
            return
        tokens = float(self.problem.tokens)
        for dev in leftover:
            if self._absorb_left <= 0:
                return
            ranked = sorted(
                range(len(out)),
                key=lambda i: (site_of.get(out[i].devices[0]) != site_of.get(dev), -out[i].cost, i),
            )[: self.options.absorb_pipelines]
            best_gain, best_at, best_sol = 0.0, -1, None
            for i in ranked:
                order = list(out[i].devices)
                for pos in range(len(order) + 1):
                    sol = self._score([*order[:pos], dev, *order[pos:]])
                    self._absorb_left -= 1
                    if sol is None:
                        continue
                    gain = tokens / sol.cost - tokens / out[i].cost
                    if gain > best_gain * (1 + 1e-12) + 1e-12:
                        best_gain, best_at, best_sol = gain, i, sol
            if best_sol is not None:
                out[best_at] = best_sol


__all__ = ["Heuristic", "SearchOptions"]
