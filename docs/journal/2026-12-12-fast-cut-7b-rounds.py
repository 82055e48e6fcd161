"""(2026-12-12: MODEL=name for another model than the default.) A stage's decode round of N sessions: eager round vs scripted round vs N scripted singles; int4 kernels alone (thread CPU, best of R, interleaved)."""
import sys, time, torch
torch.set_num_threads(1)
from hetmesh.partition.store import resolve_model
from hetmesh.partition.stage import load_stage
import os
md = resolve_model(os.environ.get("MODEL"))
lo, hi = (int(a) for a in sys.argv[1].split(",")) if len(sys.argv) > 1 else (13, 25)
R = int(sys.argv[2]) if len(sys.argv) > 2 else 10
s = load_stage(md, lo, hi, weights="native")
pool = s.new_pool(512)
H = s.hidden_size
g = torch.Generator().manual_seed(0)
kvs = [s.new_kv(pool) for _ in range(8)]
for i, kv in enumerate(kvs):
    s.forward(torch.randint(4, 1000, (30 + 7 * i,), generator=g) if s.has_embed else torch.randn(30 + 7 * i, H, generator=g), kv)
rows = [torch.randint(4, 1000, (1,), generator=g) if s.has_embed else torch.randn(1, H, generator=g) for _ in range(8)]
def round_(n, script):
    s.lean_round = script
    a = time.thread_time(); s.forward_batch([(rows[i], kvs[i]) for i in range(n)], last_only=True); return time.thread_time() - a
def singles(n):
    a = time.thread_time()
    for i in range(n): s.forward(rows[i], kvs[i], last_only=True)
    return time.thread_time() - a
plans = s._lean_plans()
def kernels(n):
    a = time.thread_time()
    for p in plans:
        for grp in (p.qkv, p.o, p.mlp_in, p.mlp_down):
            for packed, sz, _, _ in grp.int4:
                xi = torch.zeros(n, sz.shape[0] * 32, dtype=torch.bfloat16)
                torch._weight_int4pack_mm_for_cpu(xi, packed, 32, sz)
    return time.thread_time() - a
fs = (("eager", lambda n: round_(n, False)), ("script", lambda n: round_(n, True)), ("singles", singles), ("kernels", kernels))
res = {}
for r in range(R):
    for n in ((1, 2, 4, 8) if r % 2 == 0 else (8, 4, 2, 1)):
        for name, f in (fs if r % 2 == 0 else fs[::-1]):
            f(n)  # the same call first: each measured call follows its own kind
            res.setdefault((name, n), []).append(f(n))
print(f"stage [{lo},{hi}) best of {R}, ms of thread CPU")
for n in (1, 2, 4, 8):
    e, sc, si, k = (min(res[(k, n)]) * 1e3 for k in ("eager", "script", "singles", "kernels"))
    print(f"N={n}: eager round {e:.2f} ({e/n:.2f}/row)  scripted round {sc:.2f} ({sc/n:.2f}/row, {sc/e:.3f}x eager)  {n} scripted singles {si:.2f}  int4 kernels {k:.2f} ({k/n:.2f}/row)")
