"""A verify step's rows are plain decoding's, bit for bit, on the default model cut in
three stages (issue 48): a chunk of the last token and its drafts gives each row the
logits that decoding those tokens one step at a time gives, in int4 and float32, and
after a rejected tail is dropped (``SessionKV.truncate``) the next step's rows still do.
Greedy output with drafts is then the output without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition.formats import WeightFormat
from hetmesh.partition.generate import balanced_ranges
from hetmesh.partition.kv import SessionKV
from hetmesh.partition.profile import model_profile
from hetmesh.partition.stage import StageModule, load_stage
from hetmesh.partition.store import check_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT_TOKENS, STEPS = 40, 10


def _through(stages: list[StageModule], kvs: list[SessionKV], ids: list[int]) -> torch.Tensor:
    """The head's logits of every row of ``ids`` fed through the cut, ``(n, vocab)``."""
    x: torch.Tensor = torch.tensor(ids, dtype=torch.int64)
    for stage, kv in zip(stages, kvs, strict=True):
        x = stage.forward(x, kv)
    return x


@pytest.mark.parametrize("fmt", [WeightFormat.INT4, WeightFormat.FLOAT32], ids=str)
def test_verify_rows_equal_plain_decoding_rows(default_model_dir: Path, fmt: WeightFormat) -> None:
    profile = model_profile(check_model_dir(default_model_dir))
    stages = [
        load_stage(default_model_dir, a, b, weights=fmt) for a, b in balanced_ranges(profile, 3)
    ]
    prompt = torch.randint(
        4, stages[0].vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5)
    ).tolist()

    plain_kv = [s.new_kv() for s in stages]
    rows = [_through(stages, plain_kv, prompt)[-1]]
    tokens = [int(rows[-1].argmax())]
    for _ in range(STEPS):
        rows.append(_through(stages, plain_kv, tokens[-1:])[0])
        tokens.append(int(rows[-1].argmax()))

    kvs = [s.new_kv() for s in stages]
    _through(stages, kvs, prompt)
    # step 1: the first token and four drafts, the last of them wrong
    wrong = (tokens[4] + 1) % stages[0].vocab_size
    verify = _through(stages, kvs, [tokens[0], *tokens[1:4], wrong])
    for i in range(4):  # rows whose inputs are plain decoding's
        assert torch.equal(verify[i], rows[1 + i]), (fmt, i)
    assert not torch.equal(verify[4], rows[5])  # a wrong input changes its row: it can fail
    # three drafts kept and the target's own token (row 3's): drop the wrong draft's KV
    kept = PROMPT_TOKENS + 4
    for kv in kvs:
        kv.truncate(kept)
    # step 2: the target's token and two right drafts, after the dropped tail
    verify = _through(stages, kvs, tokens[4:7])
    for i in range(3):
        assert torch.equal(verify[i], rows[5 + i]), (fmt, "after the rollback", i)
    assert all(kv.length == kept + 3 for kv in kvs)
