"""bench/exact.py's pure helpers: the stream mix's bounds and the preemption count."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

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
