"""Prompt lookup proposes what followed the longest repeated n-gram, in bounded work."""

from __future__ import annotations

import time

import pytest

from hetmesh.speculative.lookup import PromptLookup


@pytest.mark.parametrize(
    ("history", "k", "drafts"),
    [
        ([1, 2, 3, 4, 5, 9, 2, 3], 3, [4, 5, 9]),  # "2 3" occurred: what followed it
        ([1, 2, 3, 4, 5, 9, 2, 3], 1, [4]),
        ([1, 2, 3, 4, 1, 2, 3], 8, [4, 1, 2, 3]),  # up to the history's end
        ([5, 6, 7, 8], 4, []),  # nothing repeats
        ([5, 6, 5], 4, []),  # one token repeats: below the smallest n-gram
        ([1, 2, 3, 1, 2, 7, 1, 2], 2, [7, 1]),  # the latest occurrence wins
        ([9, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], 2, [5, 1]),  # longest n-gram first
        ([1, 2, 3, 1, 2], 0, []),
        ([], 3, []),
    ],
)
def test_lookup_proposes_what_followed(history: list[int], k: int, drafts: list[int]) -> None:
    assert PromptLookup().propose(history, k) == drafts


def test_lookup_prefers_the_longer_ngram_over_a_later_shorter_one() -> None:
    # "1 2 3" followed by 4 early on; "2 3" followed by 6 later: the trigram decides
    history = [1, 2, 3, 4, 0, 2, 3, 6, 0, 1, 2, 3]
    assert PromptLookup(max_ngram=3, min_ngram=2).propose(history, 1) == [4]
    assert PromptLookup(max_ngram=2, min_ngram=2).propose(history, 1) == [6]


def test_lookup_incremental_equals_fresh() -> None:
    """A drafter fed a growing history proposes what a fresh one proposes each time,
    and one given an unrelated history starts over."""
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    text = [*text, *text[4:20], 1, 4, 1, 5]
    growing = PromptLookup(min_ngram=1)
    for end in range(1, len(text) + 1):
        history = text[:end]
        assert growing.propose(history, 4) == PromptLookup(min_ngram=1).propose(history, 4)
    assert growing.propose([7, 8, 7], 2) == [8, 7]


def test_lookup_window_bounds_a_rebuild() -> None:
    history = [7, 8, 9, *range(100, 200), 7, 8]
    assert PromptLookup(window=200).propose(history, 1) == [9]
    assert PromptLookup(window=50).propose(history, 1) == []  # the match is out of the window


def test_lookup_cost_grows_with_new_tokens_only() -> None:
    """On a 30k-token history, one more token costs far less than indexing it all."""
    history = [(i * 7919) % 5003 for i in range(30_000)]
    drafter = PromptLookup()
    began = time.thread_time()
    drafter.propose(history, 4)
    whole = time.thread_time() - began
    began = time.thread_time()
    for token in range(200):
        history.append(token)
        drafter.propose(history, 4)
    per_token = (time.thread_time() - began) / 200
    assert per_token < whole / 20
