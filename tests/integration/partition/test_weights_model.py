"""The default model in compact weight formats: stages agree, loading stays compact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetmesh.partition.formats import WeightFormat
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import MARKER

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = "The capital of France is"
TOKENS = 16


def _greedy(pipeline: LocalPipeline) -> list[int]:
    ids = pipeline.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=TOKENS)
    return list(pipeline.generate_ids(ids, params, eos_ids=set()))


def test_default_model_folder_is_compact(default_model_dir: Path) -> None:
    marker = json.loads((default_model_dir / MARKER).read_text())
    assert marker["layout"] == "compact"
    weights = sum(f.stat().st_size for f in default_model_dir.glob("*.safetensors"))
    assert weights < 110 * 2**20  # the shipped GGUF is 98 MB; fp32 would be 538 MB


@pytest.fixture(scope="module")
def fp32_tokens(default_model_dir: Path) -> list[int]:
    return _greedy(LocalPipeline.load(default_model_dir, 1))


@pytest.mark.parametrize("fmt", [WeightFormat.BFLOAT16, WeightFormat.INT8, WeightFormat.INT4])
def test_three_stages_equal_one_stage_in_each_format(
    default_model_dir: Path, fmt: WeightFormat, fp32_tokens: list[int]
) -> None:
    one = LocalPipeline.load(default_model_dir, 1, weights=fmt)
    reference = _greedy(one)
    del one
    three = LocalPipeline.load(default_model_dir, 3, weights=fmt)
    assert [s.weights for s in three.stages] == [fmt] * 3
    assert _greedy(three) == reference
    if fmt is not WeightFormat.BFLOAT16:
        # the decoder layers hold the shipped Q4_1 blocks (int4) or int8 rows; the
        # embedding/head table is int8 rows: close to fp32, not equal to it
        assert reference[:4] == fp32_tokens[:4]
    text = three.tokenizer.decode(reference)
    assert sum(c.isalpha() for c in text) > len(text) / 2, text


_PEAK_SCRIPT = """
import ctypes, gc, sys
import torch, transformers, accelerate, safetensors
import transformers.models.llama.modeling_llama
from hetmesh.partition.stage import load_stage

def status(field):  # VmHWM: this process's high-water mark since the last reset
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no " + field)

# One-time costs first: lazy imports, library pages and kernels touched on first use
# (they vary with the machine and with what else runs). A one-layer stage pays them,
# then goes; the high-water mark restarts from what the process holds now.
warm = load_stage(sys.argv[1], 1, 2, weights=sys.argv[2])
del warm
gc.collect()
ctypes.CDLL(None).malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status("VmHWM")
stage = load_stage(sys.argv[1], 1, 31, weights=sys.argv[2])  # every decoder layer
print(status("VmHWM") - before, stage.resident_bytes())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_loading_a_stage_peaks_near_its_resident_bytes(default_model_dir: Path, fmt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(default_model_dir), fmt],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    peak, resident = (int(v) for v in done.stdout.split()[-2:])
    assert resident > 50 * 2**20
    assert peak <= 1.5 * resident, (peak, resident)
