"""The acceptance rule delivers plain decoding's tokens, and its first token's law is
the target's (a chi-square test over seeds on a tiny distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from hetmesh.partition.sampling import Sampler, SamplingParams
from hetmesh.speculative.accept import FixedBudget, accepted, verify


@pytest.mark.parametrize(
    ("drafts", "draws", "tokens"),
    [
        ([], [5], [5]),
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all kept, plus the target's own
        ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the second differs: kept one, then the draw
        ([5, 6, 7], [4, 6, 7, 8], [4]),  # none kept
        ([5, 2, 7], [5, 2, 7, 8], [5, 2]),  # 2 stops the step: nothing after it
    ],
)
def test_verify_keeps_the_agreeing_prefix(
    drafts: list[int], draws: list[int], tokens: list[int]
) -> None:
    called: list[int] = []

    def draw(i: int) -> int:
        called.append(i)
        return draws[i]

    assert verify(drafts, draw, stop={2}) == tokens
    assert called == list(range(len(tokens)))  # in order, once each, none past the end


def test_accepted_counts_the_kept_drafts() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9]) == 1
    assert accepted([5, 6, 7], [4]) == 0
    assert accepted([], [4]) == 0


def _plain(sampler: Sampler, logits: torch.Tensor, step: int, n: int) -> list[int]:
    return [sampler(logits[i], step + i) for i in range(n)]


def test_seeded_verify_delivers_plain_decodings_tokens() -> None:
    """Rows drawn by (seed, step + i): a step's tokens are plain decoding's, whatever
    the drafts (every row's logits fixed here: the same inputs give the same rows)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 0.5
    for seed in range(20):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, max_new_tokens=8))
        plain = _plain(sampler, logits, 3, 6)
        for drafts in ([], plain[:5], [*plain[:2], 39, 38, 37], [(plain[0] + 1) % 40] * 5):
            tokens = verify(drafts, lambda i, s=sampler: s(logits[i], 3 + i))
            assert tokens == plain[: len(tokens)]
            assert len(tokens) == accepted(drafts, tokens) + 1


def test_first_token_law_is_the_targets() -> None:
    """Over many seeds, the first delivered token of a step with a fixed draft follows
    the target's softmax (chi-square, 8 categories, p > 0.001), and the draft is kept
    about p(draft) of the time."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])
    probs = torch.softmax(logits, dim=0).tolist()
    draft = 2
    runs = 4000
    counts = [0] * 8
    kept = 0
    for seed in range(runs):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, max_new_tokens=4))
        tokens = verify([draft], lambda i, s=sampler: s(logits, 7 + i))
        counts[tokens[0]] += 1
        kept += accepted([draft], tokens)
    chi2 = sum((c - runs * p) ** 2 / (runs * p) for c, p in zip(counts, probs, strict=True))
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    sd = math.sqrt(runs * probs[draft] * (1 - probs[draft]))
    assert abs(kept - runs * probs[draft]) < 4 * sd


def test_fixed_budget() -> None:
    budget = FixedBudget(4)
    budget.record(4, 2, 0.01)
    assert budget.k() == 4
    with pytest.raises(ValueError, match="k must be"):
        FixedBudget(-1)
