"""Ad-hoc (cutF): one int4 stage's 512-token prefill, whole and in the mesh's chunks:
thread CPU, its system part and the thread's minor page faults (getrusage RUSAGE_THREAD),
best of REPEATS, alternated. Run it with and without glibc's malloc thresholds fixed
(MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_) to see what the
allocator's page faults cost.

PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-14-fast-cut-9f-faults.py [LO HI REPEATS]
"""
import resource
import sys

import torch

from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import resolve_model

torch.set_num_threads(1)
lo, hi = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (13, 25)
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
st = load_stage(resolve_model(None), lo, hi, weights="int4")
torch.manual_seed(0)
x = torch.randn(512, st.hidden_size) * 0.5 if lo > 0 else torch.randint(0, 40000, (512,))
RUSAGE_THREAD = 1


def run(sizes):
    kv = st.new_kv()
    a = resource.getrusage(RUSAGE_THREAD)
    for i, c in enumerate(torch.split(x, sizes)):
        st.forward_batch([(c, kv)], last_only=True, heads=[i == len(sizes) - 1])
    b = resource.getrusage(RUSAGE_THREAD)
    user, system = b.ru_utime - a.ru_utime, b.ru_stime - a.ru_stime
    return user + system, system, b.ru_minflt - a.ru_minflt


arms = {"1x512": [512], "taper": [85, 171, 171, 85], "4x128": [128] * 4}
for s in arms.values():
    run(s)
best = {}
for _ in range(reps):
    for name, s in arms.items():
        r = run(s)
        if name not in best or r[0] < best[name][0]:
            best[name] = r
for name, (cpu, system, faults) in best.items():
    print(f"[{lo},{hi}) {name:>6}: {cpu * 1e3:7.1f} ms CPU ({system * 1e3:5.1f} system), {faults} minor faults")
