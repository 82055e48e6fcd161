"""The KV pool size a user sets (flag, environment, TOML) and the default that admits by use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.cli.node import build_node_config
from hetmesh.errors import InvalidRequest, Rejected
from hetmesh.node.config import PLANNED_SESSIONS, load_config_file
from hetmesh.node.kvcache import KVManager, stage_kv_limits
from hetmesh.partition.kv import KVPool, SessionKV


def limits(**overrides):
    settings = {
        "max_context_tokens": 2048,
        "max_sessions": None,
        "planned_sessions": PLANNED_SESSIONS,
        "pool_tokens": None,
        "kv_bytes_per_token": 100,
        "idle_timeout_s": 60.0,
    }
    settings.update(overrides)
    return stage_kv_limits(**settings)


@pytest.mark.parametrize(
    ("overrides", "sessions", "budget_tokens"),
    [
        # default: the planner's budget of 8 full-context sessions, no count cap but the blocks
        ({}, 2048 * 8 // 16, 2048 * 8),
        # an explicit --max-sessions caps the count and sizes the budget, as before
        ({"max_sessions": 3}, 3, 2048 * 3),
        # an explicit pool size wins over the budget; the cap stays where it was set
        ({"pool_tokens": 1000}, 63, 1000),
        ({"pool_tokens": 1000, "max_sessions": 2}, 2, 1000),
    ],
)
def test_stage_kv_limits_size_the_pool_and_cap(overrides, sessions, budget_tokens):
    got = limits(**overrides)
    assert got.max_sessions == sessions
    assert got.budget_bytes == budget_tokens * 100
    assert got.max_tokens_per_session == 2048


def test_the_default_admits_more_short_sessions_than_the_planned_count():
    got = limits(max_context_tokens=512)  # 8 x 512 tokens = 256 blocks
    pool = KVPool(
        num_blocks=got.budget_bytes // (16 * 100),
        num_layers=1,
        kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    manager = KVManager(
        got, pool=pool, factory=lambda: SessionKV(owner=0, pool=pool, max_length=512)
    )
    opened = 0
    while True:  # sessions of a 20-token prompt (2 blocks each) until the pool is full
        try:
            manager.open(f"s{opened}", 512, prompt_tokens=20)
        except Rejected:
            break
        opened += 1
    assert opened > 4 * PLANNED_SESSIONS
    assert pool.free_blocks < 2 + manager.reserve_blocks


def test_the_pool_size_comes_from_flag_file_or_environment(monkeypatch, tmp_path: Path):
    from typer.testing import CliRunner

    from hetmesh.cli import app

    f = tmp_path / "node.toml"
    f.write_text("kv-pool-tokens = 4096\n")
    config = build_node_config(load_config_file(f))
    assert config.serving.kv_pool_tokens == 4096
    assert config.serving.max_sessions is None
    assert build_node_config({}).serving.kv_pool_tokens is None

    seen = {}
    monkeypatch.setattr("hetmesh.cli.node.trio.run", lambda func, config: seen.update(c=config))
    monkeypatch.setenv("HETMESH_KV_POOL_TOKENS", "777")
    result = CliRunner().invoke(app, ["node", "start", "--config", str(f)])
    assert result.exit_code == 0, result.output
    assert seen["c"].serving.kv_pool_tokens == 777  # environment over the file
    result = CliRunner().invoke(app, ["node", "start", "--kv-pool-tokens", "96"])
    assert result.exit_code == 0, result.output
    assert seen["c"].serving.kv_pool_tokens == 96  # the flag over the environment


def test_a_pool_of_no_tokens_is_refused():
    with pytest.raises(InvalidRequest, match="kv-pool-tokens must be at least 1"):
        build_node_config({"kv_pool_tokens": 0})


def test_the_prefix_cache_is_on_unless_turned_off(tmp_path: Path):
    assert build_node_config({}).serving.prefix_cache is True
    f = tmp_path / "node.toml"
    f.write_text("prefix-cache = false\n")
    assert build_node_config(load_config_file(f)).serving.prefix_cache is False
