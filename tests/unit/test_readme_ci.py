"""The README's test command is exactly what .ci/run runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ci_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    body = [
        line.strip()
        for line in lines
        if line.strip()
        and not line.startswith("#")
        and not line.startswith("set ")
        and not line.startswith("cd ")
    ]
    assert len(body) == 1, body
    return body[0]


def _readme_bash_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)]


def test_ci_runs_the_readme_test_command() -> None:
    command = _ci_command()
    assert "pytest" in command
    assert command in _readme_bash_blocks()


def test_ci_script_is_strict_bash_and_executable() -> None:
    script = ROOT / ".ci" / "run"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in text
    assert os.access(script, os.X_OK)


def test_readme_main_job_generates_with_the_default_model() -> None:
    blocks = _readme_bash_blocks()
    assert any("hetmesh generate" in block for block in blocks)
    readme = (ROOT / "README.md").read_text()
    for family in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert family in readme
