"""The calibration measurement runs the real stage code on one block."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.errors import ModelNotFound
from hetmesh.node.calibration import (
    host_share,
    measure_block_step_s,
    measure_chunk_cost,
    measure_row_cost,
)
from hetmesh.scheduler.announcement import MAX_CHUNK_COST
from tests.unit.partition.tiny_models import save_tiny


def test_block_step_is_measured_on_a_tiny_model(tmp_path: Path) -> None:
    save_tiny("llama-tied", tmp_path)
    step = measure_block_step_s(tmp_path, budget_s=0.1, window_s=0.03)
    assert 0 < step < 0.05  # one 64-wide block: well under 50 ms a step


def test_a_missing_model_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        measure_block_step_s(tmp_path / "absent", budget_s=0.05)


def test_chunk_cost_is_measured_on_a_tiny_model(tmp_path: Path) -> None:
    save_tiny("llama-tied", tmp_path)
    cost = measure_chunk_cost(tmp_path, repeats=1)
    # chunks never do less work than the whole; a tiny block is all overhead, so
    # they may cost several times as much, but a bounded figure peers accept
    assert 0.5 < cost < MAX_CHUNK_COST


def test_row_cost_is_measured_on_a_tiny_model(tmp_path: Path) -> None:
    save_tiny("llama-tied", tmp_path)
    cost = measure_row_cost(tmp_path, repeats=3)
    assert cost >= 0.0
    # the round of four shares its weights' reads: far below four rounds (clamped at 1)
    assert cost < 1.0
    with pytest.raises(ValueError, match="rows"):
        measure_row_cost(tmp_path, rows=1)


def test_host_share_names_this_machine_and_its_cores() -> None:
    key, cores, share = host_share(1)
    assert (key, cores) == host_share(1)[:2]  # the same process, the same key
    assert len(key) == 32
    assert int(key, 16) >= 0
    assert cores >= 1
    assert 0 < share <= min(1.0, cores)
    assert host_share(10_000)[2] <= cores  # never more than the cores it may run on
