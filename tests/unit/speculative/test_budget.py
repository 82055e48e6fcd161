"""The draft budget: off where speculation cannot pay, large where hops are dear."""

from __future__ import annotations

import random

import pytest

from hetmesh.errors import InvalidRequest
from hetmesh.speculative.budget import SpeculationBudget, expected_tokens, fit_line
from hetmesh.speculative.drafter import Budget


def simulate(
    budget: SpeculationBudget,
    steps: int,
    *,
    t0: float,
    per_draft: float,
    acceptance: float,
    rng: random.Random,
) -> tuple[list[int], float, int]:
    """Run ``steps`` steps of a route whose step costs ``t0 + per_draft·k`` and whose
    drafts hold with probability ``acceptance`` each: (chosen ks, seconds, tokens)."""
    chosen: list[int] = []
    seconds = 0.0
    tokens = 0
    for _ in range(steps):
        k = budget.k()
        chosen.append(k)
        kept = 0
        while kept < k and rng.random() < acceptance:
            kept += 1
        took = t0 + per_draft * k
        budget.record(k, kept, took)
        seconds += took
        tokens += kept + 1
    return chosen, seconds, tokens


def test_is_a_budget() -> None:
    budget: Budget = SpeculationBudget(probe_k=1, max_k=8)
    assert budget.k() == 1  # two sizes first: a line needs two points
    budget.record(1, 1, 0.02)
    assert budget.k() == 4
    budget.record(4, 4, 0.03)
    assert budget.k() == 8


def test_learns_from_drafted_steps_alone() -> None:
    """A gateway that reports only the steps that carried drafts: t0 is extrapolated."""
    budget = SpeculationBudget(max_k=8)
    for _ in range(40):
        k = budget.k()
        if k:
            budget.record(k, 0, 0.012 + 0.003 * k)
    state = budget.state()
    assert state.step_s == pytest.approx(0.012)
    assert state.per_draft_s == pytest.approx(0.003)
    assert budget.best() == 0


def test_drafting_time_counts() -> None:
    """A draft model's 10 ms a draft makes 3 ms of verification per draft not pay."""
    drafting = {"s": 0.0}
    cheap = SpeculationBudget(max_k=8)
    dear = SpeculationBudget(max_k=8, overhead_s=lambda: drafting["s"])
    for _ in range(30):
        for budget in (cheap, dear):
            k = budget.k()
            drafting["s"] = 0.010 * k
            budget.record(k, int(k * 0.6), 0.020 + 0.003 * k)
    assert cheap.best() > 0
    assert dear.best() == 0


@pytest.mark.parametrize(("a", "k", "want"), [(0.0, 5, 1.0), (1.0, 3, 4.0), (0.5, 2, 1.75)])
def test_expected_tokens(a: float, k: int, want: float) -> None:
    assert expected_tokens(a, k) == pytest.approx(want)


def test_fit_line() -> None:
    assert fit_line([(0, 0.01)]) is None
    assert fit_line([(2, 0.01), (2, 0.02)]) is None
    t0, c = fit_line([(0, 0.010), (2, 0.014), (4, 0.018)]) or (0, 0)
    assert t0 == pytest.approx(0.010)
    assert c == pytest.approx(0.002)


def test_cheap_steps_and_low_acceptance_stay_off() -> None:
    """Loopback: a 12 ms step, each draft +3 ms, drafts hold 20 %: plain decoding wins."""
    budget = SpeculationBudget()
    chosen, _, _ = simulate(
        budget, 200, t0=0.012, per_draft=0.003, acceptance=0.2, rng=random.Random(1)
    )
    after = chosen[20:]
    assert sum(1 for k in after if k) <= len(after) // 16 + 4  # probes, and a lucky one's echo
    assert max(after) <= 2
    assert budget.best() == 0


def test_probes_are_bounded_and_cost_little() -> None:
    budget = SpeculationBudget(probe_every=16, probe_k=1)
    chosen, seconds, tokens = simulate(
        budget, 320, t0=0.012, per_draft=0.003, acceptance=0.0, rng=random.Random(2)
    )
    probes = sum(1 for k in chosen if k)
    assert probes <= 320 // 16 + 2
    plain_s = 320 * 0.012
    assert tokens == 320
    assert seconds <= plain_s * 1.03  # never more than a few percent slower than plain


def test_expensive_hops_and_high_acceptance_draft_many() -> None:
    """A WAN: 20 ms RTT per stage of three (60 ms a step), a draft +2 ms, 85 % kept."""
    budget = SpeculationBudget(max_k=8)
    chosen, seconds, tokens = simulate(
        budget, 100, t0=0.075, per_draft=0.002, acceptance=0.85, rng=random.Random(3)
    )
    assert min(chosen[10:]) >= 3
    assert sum(chosen[10:]) / 90 >= 6
    assert tokens / seconds > 2.5 / 0.075  # ≥ 2.5x plain decoding's tokens per second


def test_adapts_when_acceptance_drops_and_recovers() -> None:
    rng = random.Random(4)
    budget = SpeculationBudget(max_k=8)
    route = {"t0": 0.04, "per_draft": 0.004, "rng": rng}
    chosen, _, _ = simulate(budget, 60, acceptance=0.9, **route)  # type: ignore[arg-type]
    assert chosen[-1] >= 4
    chosen, _, _ = simulate(budget, 60, acceptance=0.0, **route)  # type: ignore[arg-type]
    assert chosen[:20].index(0) <= 18  # off within a few steps of the drop
    assert chosen[:8] == sorted(chosen[:8], reverse=True)  # and fewer drafts at every step
    assert chosen[-20:].count(0) >= 18
    chosen, _, _ = simulate(budget, 80, acceptance=0.9, **route)  # type: ignore[arg-type]
    assert chosen[-1] >= 4  # a probe noticed it, and it came back


def test_deterministic() -> None:
    runs = [
        simulate(
            SpeculationBudget(), 100, t0=0.03, per_draft=0.003, acceptance=0.6, rng=random.Random(5)
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_a_settled_k_keeps_its_line() -> None:
    """Weeks at one k must not forget what a plain step costs."""
    budget = SpeculationBudget(max_k=4)
    simulate(budget, 300, t0=0.06, per_draft=0.001, acceptance=0.95, rng=random.Random(6))
    state = budget.state()
    assert state.step_s == pytest.approx(0.06, rel=0.05)
    assert budget.k() == 4


def test_drafterless_steps_do_not_move_acceptance() -> None:
    budget = SpeculationBudget()
    before = budget.acceptance
    for _ in range(10):
        budget.record(0, 0, 0.01)
    assert budget.acceptance == before


@pytest.mark.parametrize(
    ("drafted", "accepted", "seconds"), [(2, 3, 0.1), (-1, 0, 0.1), (1, 0, -1)]
)
def test_bad_records_raise(drafted: int, accepted: int, seconds: float) -> None:
    with pytest.raises(InvalidRequest):
        SpeculationBudget().record(drafted, accepted, seconds)


def test_bad_settings_raise() -> None:
    with pytest.raises(InvalidRequest):
        SpeculationBudget(max_k=2, probe_k=3)
    with pytest.raises(InvalidRequest):
        SpeculationBudget(probe_every=1)


@pytest.mark.parametrize("plain_reported", [True, False])
def test_probe_pacing_by_k_calls(plain_reported: bool) -> None:
    """The gateway asks k() exactly once per step it sends; whether or not it reports
    plain steps (record(0, 0, s)), an off budget probes once in probe_every steps."""
    budget = SpeculationBudget(probe_every=16, probe_k=1)
    budget.record(1, 0, 0.013)  # two sizes known, drafts never hold: off
    budget.record(4, 0, 0.022)
    chosen = []
    for _ in range(160):
        k = budget.k()
        chosen.append(k)
        if k or plain_reported:
            budget.record(k, 0, 0.010 + 0.003 * k)
    assert budget.best() == 0
    assert [i for i, k in enumerate(chosen) if k] == list(range(15, 160, 16))
    if plain_reported:
        assert budget.state().step_s == pytest.approx(0.010)


def test_a_drafter_with_nothing_to_offer_leaves_most_steps_plain() -> None:
    """Prompt lookup on text with no repeated n-gram proposes nothing: each such ask
    makes the step plain without the lane, so the budget backs off (1, 2, 4, … up to
    ``probe_every`` plain steps asked for nothing) and drafts again once some come."""
    budget = SpeculationBudget(max_k=8, probe_every=16)
    asks = 0
    for _ in range(200):
        if budget.k():
            asks += 1
            budget.no_drafts()  # the drafter had none: the step goes plain
        budget.record(0, 0, 0.1)
    assert asks <= 1 + 5 + 200 // 16  # the back-off's doublings, then one in 16
    # drafts come again: the back-off ends with the first step that carries some
    while not budget.k():
        budget.record(0, 0, 0.1)
    budget.record(1, 1, 0.11)
    budget.no_drafts()
    assert budget.k() == 0  # one plain step after a single empty ask
    budget.record(0, 0, 0.1)
    assert budget.k() > 0
