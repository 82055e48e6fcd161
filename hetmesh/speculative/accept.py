"""Which drafted tokens a verify step keeps (issue 48), and a fixed draft budget.

A verify step feeds a session's last token and ``k`` drafts at positions
``p .. p + k``; the head stage then holds the target's logits for positions
``p + 1 .. p + k + 1``. It draws row ``i``'s token exactly as plain decoding
draws the ``(step + i)``-th token (the session's sampler, seeded by ``(seed,
step + i)``: :mod:`hetmesh.partition.sampling`) and keeps draft ``i`` iff it
equals that draw. Row ``i``'s input is then the very token plain decoding would
have fed there, so the next row's draw is plain decoding's too. The step
delivers the draws up to and including the first that disagrees with its draft
(or all ``k + 1``): the same tokens plain decoding delivers, greedy or seeded.

Seen as rejection sampling: the drafts are deterministic (a point mass q on
draft d), so the exact rule keeps d with probability min(1, p(d) / q(d)) =
p(d), and on rejection draws from the residual (p - q)+, which is p
conditioned on not d. "Keep d iff the target's own draw equals d" does just
that: P(keep) = p(d), and a rejected draft's replacement is the target's draw
given that it is not d. The output's law is the target's, and here more: its
very tokens.

Pure: nothing here imports trio, libp2p or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

MAX_DRAFTS = 32  # drafts a verify step may carry (a stage refuses more)


def verify(
    drafts: Sequence[int], draw: Callable[[int], int], stop: Collection[int] = ()
) -> list[int]:
    """The tokens a verify step delivers: ``draw(i)`` for ``i = 0, 1, …`` while each
    agrees with ``drafts[i]``, then the first that does not (or the ``k + 1``-th).

    ``draw(i)`` is the target's token for row ``i`` (called in order, each at most
    once: a sampler with a grammar could advance on it); a draw in ``stop`` ends
    the step (nothing after an end-of-sequence token is delivered)."""
    tokens: list[int] = []
    for i in range(len(drafts) + 1):
        token = draw(i)
        tokens.append(token)
        if i == len(drafts) or token != drafts[i] or token in stop:
            break
    return tokens


def accepted(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of ``drafts`` the delivered ``tokens`` kept (their agreeing prefix)."""
    kept = 0
    for draft, token in zip(drafts, tokens, strict=False):
        if draft != token:
            break
        kept += 1
    return kept


class FixedBudget:
    """A :class:`~hetmesh.speculative.drafter.Budget` that always asks for ``k`` drafts
    (``hetmesh node start --speculative-k``), until a measured one takes its place."""

    def __init__(self, k: int) -> None:
        if not 0 <= k <= MAX_DRAFTS:
            raise ValueError(f"k must be within [0, {MAX_DRAFTS}], got {k}")
        self._k = k

    def k(self) -> int:
        return self._k

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        """Nothing learnt: the budget is fixed."""


__all__ = ["MAX_DRAFTS", "FixedBudget", "accepted", "verify"]
