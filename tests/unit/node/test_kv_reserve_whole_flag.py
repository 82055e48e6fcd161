"""The hidden ``--kv-reserve-whole`` flag that keeps the old admission for bench/kv.py."""

from __future__ import annotations

from typing import Any

import pytest

from hetmesh.cli.node import build_node_config


def test_reserve_whole_is_off_unless_asked() -> None:
    assert build_node_config({}).serving.kv_reserve_whole is False
    assert build_node_config({"kv_reserve_whole": True}).serving.kv_reserve_whole is True


def test_reserve_whole_flag_reaches_the_serving_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from hetmesh.cli import app

    seen: dict[str, Any] = {}
    monkeypatch.setattr("hetmesh.cli.node.trio.run", lambda func, config: seen.update(c=config))
    result = CliRunner().invoke(app, ["node", "start", "--kv-reserve-whole"])
    assert result.exit_code == 0, result.output
    assert seen["c"].serving.kv_reserve_whole is True
    help_text = CliRunner().invoke(app, ["node", "start", "--help"]).output
    assert "--kv-reserve-whole" not in help_text  # hidden: a benchmark's switch
