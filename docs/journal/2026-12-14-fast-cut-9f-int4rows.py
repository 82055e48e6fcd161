"""Ad-hoc (cutF): int4's cost a row by rows a product, the default model's layer shapes (SHAPE=1b: synth-llama-3.2-1b's)
(q 576->576, k/v 576->192, o 576->576, gate/up 576->1536, down 1536->576), thread CPU,
best of REPEATS, row counts alternated. Which chunk sizes the kernel takes cheaply.

PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-14-fast-cut-9f-int4rows.py [REPEATS] [ROWS...]
"""
import sys
import time

import torch

from hetmesh.partition.quant import INT4_GROUP, Int4Linear

torch.set_num_threads(1)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ROWS = [int(r) for r in sys.argv[2:]] or [32, 48, 64, 80, 85, 96, 112, 128, 160, 171, 192, 256, 512]
shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
if __import__("os").environ.get("SHAPE") == "1b":  # synth-llama-3.2-1b's layer
    shapes = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]
torch.manual_seed(0)
layers = []
for k, n in shapes:
    lin = Int4Linear(k, n, bias=False, device="cpu")
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    d = torch.rand(n, k // INT4_GROUP) * 0.01
    m = -8 * d
    lin.weight_packed, lin.scales_zeros = Int4Linear.pack(q, d, m)
    layers.append(lin)
xs = {r: {k: torch.randn(r, k).to(torch.bfloat16) for k in {k for k, _ in shapes}} for r in ROWS}


def one(r):
    x = xs[r]
    t0 = time.thread_time()
    for _ in range(max(1, 1024 // r)):
        for lin, (k, _n) in zip(layers, shapes):
            torch.ops.aten._weight_int4pack_mm_for_cpu(
                x[k], lin.weight_packed, INT4_GROUP, lin.scales_zeros
            )
    return (time.thread_time() - t0) / (max(1, 1024 // r) * r)


best = {r: 1e9 for r in ROWS}
for r in ROWS:
    one(r)
for _ in range(reps):
    for r in ROWS:
        best[r] = min(best[r], one(r))
base = best.get(128) or min(best.values())
for r in ROWS:
    print(f"{r:4d} rows: {best[r] * 1e6:7.2f} us a row a layer ({best[r] / base:.3f} of 128's)")
