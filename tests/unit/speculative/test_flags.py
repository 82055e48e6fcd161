"""``--speculative``, ``--speculative-k N`` and ``--no-speculative`` (and their config
file keys) set how many drafts a request entering the node sends a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.cli.node import DEFAULT_SPECULATIVE_K, build_node_config
from hetmesh.errors import InvalidRequest
from hetmesh.node.config import check_settings, load_config_file
from hetmesh.speculative.lookup import PromptLookup, speculation


@pytest.mark.parametrize(
    ("settings", "k"),
    [
        ({}, 0),  # off by default
        ({"speculative": True}, DEFAULT_SPECULATIVE_K),
        ({"speculative_k": 6}, 6),
        ({"speculative": True, "speculative_k": 2}, 2),
        ({"speculative": False, "speculative_k": 6}, 0),  # --no-speculative wins
        ({"speculative_k": 0}, 0),
    ],
)
def test_flags_set_the_drafts_a_step(settings: dict[str, object], k: int) -> None:
    config = build_node_config(check_settings(settings, source="flags"))
    assert config.serving.speculative_k == k


@pytest.mark.parametrize("k", [-1, 33])
def test_a_k_out_of_range_is_refused(k: int) -> None:
    with pytest.raises(InvalidRequest, match="speculative-k"):
        build_node_config(check_settings({"speculative_k": k}, source="flags"))


def test_config_file_keys(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("speculative-k = 3\n")
    assert build_node_config(load_config_file(path)).serving.speculative_k == 3


def test_speculation_makes_one_drafter_per_request() -> None:
    assert speculation(0) is None
    make = speculation(3)
    assert make is not None
    (first, budget), (second, _) = make(), make()
    assert isinstance(first, PromptLookup)
    assert first is not second  # each request its own history index
    assert budget.k() == 3
