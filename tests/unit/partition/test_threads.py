"""The decode thread chooser: its choices from given timings (pure), and a stage whose
thread count it changes computing the same logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition.stage import load_stage
from hetmesh.partition.threads import ADAPTIVE_ENV, ThreadChooser, adaptive_default
from tests.unit.partition.tiny_models import VOCAB, save_tiny


class _Recording(ThreadChooser):
    """A chooser that keeps the count of every forward recorded."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.recorded: list[int] = []

    def record(self, count: int, seconds_per_row: float) -> None:
        self.recorded.append(count)
        super().record(count, seconds_per_row)


def _serve(chooser: ThreadChooser, cap: int, forwards: int, cost: dict[int, float]) -> list[int]:
    """The counts ``forwards`` decode forwards ran at, each taking ``cost[count]`` per row."""
    counts = []
    for _ in range(forwards):
        count = chooser.count(cap)
        counts.append(count)
        chooser.record(count, cost[count])
    return counts


def test_one_thread_is_kept_where_it_measures_faster() -> None:
    chooser = ThreadChooser(probe=2, first_period=32, max_period=128)
    close = {1: 0.03, 2: 0.04}  # within CLEAR of each other: the whole probe, alternated
    assert _serve(chooser, 2, 4, close) == [2, 1, 2, 1]
    assert chooser.choice == 1
    assert _serve(chooser, 2, 32, close) == [1] * 32  # the period at the choice
    # the next probe starts from the standing choice; the choice holds: the period doubles
    assert _serve(chooser, 2, 4, close) == [1, 2, 1, 2]
    assert chooser.choice == 1
    assert chooser.period == 64
    assert _serve(chooser, 2, 65, close) == [1] * 64 + [1]  # then the next probe


def test_the_callers_count_comes_back_when_it_turns_faster() -> None:
    chooser = ThreadChooser(probe=2, first_period=32, max_period=64)
    clear = {1: 0.03, 2: 0.5}  # a clear gap ends a probe after one forward each
    assert _serve(chooser, 2, 2, clear) == [2, 1]
    assert chooser.choice == 1
    # the wait is what the budget affords: 0.5 / (BUDGET * 0.03) forwards
    assert _serve(chooser, 2, 334, clear) == [1] * 334
    # the machine quietens: the next probe measures two threads faster
    counts = _serve(chooser, 2, 4 + 32, {1: 0.03, 2: 0.02})
    assert counts[:4] == [1, 2, 1, 2]
    assert chooser.choice == 2
    assert chooser.period == 32  # short again after a change
    assert counts[4:] == [2] * 32


def test_a_costly_loser_is_probed_no_more_than_the_budget_allows() -> None:
    chooser = ThreadChooser(probe=2, first_period=4, max_period=16)
    assert _serve(chooser, 2, 2, {1: 0.03, 2: 1.5}) == [2, 1]
    assert chooser.choice == 1
    # the next probe's 1.5 s is BUDGET of the forwards before it: 1.5 / (0.05 * 0.03)
    waited = _serve(chooser, 2, 1001, {1: 0.03, 2: 1.5})
    assert waited == [1] * 1000 + [1]  # the 1001st: the probe, from the standing choice
    assert chooser.count(2) == 2  # then the other count, once


def test_a_new_caller_count_probes_again_and_one_thread_is_left_alone() -> None:
    chooser = ThreadChooser(probe=1, first_period=4)
    _serve(chooser, 2, 2, {1: 0.03, 2: 0.5})
    assert chooser.choice == 1
    assert _serve(chooser, 4, 2, {1: 0.5, 4: 0.01}) == [4, 1]
    assert chooser.choice == 4
    assert _serve(chooser, 1, 3, {1: 0.01}) == [1, 1, 1]
    with pytest.raises(ValueError, match="probe"):
        ThreadChooser(probe=0)


def test_a_forward_that_failed_is_not_counted() -> None:
    chooser = ThreadChooser(probe=1, first_period=4)
    assert chooser.count(2) == 2  # this forward raised: no record
    chooser.record(1, 0.01)  # not the count the probe asked for: ignored
    assert chooser.count(2) == 2
    chooser.record(2, 0.5)
    assert chooser.count(2) == 1
    chooser.record(1, 0.01)
    assert chooser.choice == 1


def test_switch_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    save_tiny("llama-tied", tmp_path)
    monkeypatch.setenv(ADAPTIVE_ENV, "0")
    assert not adaptive_default()
    assert load_stage(tmp_path, 0, 6, weights="int4").threads is None
    monkeypatch.delenv(ADAPTIVE_ENV)
    assert load_stage(tmp_path, 0, 6, weights="int4").threads is not None
    assert load_stage(tmp_path, 0, 6, weights="float32").threads is None  # BLAS may split sums


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stage_logits_do_not_depend_on_the_thread_count(tmp_path: Path, fmt: str) -> None:
    save_tiny("llama-untied", tmp_path)
    stage = load_stage(tmp_path, 0, 6, weights=fmt)
    assert stage.threads is not None
    prompt = torch.randint(4, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    caller = torch.get_num_threads()
    runs = []
    try:
        chooser = _Recording(probe=2, first_period=1)
        for threads, adaptive in ((1, None), (2, chooser)):
            torch.set_num_threads(threads)
            stage.threads = adaptive
            kv = stage.new_kv()
            outs = [stage.forward(prompt, kv)]
            for _ in range(10):
                outs.append(stage.forward(torch.tensor([int(outs[-1][-1].argmax())]), kv))
                assert torch.get_num_threads() == threads  # the caller's count, restored
            runs.append(outs)
        # the chooser ran decode forwards at 1 and at 2 threads (its probes)
        assert set(chooser.recorded) == {1, 2}
        assert len(chooser.recorded) == 10
    finally:
        torch.set_num_threads(caller)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
