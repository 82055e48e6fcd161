"""Ad-hoc (cutD): int4 prefill CPU (thread time) of one stage by chunk schedule, arms
alternated. OMP_NUM_THREADS=1 python rows.py LO HI REPEATS"""
import sys, time
import torch
from hetmesh.partition.store import resolve_model
from hetmesh.partition.stage import load_stage
torch.set_num_threads(1)
md = resolve_model(None)
lo, hi = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (0, 32)
st = load_stage(md, lo, hi, weights="int4")
head = hi == 32
ids = torch.randint(0, 40000, (512,), dtype=torch.int64)
def inp(n, off):
    if lo == 0:
        return ids[off:off+n]
    return torch.randn(n, 576) * 0.5
def run(sizes):
    kv = st.new_kv()
    c0 = time.thread_time()
    per = []
    off = 0
    for n in sizes:
        a = time.thread_time()
        st.forward(inp(n, off), kv, last_only=head)
        per.append(time.thread_time() - a)
        off += n
    return time.thread_time() - c0, per
arms = {"4x128": [128]*4, "taper85": [85,171,171,85], "1x512": [512], "64+3x128+64": [64,128,128,128,64]}
run([128]); run([64])
res = {k: [] for k in arms}
pers = {k: None for k in arms}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for k, s in arms.items():
        t, per = run(s)
        res[k].append(t)
        pers[k] = per
for k in arms:
    v = sorted(res[k])
    print(f"[{lo},{hi}) {k:14s} min {v[0]*1e3:7.1f} med {v[len(v)//2]*1e3:7.1f} ms  per-chunk(last) {[round(x*1e3,1) for x in pers[k]]}")
