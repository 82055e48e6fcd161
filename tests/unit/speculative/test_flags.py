"""``--speculative``, ``--speculative-k N``, ``--no-speculative`` and ``--draft`` (and
their config file keys) set how a request entering the node drafts: the measured
budget or a fixed k, prompt lookup or a draft model."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.cli.node import DEFAULT_SPECULATIVE_K, build_node_config
from hetmesh.errors import InvalidRequest
from hetmesh.node.config import check_settings, load_config_file
from hetmesh.speculative.accept import FixedBudget
from hetmesh.speculative.budget import SpeculationBudget
from hetmesh.speculative.choose import gateway_speculation
from hetmesh.speculative.lookup import PromptLookup, speculation


@pytest.mark.parametrize(
    ("settings", "k", "measured"),
    [
        ({}, DEFAULT_SPECULATIVE_K, True),  # on by default: the budget chooses
        ({"speculative": True}, DEFAULT_SPECULATIVE_K, True),
        ({"speculative": False}, 0, False),  # --no-speculative
        ({"speculative_k": 6}, 6, False),  # fixed: for comparisons
        ({"speculative": True, "speculative_k": 2}, 2, False),
        ({"speculative": False, "speculative_k": 6}, 0, False),  # --no-speculative wins
        ({"speculative_k": 0}, 0, False),
    ],
)
def test_flags_set_the_drafts_a_step(settings: dict[str, object], k: int, measured: bool) -> None:
    config = build_node_config(check_settings(settings, source="flags"))
    assert config.serving.speculative_k == k
    assert config.serving.speculative_measured is measured
    assert config.serving.draft == "lookup"


@pytest.mark.parametrize(
    ("given", "draft"),
    [("lookup", "lookup"), ("int4", "int4"), ("INT8", "int8"), ("bf16", "bfloat16")],
)
def test_draft_flag(given: str, draft: str) -> None:
    settings = check_settings({"speculative": True, "draft": given}, source="flags")
    assert build_node_config(settings).serving.draft == draft


@pytest.mark.parametrize("given", ["auto", "int3", "native"])
def test_a_bad_draft_is_refused(given: str) -> None:
    with pytest.raises(InvalidRequest):
        build_node_config(check_settings({"speculative": True, "draft": given}, source="flags"))


def test_the_gateway_gets_the_budget_the_flags_name() -> None:
    assert gateway_speculation(0, measured=True) is None
    fixed, measured = gateway_speculation(3, measured=False), gateway_speculation(8, measured=True)
    assert fixed is not None
    assert measured is not None
    drafter, budget = fixed()
    assert isinstance(drafter, PromptLookup)
    assert isinstance(budget, FixedBudget)
    assert budget.k() == 3
    drafter, budget = measured()
    assert isinstance(drafter, PromptLookup)
    assert isinstance(budget, SpeculationBudget)
    assert budget.max_k == 8
    assert budget.overhead_s is None  # prompt lookup is free


@pytest.mark.parametrize("k", [-1, 33])
def test_a_k_out_of_range_is_refused(k: int) -> None:
    with pytest.raises(InvalidRequest, match="speculative-k"):
        build_node_config(check_settings({"speculative_k": k}, source="flags"))


def test_config_file_keys(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('speculative-k = 3\ndraft = "int4"\n')
    serving = build_node_config(load_config_file(path)).serving
    assert serving.speculative_k == 3
    assert serving.draft == "int4"


def test_speculation_makes_one_drafter_per_request() -> None:
    assert speculation(0) is None
    make = speculation(3)
    assert make is not None
    (first, budget), (second, _) = make(), make()
    assert isinstance(first, PromptLookup)
    assert first is not second  # each request its own history index
    assert budget.k() == 3
