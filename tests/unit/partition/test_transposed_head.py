"""An fp32 LM head stored column-major: same matrix, same bytes, logits within rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hetmesh.partition.stage import TRANSPOSED_HEAD_ENV, load_stage, transposed_head_default
from tests.unit.partition.tiny_models import VOCAB, save_tiny


@pytest.fixture(scope="module", params=["llama-tied", "llama-untied"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"head-{request.param}")
    save_tiny(request.param, folder)
    return folder


def _greedy(stage: torch.nn.Module, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    kv = stage.new_kv()
    x = torch.tensor([1, 5, 9, 2], dtype=torch.int64)
    tokens, logits = [], []
    for _ in range(steps):
        out = stage.forward(x, kv, last_only=True)  # (1, vocab)
        logits.append(out[-1])
        tokens.append(int(out[-1].argmax()))
        x = torch.tensor([tokens[-1]])
    kv.free()
    return tokens, logits


def test_transposed_head_keeps_one_matrix_and_the_greedy_tokens(tiny_dir: Path) -> None:
    # the layout as loaded (exact_linears would pack an untied head: a placeholder weight)
    rows = load_stage(tiny_dir, 0, 6, transpose_head=False, exact_linears=False)
    columns = load_stage(tiny_dir, 0, 6, transpose_head=True, exact_linears=False)
    assert isinstance(columns.lm_head, nn.Linear)
    assert isinstance(rows.lm_head, nn.Linear)
    head = columns.lm_head.weight
    assert head.shape == rows.lm_head.weight.shape == (VOCAB, columns.hidden_size)
    assert head.t().is_contiguous()
    assert not head.is_contiguous()
    assert torch.equal(head, rows.lm_head.weight)  # the same values, laid out by column
    tied = rows.lm_head.weight is rows.embed_tokens.weight  # type: ignore[union-attr]
    assert (head is columns.embed_tokens.weight) is tied  # type: ignore[union-attr]
    assert columns.resident_bytes() == rows.resident_bytes()  # no second copy
    expected_tokens, expected = _greedy(rows, 12)
    got_tokens, got = _greedy(columns, 12)
    assert got_tokens == expected_tokens
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_transposed_head_only_touches_float32_heads(tiny_dir: Path) -> None:
    # exact_linears would prepack an untied bf16 head (a placeholder as its weight)
    bf16 = load_stage(tiny_dir, 0, 6, weights="bfloat16", transpose_head=True, exact_linears=False)
    assert isinstance(bf16.lm_head, nn.Linear)
    assert bf16.lm_head.weight.is_contiguous()
    body = load_stage(tiny_dir, 0, 3, transpose_head=True)  # no head: nothing to do
    assert body.lm_head is None


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_transposed_head_switch_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    if value is None:
        monkeypatch.delenv(TRANSPOSED_HEAD_ENV, raising=False)
    else:
        monkeypatch.setenv(TRANSPOSED_HEAD_ENV, value)
    assert transposed_head_default() is on
