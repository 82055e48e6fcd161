"""Prompt lookup: drafts copied from earlier in a session's own history (issue 48).

Text that rewrites, summarises or edits a passage repeats runs of it. The
drafter takes the longest n-gram (``max_ngram`` tokens down to ``min_ngram``)
that ends the history and occurred earlier in it, and proposes the tokens that
followed its latest earlier occurrence, up to ``k``. No model, no device.

Bounded work per call: an index from each n-gram to the end of its latest
occurrence grows with the history (each new token costs ``max_ngram`` dict
writes), so a call costs O(new tokens), not O(history). A history that is not
an extension of the one indexed (a replay that started over, another session)
is indexed afresh, its last :data:`WINDOW` tokens only.

Pure: nothing here imports trio, libp2p or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetmesh.speculative.accept import FixedBudget

WINDOW = 16384  # tokens of a history indexed afresh (the latest): bounds a rebuild
MAX_NGRAM = 3
MIN_NGRAM = 2  # a single token repeats too often to predict what follows


class PromptLookup:
    """A :class:`~hetmesh.speculative.drafter.Drafter` for one session; see the module."""

    blocking = False  # cheap: the gateway calls it inline

    def __init__(
        self, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, window: int = WINDOW
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= {min_ngram} <= {max_ngram}")
        if window < max_ngram + 1:
            raise ValueError(f"a window of {window} tokens holds no n-gram to match")
        self._max = max_ngram
        self._min = min_ngram
        self._window = window
        self._tokens: list[int] = []  # the history indexed (a copy: the caller's list grows)
        self._start = 0  # the first index in ``_tokens`` that the index covers
        # n-gram -> index in _tokens of its last token, latest occurrence that is not the
        # history's end (an occurrence ending at the end predicts nothing yet)
        self._ends: dict[tuple[int, ...], int] = {}

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        n-gram ending ``history``; empty when none occurred or ``k`` is 0."""
        if k <= 0 or len(history) < self._min + 1:
            return []
        self._follow(history)
        tokens = self._tokens
        end = len(tokens) - 1
        for n in range(min(self._max, len(tokens) - 1), self._min - 1, -1):
            found = self._ends.get(tuple(tokens[end - n + 1 : end + 1]))
            if found is not None:
                return tokens[found + 1 : found + 1 + k]
        return []

    def close(self) -> None:
        self._tokens, self._ends = [], {}

    def _follow(self, history: Sequence[int]) -> None:
        """Bring the index up to ``history``: extend it, or index afresh."""
        tokens = self._tokens
        known = len(tokens)
        extends = known <= len(history) and (
            known == 0 or (history[known - 1] == tokens[-1] and history[0] == tokens[0])
        )
        if not extends:
            self._tokens, self._ends = [], {}
            tokens, known = self._tokens, 0
        if known == 0 and len(history) > self._window:
            # the latest window only: an older match is unlikely to be the one that repeats
            self._start = len(history) - self._window
            tokens.extend(int(t) for t in history[: self._start])
        else:
            self._start = min(self._start, known) if known else 0
        first_new = len(tokens)
        tokens.extend(int(t) for t in history[first_new:])
        # index every n-gram ending before the last token (the last's n-grams are the query)
        for end in range(max(first_new - 1, self._start), len(tokens) - 1):
            for n in range(1, self._max + 1):
                begin = end - n + 1
                if begin < self._start:
                    break
                self._ends[tuple(tokens[begin : end + 1])] = end


def speculation(k: int) -> Callable[[], tuple[PromptLookup, FixedBudget]] | None:
    """What a gateway drafts with for each request: prompt lookup, ``k`` drafts a step
    (None for ``k`` = 0: requests decode plainly)."""
    if k <= 0:
        return None
    return lambda: (PromptLookup(), FixedBudget(k))


__all__ = ["MAX_NGRAM", "MIN_NGRAM", "WINDOW", "PromptLookup", "speculation"]
