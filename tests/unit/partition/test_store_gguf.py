"""A local .gguf is converted once into the cache and served like the original."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import MARKER, resolve_model
from tests.unit.partition.tiny_models import write_tiny_gguf


def test_local_gguf_converts_once_and_matches_transformers(tmp_path: Path) -> None:
    import transformers

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    cache = tmp_path / "cache"
    phases: list[str] = []
    model_dir = resolve_model(gguf_path, cache_dir=cache, progress=lambda p, f: phases.append(p))
    assert model_dir.parent == cache / "models" / "compact2"
    assert model_dir.name.startswith("gguf-")
    assert phases[-1] == "done"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    marker = json.loads((model_dir / MARKER).read_text())
    assert len(marker["gguf_sha256"]) == 64
    assert not list((cache / "tmp").iterdir())

    phases.clear()
    assert resolve_model(gguf_path, cache_dir=cache, progress=lambda p, f: phases.append(p)) == (
        model_dir
    )
    assert "done" not in phases  # served from the cache, not converted again

    pipeline = LocalPipeline.load(model_dir, 2)
    prompt = pipeline.tokenizer.encode(" the the t")
    ours = list(pipeline.generate_ids(prompt, SamplingParams(max_new_tokens=8), eos_ids=set()))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
        )
    assert ours == out[0, len(prompt) :].tolist()
