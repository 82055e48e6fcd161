"""How many drafts a session's next step carries, from what its steps measured.

A step that carries ``k`` drafts costs more than a plain one: every stage
computes ``k + 1`` positions. We model its time as a line,
``t(k) = t0 + c·k``, fitted by least squares to the step time measured at
each ``k`` tried (a moving average per ``k``, so that a ``k`` the session
settles on does not crowd out the plain steps it measured before).
Acceptance is geometric: each draft is kept with probability ``a`` given
that the ones before it were, so a step with ``k`` drafts yields
``1 + a + a² + … + a^k`` tokens on average (the target's own token is the
``1``). ``a`` is the share of tried positions that were kept (a step that
kept ``m`` of ``k`` drafts tried ``m + 1`` when it rejected one, ``k`` when
it kept all), both counts decayed at every step so that a change of text shows within a few steps.

:meth:`SpeculationBudget.k` picks the ``k`` in ``0..max_k`` with the most
expected tokens per second, and 0 unless that beats plain decoding by
``margin``: where hops are cheap and drafts rarely hold, a session decodes
as it would without speculation. While it is off, one step in
``probe_every`` carries ``probe_k`` drafts, so that a session whose text
turns predictable (or whose route gets slower) is noticed; probes are the
only cost speculation can add, and they are bounded by that fraction. The
first two steps carry drafts of two sizes (``probe_k``, then ``max_k / 2``):
a line needs two points, and a gateway may report only steps that carried
drafts (then ``t0`` is the line's, extrapolated).

A step asked for drafts may go plain: the drafter had none (prompt lookup on
text with no repeated n-gram). Such an empty ask costs the session its plain
fast path for that step (a gateway sends a step it may draft from its own
loop; the gateway says so with :meth:`SpeculationBudget.no_drafts`), so after
one the next steps decode plainly without asking: one step,
then twice as many after each further empty ask in a row, up to
``probe_every``; a step that carries drafts ends the back-off.

A draft model's time is not in the route's: ``overhead_s`` (the drafter's
last proposal, in seconds) is added to each recorded step that carried drafts.

Pure and deterministic: no clock, no randomness; the same sequence of
:meth:`~SpeculationBudget.record` calls gives the same choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetmesh.errors import InvalidRequest

TIME_DECAY = 0.75  # weight of a k's previous step time when it runs again


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step with ``k`` drafts yields on average: ``1 + a + … + a^k``."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(sum(a**i for i in range(k + 1)))


def fit_line(samples: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``(t0, c)`` of ``seconds ≈ t0 + c·k``; None without two distinct ``k``."""
    n = len(samples)
    if n < 2:
        return None
    mean_k = sum(k for k, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    var_k = sum((k - mean_k) ** 2 for k, _ in samples)
    if var_k == 0:
        return None
    slope = sum((k - mean_k) * (t - mean_t) for k, t in samples) / var_k
    return mean_t - slope * mean_k, slope


@dataclass(frozen=True, slots=True)
class BudgetState:
    """What a budget believes now (for status lines and tests)."""

    acceptance: float
    step_s: float | None  # t0: a plain step
    per_draft_s: float | None  # c: what each draft adds to a step
    steps: int


class SpeculationBudget:
    """A :class:`~hetmesh.speculative.drafter.Budget` for one session (or one route)."""

    def __init__(
        self,
        *,
        max_k: int = 8,
        margin: float = 0.05,
        probe_every: int = 16,
        probe_k: int = 1,
        decay: float = 0.8,
        prior_acceptance: float = 0.5,
        overhead_s: Callable[[], float] | None = None,
    ) -> None:
        """``overhead_s``: what drafting the step just recorded took, added to its
        time (a draft model's forwards run before the step is sent, so the route's
        clock does not see them); None: drafting is free (prompt lookup)."""
        if max_k < 0 or not 0 <= probe_k <= max_k:
            raise InvalidRequest(f"need 0 <= probe_k ({probe_k}) <= max_k ({max_k})")
        if probe_every < 2 or not 0 < decay <= 1 or margin < 0:
            raise InvalidRequest("need probe_every >= 2, 0 < decay <= 1 and margin >= 0")
        if not 0 <= prior_acceptance <= 1:
            raise InvalidRequest("need 0 <= prior_acceptance <= 1")
        self.max_k = max_k
        self.margin = margin
        self.probe_every = probe_every
        self.probe_k = probe_k
        self.decay = decay
        self.overhead_s = overhead_s
        # decayed counts of the draft positions kept and rejected, from a prior of one each way
        self._kept = prior_acceptance
        self._rejected = 1.0 - prior_acceptance
        self._times: dict[int, float] = {}  # k -> moving average of its step's seconds
        self._steps = 0  # steps recorded
        self._since_probe = 0  # plain steps chosen since drafts were last asked for
        self._hold = 0  # plain steps still to choose after an empty ask
        self._backoff = 1  # the hold after the next empty ask

    # -- what it believes -------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        return self._kept / (self._kept + self._rejected)

    def state(self) -> BudgetState:
        line = self._line()
        return BudgetState(
            acceptance=self.acceptance,
            step_s=None if line is None else line[0],
            per_draft_s=None if line is None else line[1],
            steps=self._steps,
        )

    def _line(self) -> tuple[float, float] | None:
        """``(t0, c)``, ``c`` at least 0 and ``t0`` above 0; None until steps of two
        different sizes were measured."""
        fitted = fit_line(sorted(self._times.items()))
        if fitted is None:
            return None
        t0, c = fitted
        floor = self._times.get(0, min(self._times.values()))
        return max(t0, floor * 0.5, 1e-9), max(c, 0.0)

    def best(self) -> int:
        """The ``k`` with the most expected tokens per second (0 unless it beats plain
        decoding by the margin); 0 until a step line is known."""
        line = self._line()
        if line is None:
            return 0
        t0, c = line
        a = self.acceptance
        plain_rate = 1.0 / t0
        best_k, best_rate = 0, plain_rate
        for k in range(1, self.max_k + 1):
            rate = expected_tokens(a, k) / (t0 + c * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_rate < plain_rate * (1 + self.margin):
            return 0
        return best_k

    # -- the Budget protocol ----------------------------------------------------------

    def k(self) -> int:
        """Drafts for the next step (called once a step).

        The first steps carry ``probe_k`` drafts and then a second size, to fit the
        line (a gateway may tell only of steps that carried drafts); then the best
        ``k``, or, while that is 0, ``probe_k`` once in ``probe_every`` steps.
        """
        if self._hold > 0:  # backing off after an empty ask
            self._hold -= 1
            return self._plain_or_probe(0)
        return self._choose()

    def _choose(self) -> int:
        fitted = self._line()
        if fitted is None:
            tried = [k for k in self._times if k]
            if not tried or self.probe_k == 0:
                return self._plain_or_probe(self.probe_k)
            second = max(self.max_k // 2, 1)
            return second if second not in tried else self._plain_or_probe(self.probe_k)
        chosen = self.best()
        if chosen:
            self._since_probe = 0
            return chosen
        if self._since_probe + 1 >= self.probe_every:
            return self._plain_or_probe(self.probe_k)
        return self._plain_or_probe(0)

    def _plain_or_probe(self, k: int) -> int:
        self._since_probe = 0 if k else self._since_probe + 1
        return k

    def no_drafts(self) -> None:
        """The drafts ``k()`` asked for did not come: the drafter had none, the step
        goes plain. Back off (see the module)."""
        self._hold = self._backoff
        self._backoff = min(2 * self._backoff, self.probe_every)

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        if not 0 <= accepted <= drafted or seconds < 0:
            raise InvalidRequest(f"a step kept {accepted} of {drafted} drafts in {seconds} s")
        self._steps += 1
        if self.overhead_s is not None and drafted:
            seconds += max(0.0, self.overhead_s())  # drafting the step, before it was sent
        old = self._times.get(drafted)
        self._times[drafted] = (
            seconds if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * seconds
        )
        if drafted == 0:
            return
        self._backoff = 1
        tried = accepted + (1 if accepted < drafted else 0)
        self._kept = self.decay * self._kept + accepted
        self._rejected = self.decay * self._rejected + tried - accepted


__all__ = ["TIME_DECAY", "BudgetState", "SpeculationBudget", "expected_tokens", "fit_line"]
