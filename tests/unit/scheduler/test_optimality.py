"""The planner against a brute-force optimum on 200 random small meshes (fixed seed).

The reference (:mod:`hetmesh.scheduler.bruteforce`) enumerates every ordered subset
of devices with ``itertools.permutations`` and every set partition into replicas;
its fixed-order DP is itself checked here against a literal enumeration of every
contiguous split.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler import PlanConstraints, SearchOptions, plan
from hetmesh.scheduler.bruteforce import all_splits, optimum
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.dp import Problem, order_dp
from hetmesh.scheduler.planner import usable_devices
from hetmesh.scheduler.records import Objective
from tests.unit.scheduler.sched_helpers import device, toy_model

INSTANCES = 200
SEED = 20261129


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def random_instance(
    rng: random.Random,
) -> tuple[list[DeviceProfile], list[LinkProfile], ModelProfile, PlanConstraints, Objective]:
    model = toy_model(rng.randint(2, 10), vocab=rng.choice((4096, 32000)))
    constraints = PlanConstraints(
        max_context_tokens=rng.choice((256, 1024)),
        micro_batch_tokens=rng.choice((1, 4, 16)),
        reserve_bytes=rng.choice((0, 16 * 1024 * 1024)),
    )
    need = CostModel(model, [device("x")], [], constraints).model_bytes()
    devices: list[DeviceProfile] = []
    for i in range(rng.randint(1, 7)):
        same_peer = devices and rng.random() < 0.2
        peer = devices[-1].peer_id if same_peer else f"p{i}"
        d = device(
            peer,
            memory=int(need * rng.uniform(0.15, 1.3)) + 16 * 1024 * 1024,
            flops=log_uniform(rng, 1e11, 1e14),
            bandwidth=log_uniform(rng, 1e10, 2e12),
            backend=rng.choice(("cpu", "cuda")),
        )
        if same_peer:
            d = DeviceProfile.from_wire({**d.to_wire(), "device": f"cuda:{i}", "backend": "cuda"})
        devices.append(d)
    peers = sorted({d.peer_id for d in devices})
    links = []
    for a, b in itertools.permutations(peers, 2):
        if rng.random() < 0.85:  # the rest are unmeasured: the default link applies
            links.append(
                LinkProfile(
                    src=a,
                    dst=b,
                    rtt_s=log_uniform(rng, 1e-5, 3e-2),
                    bandwidth_bps=log_uniform(rng, 1e6, 1e10),
                )
            )
    objective: Objective = "latency" if rng.random() < 0.5 else "throughput"
    return devices, links, model, constraints, objective


def quality(objective: Objective, found: float, best: float) -> float:
    """1.0 = optimal; below 1 = worse (latency: seconds, throughput: tokens/s)."""
    return best / found if objective == "latency" else found / best


def test_order_dp_equals_every_contiguous_split() -> None:
    rng = random.Random(SEED + 1)
    checked = 0
    while checked < 30:
        devices, links, model, constraints, objective = random_instance(rng)
        cost = CostModel(model, devices, links, constraints)
        problem = Problem(cost, objective)
        order = list(range(len(cost.devices)))
        rng.shuffle(order)
        order = order[: min(len(order), model.num_units, 4)]
        literal = all_splits(problem, order)
        sol = order_dp(problem, order)
        if sol is None:
            assert literal == math.inf
        else:
            assert sol.cost == pytest.approx(literal, rel=1e-12)
            checked += 1


# the least-latency search itself: a latency plan's cut is then balanced within
# SearchOptions.balance_tolerance of it (tests/unit/scheduler/test_balance.py)
FASTEST = SearchOptions(balance_tolerance=0.0)


@pytest.mark.slow  # 200 brute-force searches: ~10 s, over 30 s on a loaded machine
def test_plan_within_one_percent_of_brute_force_on_200_instances() -> None:
    rng = random.Random(SEED)
    exact_q: list[float] = []
    heuristic_q: list[float] = []
    attempts = 0
    while len(exact_q) < INSTANCES:
        attempts += 1
        assert attempts < 4 * INSTANCES, "too many infeasible draws"
        devices, links, model, constraints, objective = random_instance(rng)
        cost = CostModel(model, devices, links, constraints)
        best = optimum(Problem(cost, objective), usable_devices(cost))
        feasible = best != math.inf and best > 0
        try:
            got = plan(
                devices, links, model, objective=objective, constraints=constraints, options=FASTEST
            )
        except InsufficientCapacity:
            assert not feasible  # the planner never misses a feasible placement
            continue
        assert feasible
        exact_q.append(quality(objective, got.objective_value, best))
        for pipe in got.pipelines:
            for st in pipe.stages:
                free = next(
                    d.memory_free_bytes
                    for d in devices
                    if (d.peer_id, d.device) == (st.peer_id, st.device)
                )
                assert st.memory_bytes <= free
        heur = plan(
            devices,
            links,
            model,
            objective=objective,
            constraints=constraints,
            options=SearchOptions(exact_device_limit=0, balance_tolerance=0.0),
        )
        heuristic_q.append(quality(objective, heur.objective_value, best))
    within = sum(q >= 0.99 for q in exact_q)
    assert within >= 0.99 * INSTANCES, sorted(exact_q)[:5]
    assert max(exact_q) <= 1 + 1e-9  # nothing beats the optimum: the reference is sound
    # The heuristic (used beyond 7 devices) on the same instances:
    assert statistics.median(heuristic_q) >= 0.99
    assert sum(q >= 0.99 for q in heuristic_q) >= 0.8 * INSTANCES, sorted(heuristic_q)[:10]
    assert max(heuristic_q) <= 1 + 1e-9
