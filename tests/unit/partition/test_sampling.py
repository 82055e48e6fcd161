"""Sampling: greedy, seeded reproducibility, top-k/top-p cut-offs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def test_greedy_picks_argmax() -> None:
    for params in (SamplingParams(), SamplingParams(temperature=0.0, seed=4)):
        assert params.greedy
        assert Sampler(params)(LOGITS, 0) == 1


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    flat = torch.zeros(1000)
    draws = {}
    for seed in (1, 1, 2):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        draws.setdefault(seed, []).append([sampler(flat, step) for step in range(20)])
    assert draws[1][0] == draws[1][1]
    assert draws[1][0] != draws[2][0]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for params in (
        SamplingParams(temperature=5.0, top_k=1, seed=0),
        SamplingParams(temperature=5.0, top_p=1e-6, seed=0),
    ):
        sampler = Sampler(params)
        assert {sampler(LOGITS, step) for step in range(50)} == {1}


def test_top_k_and_top_p_restrict_the_support() -> None:
    top_k = Sampler(SamplingParams(temperature=10.0, top_k=2, seed=0))
    assert {top_k(LOGITS, step) for step in range(200)} == {1, 4}
    # probabilities at T=1: token 1 ~0.37, 4 ~0.34, 2 ~0.14: top_p 0.6 keeps {1, 4}
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.6, seed=0))
    assert {top_p(LOGITS, step) for step in range(200)} == {1, 4}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"top_k": 0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"stop": ("",)},
    ],
)
def test_bad_sampling_params_are_invalid_requests(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_a_step_draws_the_same_token_whatever_came_before() -> None:
    """Per-step seeding: a replayed session (fresh sampler) continues identically."""
    flat = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, seed=7)
    first = Sampler(params)
    run = [first(flat, step) for step in range(12)]
    resumed = Sampler(params)
    assert [resumed(flat, step) for step in range(6, 12)] == run[6:]
    assert len(set(run)) > 6  # the draws really vary from step to step


def test_unseeded_sessions_differ() -> None:
    flat = torch.zeros(1000)
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert [a(flat, s) for s in range(10)] != [b(flat, s) for s in range(10)]


def _unchecked(**values: object) -> SamplingParams:
    """Sampling values a peer that skipped the record's checks could hand a stage."""
    params = SamplingParams(temperature=1.0, seed=1)
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


def test_an_overflowing_temperature_is_an_invalid_request_not_a_torch_error() -> None:
    logits = torch.tensor([3.0, -2.0, 0.5])
    with pytest.raises(InvalidRequest, match="temperature"):
        Sampler(_unchecked(temperature=1e-45))(logits, 0)
    # the smallest temperature the record admits samples (as greedy would) on large logits
    assert Sampler(SamplingParams(temperature=1e-4, seed=1))(logits * 1e3, 0) == 0


def test_non_finite_logits_are_a_compute_error() -> None:
    from hetmesh.errors import ComputeError

    for bad in (math.nan, math.inf):
        logits = torch.tensor([1.0, bad, 0.0])
        with pytest.raises(ComputeError):
            Sampler(SamplingParams(temperature=0.7, seed=1))(logits, 0)
        with pytest.raises(ComputeError):
            Sampler(SamplingParams())(logits, 0)
