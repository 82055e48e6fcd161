"""The draft model: its drafts are its own greedy continuation, across rewinds."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.errors import InvalidRequest
from hetmesh.partition.generate import LocalPipeline
from hetmesh.protocol.generate import SamplingParams
from hetmesh.speculative.draft_model import DraftModel, speculation
from hetmesh.speculative.drafter import Drafter

PROMPT = [1, 9038, 2784, 314, 253, 1345, 28, 665, 2292, 260, 2725, 30]


def greedy(pipeline: LocalPipeline, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    return list(pipeline.generate_ids(prompt, params, eos_ids=set()))


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_dir: Path) -> DraftModel:
    return DraftModel.load(tiny_model_dir, weights="float32", max_prefill=8)


def test_drafts_are_the_greedy_continuation(tiny_draft: DraftModel) -> None:
    want = greedy(tiny_draft.pipeline, PROMPT, 6)
    drafter: Drafter = tiny_draft.drafter()
    try:
        assert drafter.propose(PROMPT, 6) == want
    finally:
        drafter.close()


def test_follows_a_session_through_partial_acceptances(tiny_draft: DraftModel) -> None:
    """The gateway keeps some drafts and appends the target's token (here one that
    differs from the draft it replaces): each proposal equals a fresh drafter's."""
    drafter = tiny_draft.drafter()
    try:
        history = list(PROMPT)
        for kept, target in [(2, 17), (0, 4242), (4, 91), (1, 3003), (4, 77)]:
            drafts = drafter.propose(history, 4)
            assert len(drafts) == 4
            assert drafts == greedy(tiny_draft.pipeline, history, 4)
            assert drafter.held == history + drafts[:3]  # the rejected tail went
            history += [*drafts[:kept], target]
        fresh = tiny_draft.drafter()
        try:
            assert drafter.propose(history, 3) == fresh.propose(history, 3)
        finally:
            fresh.close()
    finally:
        drafter.close()


def test_the_cache_rewinds_instead_of_refeeding(tiny_draft: DraftModel) -> None:
    drafter = tiny_draft.drafter()
    try:
        drafts = drafter.propose(PROMPT, 4)
        assert drafter.held == PROMPT + drafts[:3]
        drafter.propose([*PROMPT, drafts[0], 5], 2)
        assert drafter.held[: len(PROMPT) + 2] == [*PROMPT, drafts[0], 5]
        drafter.propose(PROMPT[:5], 2)  # a shorter history (a replay) rewinds further
        assert drafter.held[:5] == PROMPT[:5]
    finally:
        drafter.close()


def test_catch_up_longer_than_a_chunk(tiny_draft: DraftModel) -> None:
    long = (PROMPT * 3)[:30]  # 30 tokens fed in chunks of 8
    drafter = tiny_draft.drafter()
    try:
        assert drafter.propose(long, 3) == greedy(tiny_draft.pipeline, long, 3)
    finally:
        drafter.close()


def test_memory_is_counted_and_freed(tiny_draft: DraftModel) -> None:
    weights = tiny_draft.weight_bytes()
    assert weights > 0
    drafter = tiny_draft.drafter()
    drafter.propose(PROMPT, 4)
    assert drafter.kv_bytes > 0
    assert tiny_draft.resident_bytes() == weights + drafter.kv_bytes
    drafter.close()
    assert tiny_draft.resident_bytes() == weights
    drafter.close()  # twice is fine
    with pytest.raises(InvalidRequest):
        drafter.propose(PROMPT, 2)


def test_no_drafts_where_none_fit(tiny_draft: DraftModel) -> None:
    drafter = tiny_draft.drafter()
    try:
        assert drafter.propose(PROMPT, 0) == []
        assert drafter.propose([], 3) == []
        too_long = [5] * (tiny_draft.max_context - 1)
        assert drafter.propose(too_long, 3) == []
    finally:
        drafter.close()


@pytest.mark.model
@pytest.mark.slow
def test_int4_copy_of_the_default_model(default_model_dir: Path) -> None:
    """The issue's case: the default model in int4 drafts its own greedy text."""
    model = DraftModel.load(default_model_dir)  # int4
    assert str(model.pipeline.weights) == "int4"
    want = greedy(model.pipeline, PROMPT, 8)
    drafter = model.drafter()
    try:
        assert drafter.propose(PROMPT, 8) == want
        history = [*PROMPT, *want[:3], want[3] + 1]  # three kept, then another token
        assert drafter.propose(history, 4) == greedy(model.pipeline, history, 4)
    finally:
        drafter.close()
    assert model.resident_bytes() == model.weight_bytes()


def test_speculation_for_a_gateway(tiny_draft: DraftModel) -> None:
    """Each request gets its own drafter and a measured budget that counts drafting."""
    make = speculation(tiny_draft, 6)
    (first, budget), (second, _) = make(), make()
    try:
        assert first is not second
        assert budget.max_k == 6
        drafts = first.propose(PROMPT, budget.k())
        assert first.last_s > 0
        budget.record(len(drafts), 1, 0.0)
        assert budget.state().step_s is None  # one size so far
        assert budget._times[len(drafts)] == pytest.approx(first.last_s)  # drafting counted
    finally:
        first.close()
        second.close()
