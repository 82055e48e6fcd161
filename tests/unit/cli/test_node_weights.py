"""The --weights setting: flag over environment over file, checked at start, documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetmesh.cli.node import build_node_config
from hetmesh.errors import InvalidRequest
from hetmesh.node.config import load_config_file, merge


def test_the_weights_setting_flag_over_environment_over_file(monkeypatch, tmp_path: Path) -> None:
    from hetmesh.cli import app

    seen = {}
    monkeypatch.setattr("hetmesh.cli.node.trio.run", lambda _f, config: seen.update(c=config))
    f = tmp_path / "n.toml"
    f.write_text('weights = "int8"\n')
    runner = CliRunner()

    def weights(*args: str, env: dict[str, str] | None = None) -> str:
        result = runner.invoke(app, ["node", "start", "--config", str(f), *args], env=env)
        assert result.exit_code == 0, result.output
        return seen["c"].serving.weights

    assert weights() == "int8"
    assert weights(env={"HETMESH_WEIGHTS": "bf16"}) == "bfloat16"
    assert weights("--weights", "auto", env={"HETMESH_WEIGHTS": "int8"}) == "auto"
    assert (
        build_node_config({}).serving.weights == "native"
    )  # the default: the checkpoint's own format
    file = load_config_file(f)
    assert build_node_config(merge({"weights": "int4"}, file)).serving.weights == "int4"


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"weights": "int3"}, "unknown weight format 'int3'.*int8"),
        ({"weights": "int4", "device": "mps"}, "--weights int4 on mps"),
    ],
)
def test_a_format_the_node_cannot_run_is_refused_at_start(settings, match) -> None:
    with pytest.raises(InvalidRequest, match=match):
        build_node_config(settings)


def test_start_help_says_which_formats_are_slower_and_when_auto_picks_them() -> None:
    from hetmesh.cli import app

    result = CliRunner().invoke(app, ["node", "start", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.replace("│", " ").split())
    from hetmesh.partition.formats import SLOWER_THAN_FP32_ON_CPU

    assert "Slower than float32 on a CPU" in text
    for fmt in SLOWER_THAN_FP32_ON_CPU:
        assert fmt.value in text.split("Slower than float32 on a CPU")[1].split(";")[0]
    assert "no float format fits" in text
    assert "mixing formats" in text
