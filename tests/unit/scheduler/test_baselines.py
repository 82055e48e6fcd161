"""Baselines: even split, memory-proportional (exo), greedy fill (Petals-style)."""

from __future__ import annotations

import random

import pytest

from hetmesh.errors import InsufficientCapacity
from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.scheduler import (
    BASELINES,
    SearchOptions,
    even_split,
    greedy_fill,
    memory_proportional,
    plan,
)
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.records import Objective
from hetmesh.scheduler.synthetic import random_mesh
from tests.unit.scheduler.sched_helpers import BARE, GIB, device, full_links, toy_model


def sizes(p) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {s.peer_id: s.end - s.start for s in p.pipelines[0].stages}


def test_even_split_gives_equal_unit_counts() -> None:
    m = toy_model(10)  # 12 units
    devs = [device(p, memory=GIB) for p in "abcd"]
    out = even_split(devs, full_links(devs), m, constraints=BARE)
    assert sizes(out) == {"a": 3, "b": 3, "c": 3, "d": 3}
    assert out.strategy == "even"


def test_memory_proportional_follows_free_memory() -> None:
    m = toy_model(10)
    devs = [device("a", memory=3 * GIB), device("b", memory=GIB)]
    out = memory_proportional(devs, full_links(devs), m, constraints=BARE)
    assert [s.peer_id for s in out.pipelines[0].stages] == ["a", "b"]  # largest first
    assert sizes(out) == {"a": 9, "b": 3}


def test_greedy_fill_puts_fastest_first_up_to_memory() -> None:
    m = toy_model(10)
    devs = [device("slow", memory=GIB, bandwidth=1e10), device("fast", memory=GIB, bandwidth=1e12)]
    out = greedy_fill(devs, full_links(devs), m, constraints=BARE)
    assert [s.peer_id for s in out.pipelines[0].stages] == ["fast"]  # it holds the whole model


def test_baseline_that_does_not_fit_raises() -> None:
    m = toy_model(10)
    need = CostModel(m, [device("x")], [], BARE).model_bytes()
    half = [device("a", memory=need * 6 // 10), device("b", memory=need * 6 // 10)]
    with pytest.raises(InsufficientCapacity):
        even_split(half[:1], [], m, constraints=BARE)  # one device must hold it all
    assert plan(half, full_links(half), m, constraints=BARE).pipelines  # the planner fits it


FASTEST = SearchOptions(balance_tolerance=0.0)  # the least-latency search, unbalanced


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_planner_never_worse_than_a_baseline(objective: Objective) -> None:
    m = model_profile(KNOWN_SHAPES["llama-13b"], dtype="float16", name="llama-13b")
    rng = random.Random(3)
    compared = 0
    for _ in range(12):
        devs, links = random_mesh(rng, rng.randint(2, 6))
        try:
            best = plan(devs, links, m, objective=objective, options=FASTEST)
            balanced = plan(devs, links, m, objective=objective)
        except InsufficientCapacity:
            continue
        if objective == "latency":  # balancing the cut costs at most the tolerance ...
            tolerance = SearchOptions().balance_tolerance
            assert balanced.objective_value <= best.objective_value * (1 + tolerance) + 1e-12
            # ... and never slows the slowest stage
            assert balanced.pipelines[0].bottleneck_s <= best.pipelines[0].bottleneck_s * (1 + 1e-9)
        else:
            assert balanced == best  # a throughput plan is balanced by its own search
        for baseline in BASELINES.values():
            try:
                other = baseline(devs, links, m, objective=objective)
            except InsufficientCapacity:
                continue
            compared += 1
            if objective == "latency":
                assert best.objective_value <= other.objective_value * (1 + 1e-9)
            else:
                assert best.objective_value >= other.objective_value * (1 - 1e-9)
    assert compared >= 10
