"""bench/speculative.py's pure parts: the replay of a stream through a drafter, rates,
the gateway's counters read from a status view, the arms' order."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "speculative.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_speculative", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


class Oracle:
    """Drafts the true continuation of ``stream``, wrong from its ``wrong_at``-th token."""

    def __init__(self, prompt: Sequence[int], stream: Sequence[int], wrong_at: int) -> None:
        self.full = [*prompt, *stream]
        self.prompt = len(prompt)
        self.wrong_at = wrong_at

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        assert list(history) == self.full[: len(history)]  # only the stream's own history
        out = self.full[len(history) : len(history) + k]
        return [
            t + 1000 if len(history) + i >= self.prompt + self.wrong_at else t
            for i, t in enumerate(out)
        ]


def test_replay_counts_steps_and_kept_drafts() -> None:
    prompt, stream = [1, 2, 3], list(range(10, 22))  # 12 tokens
    perfect = bench.replay(prompt, stream, Oracle(prompt, stream, 99), 3)
    assert perfect == {"steps": 3, "drafted": 3 + 3 + 3, "accepted": 9, "tokens": 12}
    # drafts right for the first 5 tokens: a step of 4 (3 kept), one of 2 (1 kept, its
    # second draft wrong), then one token a step for the last 6
    half = bench.replay(prompt, stream, Oracle(prompt, stream, 5), 3)
    # (the oracle knows only the stream: 2 and 1 drafts at its last two tokens)
    assert half == {"steps": 2 + 6, "drafted": 8 * 3 - 3, "accepted": 4, "tokens": 12}


def test_replay_without_drafts_is_plain() -> None:
    class Nothing:
        def propose(self, history: Sequence[int], k: int) -> list[int]:
            return []

    assert bench.replay([1], [5, 6, 7], Nothing(), 4) == {
        "steps": 3,
        "drafted": 0,
        "accepted": 0,
        "tokens": 3,
    }


def test_rates() -> None:
    assert bench.decode_rate([0.5, 1.0, 1.5]) == pytest.approx(2.0)
    assert bench.decode_rate([0.5]) is None
    gens = [{"times_s": [0, 1, 2]}, {"times_s": [0, 0.5, 1.0]}, {"times_s": [3]}]
    assert bench.median_rate(gens) == pytest.approx(1.5)
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None
    assert bench.ratio(1.0, 0.0) is None


def test_counters_from_a_status_view() -> None:
    gw = {"verify_steps": 4, "drafted": 16, "accepted": 12, "verified_tokens": 16}
    view = {"peers": [{"record": {"gateway": gw}}, {"record": {"gateway": dict(gw)}}], "x": [1]}
    found = bench.counters_of(view)
    assert found == {"verify_steps": 8, "drafted": 32, "accepted": 24, "verified_tokens": 32}
    delta = bench.counters_delta(dict.fromkeys(bench.COUNTERS, 0), found)
    assert delta["tokens_per_verify_step"] == 4.0
    assert delta["acceptance"] == 0.75
    assert bench.counters_delta(found, found)["tokens_per_verify_step"] is None


def test_arm_order_alternates() -> None:
    assert bench.arm_order(["off", "on"], 1) == ["off", "on"]
    assert bench.arm_order(["off", "on"], 2) == ["off", "on", "on", "off"]


def test_arms_are_node_flags() -> None:
    assert bench.arm_args("off", "4") == ["--no-speculative"]
    assert bench.arm_args("lookup", "4") == ["--speculative-k", "4"]
    assert bench.arm_args("lookup_measured", "4") == ["--speculative"]
    assert bench.arm_args("draft", "4") == ["--speculative", "--draft", "int4"]
    assert bench.arm_args("draft_fixed", "6") == ["--speculative-k", "6", "--draft", "int4"]


def test_the_flags_are_the_nodes() -> None:
    """Every arm's flags parse into the node config the arm means."""
    from hetmesh.cli.node import DEFAULT_SPECULATIVE_K, build_node_config
    from hetmesh.node.config import check_settings

    assert bench.MEASURED_MAX_K == DEFAULT_SPECULATIVE_K
    want = {
        "off": (0, False, "lookup"),
        "default": (8, True, "lookup"),  # on by default: as --speculative
        "lookup": (4, False, "lookup"),
        "lookup_measured": (8, True, "lookup"),
        "draft": (8, True, "int4"),
        "draft_fixed": (4, False, "int4"),
    }
    for arm, (k, measured, draft) in want.items():
        flags = bench.arm_args(arm, "4")
        settings: dict[str, object] = {}
        i = 0
        while i < len(flags):
            name = flags[i].removeprefix("--").replace("-", "_")
            if name.startswith("no_"):
                settings[name[3:]] = False
                i += 1
            elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                value = flags[i + 1]
                settings[name] = int(value) if value.isdigit() else value
                i += 2
            else:
                settings[name] = True
                i += 1
        serving = build_node_config(check_settings(settings, source="flags")).serving
        assert (serving.speculative_k, serving.speculative_measured, serving.draft) == (
            k,
            measured,
            draft,
        ), arm
