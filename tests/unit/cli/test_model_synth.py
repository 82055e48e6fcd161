"""``hetmesh model synth`` and synth names given to commands that take ``--model``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetmesh.cli import app
from hetmesh.errors import InvalidRequest, ModelNotFound
from hetmesh.partition.store import gguf_architecture
from hetmesh.scheduler.synthetic import random_mesh
from tests.unit.partition.synth_cache import synth_cache


@pytest.fixture
def cache(tmp_path: Path, default_model_dir: Path) -> Path:
    return synth_cache(tmp_path, default_model_dir)


@pytest.mark.model
def test_synth_writes_into_the_cache_and_prints_the_name(cache: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["model", "synth", "--shape", "synth-tiny", "--cache-dir", str(cache)]
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "synth-tiny"
    assert (cache / "models" / "compact2" / "synth-tiny" / "model.safetensors").is_file()
    args = ["--format", "bf16", "--seed", "3", "--cache-dir", str(cache)]
    result = runner.invoke(app, ["model", "synth", "--shape", "synth-tiny-qwen2", *args])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "synth-tiny-qwen2-bf16-seed3"
    config = json.loads(
        (cache / "models/compact2/synth-tiny-qwen2-bf16-seed3/config.json").read_text()
    )
    assert config["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.model
def test_synth_writes_a_gguf_file_and_never_over_an_existing_one(
    cache: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    target = tmp_path / "tiny.gguf"
    args = [
        "model",
        "synth",
        "--shape",
        "synth-tiny",
        "--gguf",
        str(target),
        "--cache-dir",
        str(cache),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert gguf_architecture(target) == "LlamaForCausalLM"
    assert not target.with_name("tiny.gguf.partial").exists()
    size = target.stat().st_size
    result = runner.invoke(app, args)
    assert isinstance(result.exception, InvalidRequest)
    assert "exists" in str(result.exception)
    assert target.stat().st_size == size


@pytest.mark.parametrize(
    ("args", "error", "text"),
    [
        (["--shape", "synth-llama-70b"], ModelNotFound, "synth-llama-3.2-1b"),
        (["--shape", "synth-tiny", "--format", "q4_k"], InvalidRequest, "q4_1, q8_0 or bf16"),
    ],
)
def test_synth_refuses_unknown_shapes_and_formats(
    args: list[str], error: type[Exception], text: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(app, ["model", "synth", *args, "--cache-dir", str(tmp_path)])
    assert isinstance(result.exception, error)
    assert text in str(result.exception)
    assert not (tmp_path / "models").exists()  # refused before anything is fetched


def test_synth_help_says_its_text_is_noise() -> None:
    result = CliRunner().invoke(app, ["model", "synth", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "noise" in result.output
    for shape in (
        "synth-llama-3.2-1b",
        "synth-llama-3.2-3b",
        "synth-llama-3.1-8b",
        "synth-qwen2.5-7b",
    ):
        assert shape in result.output


@pytest.mark.model
@pytest.mark.slow
def test_generate_takes_a_synth_name_written_on_first_use(cache: Path) -> None:
    args = ["generate", "--model", "synth-tiny", "--cache-dir", str(cache), "--stages", "2"]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "4", "Hello there"])
    assert result.exit_code == 0, result.output
    assert result.output.strip()
    assert (cache / "models" / "compact2" / "synth-tiny" / "hetmesh-model.json").is_file()


def test_plan_takes_a_synth_name_in_its_own_format_without_writing_it(tmp_path: Path) -> None:
    devs, links = random_mesh(random.Random(4), 4, classes=("consumer-gpu", "datacenter-gpu"))
    mesh = tmp_path / "mesh.json"
    mesh.write_text(
        json.dumps({"devices": [d.to_wire() for d in devs], "links": [x.to_wire() for x in links]})
    )
    for name, stored in (("synth-llama-3.1-8b", "bfloat16"), ("synth-qwen2.5-7b-bf16", "bfloat16")):
        result = CliRunner().invoke(
            app, ["plan", "--model", name, "--devices", str(mesh), "--json"]
        )
        assert result.exit_code == 0, result.output
        stages = json.loads(result.output)["plan"]["pipelines"][0]["stages"]
        assert stages[-1]["end"] == {"synth-llama-3.1-8b": 34, "synth-qwen2.5-7b-bf16": 30}[name]
        assert {s["weights"] for s in stages} == {stored}  # Q4_1 on a GPU: bf16, as nodes do
