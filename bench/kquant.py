"""K-quant benchmark: one Llama-shaped model written as a Q4_K_M GGUF and as a Q4_1 GGUF,
each loaded the way a node loads it (``--model file.gguf``, native weights), in one run.

The weights are seeded random values; both files hold the same values, each
quantised to its own type (Q4_K_M: Q4_K, with the head and half of the layers'
``attn_v`` / ``ffn_down`` in Q6_K, llama.cpp's rule; written by the tests'
numpy quantiser, ``tests/unit/partition/kquant_files.py``). Each file is
converted once (:func:`hetmesh.partition.store.resolve_model`) and every
measurement runs in a fresh process, one torch thread (a node's default):

- ``*_file_bytes``: the GGUF file; ``*_resident_bytes``: the loaded stage's
  tensors (``StageModule.resident_bytes``, what the node holds), the whole
  model in one stage; ``*_bytes_by_module``: the same by module class;
- ``q4_k_m_resident_over_file``: resident bytes ÷ file bytes;
- ``*_decode_tok_s_per_round``: greedy decode speed after a 16-token prefill,
  the median step over ``--tokens`` steps, one fresh process per round;
- ``q4_k_m_decode_ratio_vs_q4_1``: Q4_K_M's decode speed ÷ Q4_1's, both models
  held by one process and decoding in lockstep (each step times one model's
  token, then the other's, the order alternating): the median over rounds of
  each round's median per-step ratio, so a shared machine's slow spells fall
  on both alike.

``--errors`` prints instead the error of holding Q5_K / Q6_K matrices in int4
groups (refitted, what an int4 stage holds; and Q4_1's min-max rule) and in int8
per row (what folders converted before 2026-12-06 hold), against the file's values,
over the default model's 256-wide matrices (docs/weights.md).

Usage: ``python bench/kquant.py [--json] [--layers 8] [--tokens 32] [--rounds 3] [--errors]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Llama 3.2-like proportions, smaller: hidden 1024, 16 heads of 64, 4 kv heads
SHAPE = {"hidden": 1024, "inter": 4096, "heads": 16, "kv_heads": 4, "vocab": 16384}


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def write_pair(folder: Path, layers: int) -> tuple[Path, Path]:
    """The same seeded weights as ``q4_k_m.gguf`` and ``q4_1.gguf`` in ``folder``."""
    import gguf
    import numpy as np

    sys.path.insert(0, str(REPO))
    from tests.unit.partition.kquant_files import QUANTISERS, byte_tokens, q4_k_m_type

    hidden, inter = SHAPE["hidden"], SHAPE["inter"]
    heads, kv_heads, vocab = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["vocab"]
    head_dim = hidden // heads
    tokens, merges = byte_tokens()
    tokens = tokens + [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    paths = {"q4_k_m": folder / "q4_k_m.gguf", "q4_1": folder / "q4_1.gguf"}
    writers = {}
    for kind, path in paths.items():
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_name(f"bench-{kind}")
        writer.add_context_length(2048)
        writer.add_embedding_length(hidden)
        writer.add_block_count(layers)
        writer.add_feed_forward_length(inter)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(500000.0)
        writer.add_vocab_size(vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writers[kind] = writer
    rng = np.random.default_rng(0)
    shapes = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (hidden,)),
            (f"blk.{i}.ffn_norm.weight", (hidden,)),
            (f"blk.{i}.attn_q.weight", (heads * head_dim, hidden)),
            (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden)),
            (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden)),
            (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim)),
            (f"blk.{i}.ffn_gate.weight", (inter, hidden)),
            (f"blk.{i}.ffn_up.weight", (inter, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, inter)),
        ]
    shapes += [("output_norm.weight", (hidden,)), ("output.weight", (vocab, hidden))]
    for name, shape in shapes:
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            for writer in writers.values():
                writer.add_tensor(name, values)
            continue
        values = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        ktype = q4_k_m_type(name, layers)
        writers["q4_k_m"].add_tensor(
            name, QUANTISERS[ktype](values), raw_dtype=gguf.GGMLQuantizationType[ktype]
        )
        q41 = gguf.GGMLQuantizationType.Q4_1
        writers["q4_1"].add_tensor(name, gguf.quants.quantize(values, q41), raw_dtype=q41)
    for writer in writers.values():
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths["q4_k_m"], paths["q4_1"]


def _load(model_dir: Path) -> Any:
    from hetmesh.partition.stage import load_stage

    with open(model_dir / "config.json") as handle:
        layers = json.load(handle)["num_hidden_layers"]
    return load_stage(model_dir, 0, layers + 2, weights="native")


def _bytes_by_module(stage: Any) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for module in stage.modules():
        own = sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
        own += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        if own:
            kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + own
    return kinds


def lockstep(folders: dict[str, Path], tokens: int) -> dict[str, Any]:
    """Both models in this process, decoding in lockstep: each step times one model's
    token and then the other's (order alternating), so a loaded machine's slow spells
    hit both alike. Returns per-model resident bytes and median step times."""
    import torch

    torch.set_num_threads(1)
    stages = {kind: _load(folder) for kind, folder in folders.items()}
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 262, (16,), generator=gen)
    kvs, next_token, steps = {}, {}, {}
    for kind, stage in stages.items():
        out[f"{kind}_weights"] = str(stage.weights)
        out[f"{kind}_resident_bytes"] = stage.resident_bytes()
        out[f"{kind}_bytes_by_module"] = _bytes_by_module(stage)
        kvs[kind] = stage.new_kv()
        next_token[kind] = int(stage.forward(prompt, kvs[kind])[-1].argmax())
        steps[kind] = []
    order = list(stages)
    ratios = []
    for step in range(tokens):
        for kind in order if step % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            logits = stages[kind].forward(torch.tensor([next_token[kind]]), kvs[kind])
            steps[kind].append(time.perf_counter() - start)
            next_token[kind] = int(logits[-1].argmax())
        ratios.append(steps[order[1]][-1] / steps[order[0]][-1])
    for kind in order:
        out[f"{kind}_step_s"] = statistics.median(steps[kind])
    # the second model's step time over the first's: the first's speed over the second's
    out["step_ratio"] = statistics.median(ratios)
    return out


def run(layers: int, tokens: int, rounds: int) -> dict[str, Any]:
    from hetmesh.partition.store import resolve_model

    began = time.perf_counter()
    result: dict[str, Any] = {"shape": {**SHAPE, "layers": layers}, "torch_threads": 1}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = dict(zip(("q4_k_m", "q4_1"), write_pair(work, layers), strict=True))
        folders = {k: str(resolve_model(p, cache_dir=work / "cache")) for k, p in files.items()}
        runs = []
        for _ in range(rounds):  # a fresh process per round
            cmd = [sys.executable, __file__, "--worker", json.dumps(folders)]
            cmd += ["--tokens", str(tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        for kind, path in files.items():
            result[f"{kind}_file_bytes"] = path.stat().st_size
            for key in ("weights", "resident_bytes", "bytes_by_module"):
                result[f"{kind}_{key}"] = runs[0][f"{kind}_{key}"]
            tok_s = [round(1.0 / r[f"{kind}_step_s"], 2) for r in runs]
            result[f"{kind}_decode_tok_s_per_round"] = tok_s
    for kind in files:
        result[f"{kind}_resident_over_file"] = round(
            result[f"{kind}_resident_bytes"] / result[f"{kind}_file_bytes"], 4
        )
    # speed ratio: Q4_K_M tokens/s over Q4_1's = Q4_1's step time over Q4_K_M's
    per_round = [round(r["step_ratio"], 3) for r in runs]
    result["q4_k_m_decode_ratio_per_round"] = per_round
    result["q4_k_m_decode_ratio_vs_q4_1"] = statistics.median(per_round)
    result["run_s"] = round(time.perf_counter() - began, 1)
    return result


def wide_errors() -> dict[str, Any]:
    """Relative RMS errors of holding Q5_K / Q6_K in int4 groups of 32 refitted
    (``int4_fit``, what an int4 stage holds), by the min-max rule (``int4``) and in int8
    per row (``int8``), each against the file's values (``own``: the K-quant's own error
    against the float weights), over the default model's decoder matrices whose width is whole
    super-blocks (its 30 ``down_proj``), quantised by the tests' quantiser."""
    import gguf
    import torch

    sys.path.insert(0, str(REPO))
    from hetmesh.partition.checkpoint import CheckpointReader
    from hetmesh.partition.quant import fit_groups_int4, quantize_groups_int4, quantize_rows_int8
    from hetmesh.partition.store import resolve_model
    from tests.unit.partition.kquant_files import QUANTISERS

    sums: dict[str, dict[str, float]] = {
        k: {"own": 0.0, "int8": 0.0, "int4": 0.0, "int4_fit": 0.0} for k in ("Q5_K", "Q6_K")
    }
    norms = dict.fromkeys(sums, 0.0)
    count = 0
    with CheckpointReader(resolve_model(None)) as reader:
        for name in reader.names():
            if ".layers." not in name or not name.endswith("proj.weight"):
                continue
            weight = reader.tensor(name)
            if weight.shape[1] % 256:
                continue
            count += 1
            for kind in sums:
                qtype = gguf.GGMLQuantizationType[kind]
                raw = QUANTISERS[kind](weight.numpy())
                held = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(weight.shape))
                q8, scale = quantize_rows_int8(held)
                q4, d, m = quantize_groups_int4(held)
                rows = held.shape[0]
                as_int4 = q4.float().reshape(rows, -1, 32) * d[..., None] + m[..., None]
                q4, d, m = fit_groups_int4(held)
                fit = q4.float().reshape(rows, -1, 32) * d[..., None] + m[..., None]
                sums[kind]["int4_fit"] += float((fit.reshape(held.shape) - held).pow(2).sum())
                norms[kind] += float(held.pow(2).sum())
                sums[kind]["own"] += float((held - weight).pow(2).sum())
                sums[kind]["int8"] += float((q8.float() * scale[:, None] - held).pow(2).sum())
                sums[kind]["int4"] += float((as_int4.reshape(held.shape) - held).pow(2).sum())
    out: dict[str, Any] = {"matrices": count}
    for kind, parts in sums.items():
        for part, total in parts.items():
            out[f"{kind.lower()}_{part}_rel_rms_pct"] = round(100 * (total / norms[kind]) ** 0.5, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes, each in lockstep")
    parser.add_argument(
        "--errors", action="store_true", help="only the Q5_K/Q6_K -> int4/int8 error table"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.errors:
        print(json.dumps(wide_errors(), indent=2))
        return
    if args.worker:
        folders = {kind: Path(folder) for kind, folder in json.loads(args.worker).items()}
        print(json.dumps(lockstep(folders, args.tokens)))
        return
    result = run(args.layers, args.tokens, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
