"""Single-process decode: today's path against the old one, measured in the same run.

One process, one stage holding the whole default model, greedy decoding
through :class:`~hetmesh.partition.generate.LocalPipeline`, the same torch
thread count for every path. The paths are loaded side by side and decode in
lockstep, one step of each in turn (so load on a shared machine hurts all
alike); a path's figure is its mean decode-step time, median over repeats:

- ``old``: fp32, a separate matrix product per projection (``fuse=False``),
  the LM head row-major (``transpose_head=False``), transformers' own decoder
  layers (no lean layers): the single process before issue 16.
- ``default``: today's default, what ``hetmesh generate`` and a node load
  without ``--weights``: ``native``, the checkpoint's own format (the default
  model's Q4_1 levels as int4 in torch's int4 kernel, perplexity 0.997x fp32,
  docs/weights.md); ``--weights`` names another; fused only with ``--fuse``
  (fusion is off by default: not measured faster here).
- ``float32``: fp32 as :func:`~hetmesh.partition.stage.load_stage` loads it
  today (the head stored column-major; logits within ~2e-6, so its greedy
  tokens are compared with ``old``'s on every run and reported, not assumed).
- ``default_eager``: ``default`` with transformers' decoder layers instead of
  the lean ones (:mod:`hetmesh.partition.lean`, issue 47): bit-identical
  logits, its greedy tokens checked equal to ``default``'s on every run.
- ``default_layers``: ``default`` without :func:`~hetmesh.partition.lean.lean_decode`
  (a lone decode token through the lean layers of a prefill instead): bit-identical
  logits, its greedy tokens checked equal to ``default``'s on every run.
- ``fused_float32``: ``old`` with fused q/k/v and gate/up products
  (:mod:`hetmesh.partition.fused`): bit-identical logits, checked here over
  ``--tokens`` greedy tokens on every run.

Keys: ``single_process_tokens_per_s`` (``default``),
``single_process_tokens_per_s_old``, ``single_process_speedup`` (default / old,
issue 16's target >= 2), ``single_process_weights`` (the format ``default``
resolved to), ``single_process_tokens_before_differing`` (greedy tokens it shares
with ``old`` before the first that differs: another format differs slightly),
``float32_tokens_per_s``, ``float32_speedup`` and ``float32_tokens_identical``
(its greedy tokens equal ``old``'s), ``fused_speedup_float32`` (fused fp32 / old:
the exact lever alone), ``lean_speedup`` (default / default_eager: the lean
layers alone), ``lean_decode_speedup`` (default / default_layers: the lean decode
step alone) and ``single_process_lean`` (whether ``default`` has them).
``--profile`` prints torch.profiler's top operators of each path.

Usage: ``python bench/decode.py [--json] [--tokens 64] [--repeats 3] [--weights native]``
``[--threads 1] [--fuse] [--profile]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a long story about a lighthouse keeper and the sea."
PATHS = ("old", "default", "default_eager", "default_layers", "float32", "fused_float32")


def load_paths(model_dir: Path, weights: str = "native", fuse_new: bool = False) -> dict[str, Any]:
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.stage import load_stage

    def one(
        fmt: str,
        fuse: bool,
        transpose_head: bool | None = None,
        lean: bool = True,
        lean_decode: bool = True,
    ) -> LocalPipeline:
        stage = load_stage(
            model_dir,
            0,
            _num_units(model_dir),
            weights=fmt,
            fuse=fuse,
            transpose_head=transpose_head,
        )
        stage.lean = stage.lean and lean
        stage.lean_decode = stage.lean_decode and lean_decode
        return LocalPipeline([stage], model_dir=model_dir)

    return {
        "old": one("float32", False, transpose_head=False, lean=False),
        "default": one(weights, fuse_new),
        "default_eager": one(weights, fuse_new, lean=False),
        "default_layers": one(weights, fuse_new, lean_decode=False),
        "float32": one("float32", False),  # the loader's fp32 defaults
        "fused_float32": one("float32", True, transpose_head=False),
    }


def _num_units(model_dir: Path) -> int:
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir

    return model_profile(check_model_dir(model_dir)).num_units


def lockstep_tpots(
    paths: dict[str, Any], prompt_ids: list[int], tokens: int
) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Greedy-decode ``tokens`` tokens on every path, one step of each in turn.

    Returns each path's mean seconds per decode step (the prefill excluded)
    and its tokens. Stepping the paths in turn, rather than one whole
    generation after another, spreads the load of a shared machine over all
    of them alike.
    """
    import torch

    from hetmesh.partition.sampling import SamplingParams

    sessions = {
        name: p.new_session(SamplingParams(max_new_tokens=tokens)) for name, p in paths.items()
    }
    spent = dict.fromkeys(paths, 0.0)
    out: dict[str, list[int]] = {name: [] for name in paths}
    try:
        with torch.inference_mode():
            for step in range(tokens):
                for name, pipeline in paths.items():
                    x = torch.tensor(out[name][-1:] if step else prompt_ids, dtype=torch.int64)
                    began = time.perf_counter()
                    logits = pipeline.forward(x, sessions[name].kvs, last_only=True)
                    token = int(logits[-1].argmax())  # greedy
                    if step:
                        spent[name] += time.perf_counter() - began
                    out[name].append(token)
    finally:
        for session in sessions.values():
            session.free()
    return {name: total / (tokens - 1) for name, total in spent.items()}, out


def measure(
    model_dir: Path,
    prompt_ids: list[int],
    *,
    tokens: int = 64,
    repeats: int = 3,
    weights: str = "native",
    threads: int = 1,
    fuse_new: bool = False,
) -> dict[str, Any]:
    """The figures in the module docstring; raises if fused fp32 changes a token."""
    import torch

    torch.set_num_threads(threads)
    paths = load_paths(model_dir, weights, fuse_new)
    lockstep_tpots(paths, prompt_ids, 4)  # warm up every path
    tpots: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        tpot, outputs = lockstep_tpots(paths, prompt_ids, tokens)
        if outputs["fused_float32"] != outputs["old"]:
            raise RuntimeError("fused fp32 decoded other tokens than the separate products")
        if outputs["default_eager"] != outputs["default"]:
            raise RuntimeError("lean layers decoded other tokens than transformers' layers")
        if outputs["default_layers"] != outputs["default"]:
            raise RuntimeError("lean decode steps decoded other tokens than the lean layers")
        for name, value in tpot.items():
            tpots[name].append(value)
    rate = {name: 1.0 / statistics.median(values) for name, values in tpots.items()}

    def agree(path: str) -> int:  # tokens before the first that differs from old's
        pairs = zip(outputs[path], outputs["old"], strict=True)
        return next((i for i, (a, b) in enumerate(pairs) if a != b), tokens)

    return {
        "single_process_tokens_per_s": rate["default"],
        "single_process_tokens_per_s_old": rate["old"],
        "single_process_speedup": rate["default"] / rate["old"],
        "single_process_weights": paths["default"].stages[0].weights.value,
        "single_process_fused": fuse_new,
        "single_process_tokens_before_differing": agree("default"),
        "float32_tokens_per_s": rate["float32"],
        "float32_speedup": rate["float32"] / rate["old"],
        "float32_tokens_identical": outputs["float32"]
        == outputs["old"],  # greedy: every repeat alike
        "float32_tokens_before_differing": agree("float32"),
        "single_process_tokens_per_s_fused_float32": rate["fused_float32"],
        "fused_speedup_float32": rate["fused_float32"] / rate["old"],
        "fused_float32_tokens_identical": True,  # checked above, over `tokens` tokens
        "single_process_lean": paths["default"].stages[0].lean,
        "lean_speedup": rate["default"] / rate["default_eager"],
        "lean_tokens_identical": True,  # checked above, over `tokens` tokens
        "lean_decode_speedup": rate["default"] / rate["default_layers"],
        "lean_decode_tokens_identical": True,  # checked above, over `tokens` tokens
        "tokens": tokens,
        "repeats": repeats,
        "threads": threads,
    }


def profile_table(pipeline: Any, prompt_ids: list[int], steps: int = 16, rows: int = 10) -> str:
    """torch.profiler's top operators over ``steps`` decode steps (self CPU time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hetmesh.partition.sampling import SamplingParams

    session = pipeline.new_session(SamplingParams(max_new_tokens=steps))
    try:
        x = torch.tensor(prompt_ids, dtype=torch.int64)
        token = torch.tensor([int(pipeline.forward(x, session.kvs, last_only=True)[-1].argmax())])
        for _ in range(2):  # warm
            pipeline.forward(token, session.kvs, last_only=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                pipeline.forward(token, session.kvs, last_only=True)
    finally:
        session.free()
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--weights", default="native", help="weight format of the default path (native: as shipped)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fuse", action="store_true", help="fuse the new path's products")
    parser.add_argument("--profile", action="store_true", help="print each path's top operators")
    args = parser.parse_args()

    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, load_tokenizer

    model_dir = resolve_model()
    prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT, chat=True)
    result = measure(
        model_dir,
        prompt_ids,
        tokens=args.tokens,
        repeats=args.repeats,
        weights=args.weights,
        threads=args.threads,
        fuse_new=args.fuse,
    )
    if args.profile:
        import torch

        torch.set_num_threads(args.threads)
        for name, pipeline in load_paths(model_dir, args.weights, args.fuse).items():
            print(f"== {name}\n{profile_table(pipeline, prompt_ids)}")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"single process ({args.threads} thread(s)): old (fp32 before issue 16) "
        f"{result['single_process_tokens_per_s_old']:.1f} tok/s, default "
        f"({result['single_process_weights']}{', fused' if args.fuse else ''}) "
        f"{result['single_process_tokens_per_s']:.1f} tok/s: speedup "
        f"{result['single_process_speedup']:.2f} (target >= 2), follows old for "
        f"{result['single_process_tokens_before_differing']}/{args.tokens} greedy tokens; "
        f"fp32 today x{result['float32_speedup']:.2f} (tokens "
        f"{'identical' if result['float32_tokens_identical'] else 'DIFFER'}); "
        f"fused fp32 x{result['fused_speedup_float32']:.2f} (tokens identical); "
        f"lean layers x{result['lean_speedup']:.2f} (tokens identical); "
        f"lean decode step x{result['lean_decode_speedup']:.2f} (tokens identical)"
    )


if __name__ == "__main__":
    main()
