"""Ad-hoc (cutF): torch.profiler's ops of one int4 stage's 512-token prefill, whole against
the mesh's chunks (85 / 171 / 171 / 85): which ops' self CPU grows with the chunks.

PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-14-fast-cut-9f-prof.py [LO HI]
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import resolve_model

torch.set_num_threads(1)
lo, hi = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (13, 25)
st = load_stage(resolve_model(None), lo, hi, weights="int4")
torch.manual_seed(0)
x = torch.randn(512, st.hidden_size) * 0.5 if lo > 0 else torch.randint(0, 40000, (512,))


def run(sizes):
    kv = st.new_kv()
    for i, c in enumerate(torch.split(x, sizes)):
        st.forward_batch([(c, kv)], last_only=True, heads=[i == len(sizes) - 1])


arms = {"whole": [512], "taper": [85, 171, 171, 85]}
for sizes in arms.values():
    run(sizes)
table = {}
for _ in range(2):
    for name, sizes in arms.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(sizes)
        ops = defaultdict(lambda: [0.0, 0])
        for e in prof.key_averages():
            ops[e.key][0] += e.self_cpu_time_total / 1e3
            ops[e.key][1] += e.count
        if name not in table or sum(v[0] for v in ops.values()) < sum(
            v[0] for v in table[name].values()
        ):
            table[name] = ops
keys = sorted(set(table["whole"]) | set(table["taper"]), key=lambda k: -abs(
    table["taper"].get(k, [0, 0])[0] - table["whole"].get(k, [0, 0])[0]))
print(f"stage [{lo},{hi}): self CPU ms (calls), whole | taper | diff")
for k in keys[:25]:
    w, t = table["whole"].get(k, [0, 0]), table["taper"].get(k, [0, 0])
    print(f"{k[:40]:40s} {w[0]:8.1f} ({w[1]:5d}) | {t[0]:8.1f} ({t[1]:5d}) | {t[0] - w[0]:+7.1f}")
print("total", {n: round(sum(v[0] for v in o.values()), 1) for n, o in table.items()})
