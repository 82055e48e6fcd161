"""Weight formats benchmark: the default model held in each format, against fp32, in one run.

Each format runs in its own fresh process (so its memory is its own), one
torch thread (a node's default), all from the same compact model folder:

- ``resident_bytes``: RSS increase from before ``LocalPipeline.load`` to after
  it and one warm-up generation (one process holding the whole model; the
  tokenizer is loaded after this measure);
- ``disk_bytes``: the model folder's weight files (one compact folder serves
  every format; ``fp32_folder_bytes`` is what the old fp32 folder took);
- ``load_s``; ``ttft_512_s`` (a 512-token prompt to its first token);
- ``decode_tok_s``: median over 10 prompts of 32 greedy tokens;
- ``perplexity`` on ``tests/data/english_prose.txt``;
- ``agreement``: share of the first 32 greedy tokens equal to fp32's, over
  10 fixed prompts (a prompt counts tokens up to its first difference).

Ratios are format ÷ fp32 (``*_resident_ratio``, ``*_decode_ratio``,
``*_ttft_ratio``, ``*_ppl_ratio``). fp32 is the exact dequantisation of the
shipped Q4_1 GGUF, so it is the reference for every format. ``auto_pick``: the
format ``auto``'s rule picks from these decode speeds (``auto_avoids_int8``:
whether that is not int8); ``slower_than_fp32_here``: formats that decoded
slower than fp32 in this run.

Usage: ``python bench/weights.py [--json] [--formats float32,bfloat16,...]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

TEXT = REPO / "tests" / "data" / "english_prose.txt"
FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8", "int4": "int4"}
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The best way to learn a new language is",
    "Water boils at a temperature of",
    "In the year 1969, astronauts",
    "A healthy breakfast usually includes",
    "The main difference between a cat and a dog is",
    "To bake a loaf of bread, you need",
    "The largest planet in our solar system is",
    "My favourite thing about the ocean is",
)
GREEDY_TOKENS = 32
TTFT_TOKENS = 512


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def worker(model_dir: Path, fmt: str) -> dict[str, Any]:
    """Measure one format in this process (see the module docstring)."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  imported before the baseline

    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams

    torch.set_num_threads(1)
    before = _rss_bytes()
    began = time.perf_counter()
    pipeline = LocalPipeline.load(model_dir, 1, weights=fmt)
    load_s = time.perf_counter() - began
    list(pipeline.generate_ids([1, 2, 3], SamplingParams(max_new_tokens=2), eos_ids=set()))
    resident = _rss_bytes() - before  # the model after a forward, before the tokenizer
    tokenizer = pipeline.tokenizer

    text_ids = tokenizer.encode(TEXT.read_text())
    with torch.inference_mode():
        session = pipeline.new_session(SamplingParams(max_new_tokens=1))
        logits = pipeline.forward(torch.tensor(text_ids), session.kvs).float()  # (n, vocab)
        session.free()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text_ids[1:]))
    perplexity = float(torch.exp(nll))

    long_ids = (text_ids * (TTFT_TOKENS // len(text_ids) + 1))[:TTFT_TOKENS]
    ttfts = []
    for _ in range(2):
        began = time.perf_counter()
        list(pipeline.generate_ids(long_ids, SamplingParams(max_new_tokens=1), eos_ids=set()))
        ttfts.append(time.perf_counter() - began)

    greedy: list[list[int]] = []
    tpots: list[float] = []
    for prompt in PROMPTS:
        stamps, tokens = [], []
        ids = tokenizer.encode(prompt)
        for token in pipeline.generate_ids(
            ids, SamplingParams(max_new_tokens=GREEDY_TOKENS), eos_ids=set()
        ):
            stamps.append(time.perf_counter())
            tokens.append(token)
        greedy.append(tokens)
        tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {
        "format": fmt,
        "resident_bytes": resident,
        "pipeline_tensor_bytes": pipeline.resident_bytes(),
        "load_s": load_s,
        "ttft_512_s": min(ttfts),
        "decode_tok_s": 1.0 / statistics.median(tpots),
        "perplexity": perplexity,
        "text_tokens": len(text_ids),
        "greedy": greedy,
    }


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of greedy tokens equal to the reference's up to each prompt's first difference."""
    same = 0
    for ours, ref in zip(tokens, reference, strict=True):
        for a, b in zip(ours, ref, strict=False):
            if a != b:
                break
            same += 1
    return same / sum(len(r) for r in reference)


def run(formats: list[str]) -> dict[str, Any]:
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir, resolve_model

    model_dir = resolve_model()
    disk = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    params = model_profile(check_model_dir(model_dir)).total_param_count
    per_format: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", fmt, "--model-dir", str(model_dir)],
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"{fmt} worker failed:\n{done.stderr[-2000:]}")
        per_format[fmt] = json.loads(done.stdout.strip().splitlines()[-1])
    result: dict[str, Any] = {
        "model_dir": str(model_dir),
        "disk_bytes": disk,
        "fp32_folder_bytes": params * 4,
        "torch_threads": 1,
    }
    ref = per_format.get("float32")
    for fmt, got in per_format.items():
        key = SHORT[fmt]
        result[f"{key}_resident_bytes"] = got["resident_bytes"]
        result[f"{key}_tensor_bytes"] = got["pipeline_tensor_bytes"]
        result[f"{key}_disk_bytes"] = disk
        result[f"{key}_load_s"] = round(got["load_s"], 3)
        result[f"{key}_ttft_512_s"] = round(got["ttft_512_s"], 3)
        result[f"{key}_decode_tok_s"] = round(got["decode_tok_s"], 2)
        result[f"{key}_perplexity"] = round(got["perplexity"], 3)
        if ref is not None and fmt != "float32":
            result[f"{key}_resident_ratio"] = round(
                got["resident_bytes"] / ref["resident_bytes"], 3
            )
            result[f"{key}_decode_ratio"] = round(got["decode_tok_s"] / ref["decode_tok_s"], 3)
            result[f"{key}_ttft_ratio"] = round(got["ttft_512_s"] / ref["ttft_512_s"], 3)
            result[f"{key}_ppl_ratio"] = round(got["perplexity"] / ref["perplexity"], 4)
            result[f"{key}_greedy_agreement"] = round(_agreement(got["greedy"], ref["greedy"]), 3)
    result.update(_auto_pick(per_format))
    return result


def _auto_pick(per_format: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What ``auto``'s rule (:func:`hetmesh.node.weights.choose_weights`) picks from these
    decode speeds, every format fitting (a node times one block instead; same rule)."""
    from hetmesh.node.weights import choose_weights

    steps = {f: 1.0 / got["decode_tok_s"] for f, got in per_format.items()}
    pick, _ = choose_weights(list(steps), lambda _f: True, steps.get)
    slower = sorted(SHORT[f] for f in steps if "float32" in steps and steps[f] > steps["float32"])
    return {
        "auto_pick": pick,
        "auto_avoids_int8": pick != "int8",
        "slower_than_fp32_here": slower,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(Path(args.model_dir), args.worker)))
        return
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {FORMATS}")
    result = run(formats)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        print(f"{key:32} {value}")


if __name__ == "__main__":
    main()
