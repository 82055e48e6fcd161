"""bench/exact.py's pure helpers: the stream mix's bounds, the preemption count, a
mesh's start made again, the serving replica's pick and the freeze runs' keys."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hetmesh.errors import MeshError, RequestTimeout
from hetmesh.scheduler.announcement import ServingAnnouncement, serving_extra, serving_stages

BENCH = Path(__file__).resolve().parents[3] / "bench" / "exact.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_exact", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


exact = _bench()
sys.modules.setdefault("exact", exact)  # exact_freeze imports it by that name
sys.path.insert(0, str(BENCH.parent))
import exact_freeze  # noqa: E402


def test_the_full_mix_spans_the_issues_prompt_and_output_lengths() -> None:
    mix = exact.stream_mix(0, 208, quick=False)
    assert len(mix) == 208
    assert all(8 <= len(p) <= 1000 and 16 <= n <= 200 for p, n in mix)
    assert min(len(p) for p, _ in mix) < 100
    assert max(len(p) for p, _ in mix) > 900
    assert mix == exact.stream_mix(0, 208, quick=False)  # seeded


def test_preemptions_are_summed_over_every_peers_stage_servers() -> None:
    def peer(*preempted: int) -> dict[str, object]:
        state = ServingAnnouncement(
            stage_servers=tuple({"start": 0, "end": 32, "kv_preempted": n} for n in preempted)
        )
        return {"record": {"extra": serving_extra(state), "stages": serving_stages(state)}}

    view = {"peers": [peer(2, 3), peer(), {"record": {}}, peer(4)]}
    assert exact._preemptions(view) == 9


def test_a_start_that_fails_is_made_again_and_each_failure_is_kept() -> None:
    tries: list[int] = []

    def start() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise RequestTimeout("node did not start in 300 s")
        return "mesh"

    failures: list[str] = []
    assert exact.start_with_retries(start, "m", tries=3, retries=failures) == "mesh"
    assert len(tries) == 3
    assert len(failures) == 2
    assert all("did not start" in f for f in failures)


def test_a_start_that_fails_every_time_raises_its_last_error() -> None:
    failures: list[str] = []

    def start() -> str:
        raise MeshError(f"exited {len(failures)}")

    with pytest.raises(MeshError, match="exited 1"):
        exact.start_with_retries(start, "m", tries=2, retries=failures)
    assert failures == ["MeshError('exited 0')"]


def test_an_error_outside_the_tree_is_not_retried() -> None:
    calls: list[int] = []

    def start() -> str:
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        exact.start_with_retries(start, "m", tries=3)
    assert calls == [1]


def test_the_serving_replica_is_the_one_announced_else_a_clear_cpu_lead() -> None:
    pick = exact_freeze.pick_serving
    assert pick({"a": 0.0, "b": 0.0}, ["b"]) == "b"
    assert pick({"a": 0.5, "b": 0.01}, []) == "a"
    assert pick({"a": 0.5, "b": 0.01}, ["a", "b"]) == "a"
    assert pick({"a": 0.04, "b": 0.0}, []) is None  # too little to tell (a starved machine)
    assert pick({"a": 0.3, "b": 0.2}, []) is None  # no clear lead
    assert pick({}, []) is None


def test_the_freeze_key_needs_every_run_frozen_and_every_stream_equal() -> None:
    want = [1, 2, 3]

    def run(frozen: bool, tokens: list[int] = want) -> dict[str, object]:
        return {"tokens": tokens, "frozen": frozen, "recovered": frozen}

    judge = exact_freeze.judge_freezes
    # a run that froze nothing is redone: 2 frozen runs out of 3 made
    keys = judge([run(True), run(False), run(True)], 2, want, want)
    assert keys["freeze_runs_identical"] == 1
    assert keys["freeze_runs_frozen"] == 2
    assert keys["freeze_runs_redone"] == 1
    assert keys["freeze_runs_recovered"] == 2
    # too few frozen runs
    assert judge([run(True), run(False)], 2, want, want)["freeze_runs_identical"] == 0
    # a redone run's stream differs: still a failure
    assert (
        judge([run(True), run(False, [1, 2]), run(True)], 2, want, want)["freeze_runs_identical"]
        == 0
    )
    # the stream alone differs from the rounds': the reference is not exact
    assert judge([run(True), run(True)], 2, want, [1, 2, 4])["freeze_runs_identical"] == 0
    assert judge([], 0, want, want)["freeze_runs_identical"] == 0
