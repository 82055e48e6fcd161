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
    chooser = ThreadChooser(probe=2, first_period=4, max_period=16)
    close = {1: 0.03, 2: 0.04}  # within CLEAR of each other: the whole probe, alternated
    assert _serve(chooser, 2, 4, close) == [2, 1, 2, 1]
    assert chooser.choice == 1
    assert _serve(chooser, 2, 4, close) == [1] * 4  # the period at the choice
    # the next probe starts from the standing choice; a clear gap ends it after one each,
    # and the choice holds, so the period doubles
    clear = {1: 0.03, 2: 0.5}
    assert _serve(chooser, 2, 2, clear) == [1, 2]
    assert chooser.choice == 1
    assert chooser.period == 8
    assert _serve(chooser, 2, 8, clear) == [1] * 8


def test_the_callers_count_comes_back_when_it_turns_faster() -> None:
    chooser = ThreadChooser(probe=2, first_period=4, max_period=8)
    counts = _serve(chooser, 2, 2 + 4 + 2 + 8, {1: 0.03, 2: 0.5})
    assert counts == [2, 1] + [1] * 4 + [1, 2] + [1] * 8  # probes end after one each
    assert chooser.choice == 1
    assert chooser.period == 8  # capped at max_period
    # the machine quietens: the next probe measures two threads faster
    counts = _serve(chooser, 2, 4 + 4, {1: 0.03, 2: 0.02})
    assert counts[:4] == [1, 2, 1, 2]
    assert chooser.choice == 2
    assert chooser.period == 4  # short again after a change
    assert counts[4:] == [2] * 4


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
