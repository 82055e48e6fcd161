"""Ad-hoc (cutF): exact_gemm.gemm_attention before (a copy, OLD=path) and after masking
only a tile's own keys: the same bits, thread CPU per schedule of a 512-token prefill, one
layer of the default model's shape (9 heads, 3 KV heads, 64 dims), arms alternated.

PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-14-fast-cut-9f-attn.py OLD.py [REPEATS] [HEADS KV DIM]
"""
import importlib.util
import sys
import time

import torch

from hetmesh.partition import exact_gemm as new
from hetmesh.partition.attention import QuerySpans

spec = importlib.util.spec_from_file_location("old_gemm", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
heads, kv, dim = (int(x) for x in sys.argv[3:6]) if len(sys.argv) > 5 else (9, 3, 64)
torch.set_num_threads(1)
assert new.gemm_is_exact(heads, kv, dim)
old._KEY_BLOCK, old._VERDICTS = new._KEY_BLOCK, new._VERDICTS
torch.manual_seed(0)
q = torch.randn(1, heads, 512, dim)
k = torch.randn(1, kv, 512, dim)
v = torch.randn(1, kv, 512, dim)


def run(mod, sizes):
    outs, past = [], 0
    t0 = time.thread_time()
    for _ in range(4):  # as four layers: each forward's spans built once
        outs, past = [], 0
        for n in sizes:
            spans = QuerySpans.of([past], [n], n, None)
            end = past + n
            outs.append(mod.gemm_attention(q[:, :, past:end], k[:, :, :end], v[:, :, :end],
                                           spans.rows, None, spans=spans))
            past = end
    return time.thread_time() - t0, torch.cat(outs, dim=1)


SCHEDULES = {"1x512": [512], "taper": [85, 171, 171, 85], "4x128": [128] * 4}
best = {}
for _ in range(reps):
    for name, sizes in SCHEDULES.items():
        for label, mod in (("old", old), ("new", new)):
            t, out = run(mod, sizes)
            key = (name, label)
            best[key] = min(best.get(key, 1e9), t / 4)
            if label == "old":
                ref = out
            else:
                assert torch.equal(out, ref), name
whole = run(new, [512])[1]
for name in SCHEDULES:
    same = torch.equal(run(new, SCHEDULES[name])[1], whole)
    print(f"{name:>6}: old {best[(name, 'old')] * 1e3:6.2f} ms, new {best[(name, 'new')] * 1e3:6.2f} ms a layer; bits old == new; chunks == whole: {same}")
