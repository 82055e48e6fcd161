"""``hetmesh generate`` end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess


def _hetmesh(*args: str, cache_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "hetmesh", *args]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.model
@pytest.mark.slow
def test_generate_three_stages_prints_what_one_stage_prints(default_model_dir: Path) -> None:
    base = ["generate", "--max-new-tokens", "24", "Once upon a time"]
    three = _hetmesh(*base, "--stages", "3")
    one = _hetmesh(*base, "--stages", "1")
    assert three.returncode == 0, three.stderr
    assert one.returncode == 0, one.stderr
    assert len(three.stdout.split()) >= 10
    assert three.stdout == one.stdout


@pytest.mark.model
@pytest.mark.slow
def test_generate_int4_two_stages_print_what_one_stage_prints(default_model_dir: Path) -> None:
    base = ["generate", "--max-new-tokens", "16", "--weights", "int4", "The capital of France is"]
    two = _hetmesh(*base, "--stages", "2")
    one = _hetmesh(*base, "--stages", "1")
    assert two.returncode == 0, two.stderr
    assert one.returncode == 0, one.stderr
    assert len(two.stdout.split()) >= 5
    assert two.stdout == one.stdout


@pytest.mark.model
@pytest.mark.slow
def test_generate_chat_prints_english(default_model_dir: Path) -> None:
    prompt = "Write one sentence about the sea."
    done = _hetmesh("generate", "--chat", "--max-new-tokens", "48", prompt)
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 5
    letters = sum(c.isascii() and (c.isalpha() or c in " .,'!?-\n") for c in text)
    assert letters / len(text) > 0.9
    common = {"the", "a", "is", "of", "and", "sea", "ocean", "waves", "in", "its", "with"}
    assert common & {w.lower() for w in words}


def _assert_one_line_error(done: subprocess.CompletedProcess[str], needle: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    assert needle in lines[0]


def test_generate_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    import gguf

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-1000])
    cache = tmp_path / "cache"
    cases = [
        (["generate", "hi", "--model", str(tmp_path / "missing")], "not found"),
        (["generate", "hi", "--model", str(gpt2)], "unsupported architecture"),
        (["generate", "hi", "--model", str(cut)], "truncated"),
        (["generate", ""], "empty prompt"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--stages", "0"], "stages"),
        (["generate", "hi", "--weights", "int3"], "unknown weight format"),
    ]
    for args, needle in cases:
        needs_model = needle in ("max_new_tokens", "stages")
        _assert_one_line_error(_hetmesh(*args, cache_dir=None if needs_model else cache), needle)
