"""One session's decode step whose KV blocks do not form one run: eager layers vs the round's script (thread CPU, best of R, alternating)."""
import sys, time, torch
torch.set_num_threads(1)
from hetmesh.partition.store import resolve_model
from hetmesh.partition.stage import load_stage
lo, hi = (int(a) for a in sys.argv[1].split(","))
R = int(sys.argv[2])
s = load_stage(resolve_model(None), lo, hi, weights="native")
pool = s.new_pool(512); H = s.hidden_size
g = torch.Generator().manual_seed(0)
def inp(n): return torch.randint(4, 1000, (n,), generator=g) if s.has_embed else torch.randn(n, H, generator=g)
a, b = s.new_kv(pool), s.new_kv(pool)
s.forward(inp(40), a); s.forward(inp(40), b); s.forward(inp(30), a)  # a: blocks split by b's
assert not a.contiguous
res = {True: [], False: []}
for r in range(R):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
        s.lean_round = on
        x = inp(1)
        s.forward(x, a, last_only=True)
        t = time.thread_time(); s.forward(inp(1), a, last_only=True); res[on].append(time.thread_time() - t)
print(f"[{lo},{hi}) non-contiguous lone step: eager {min(res[False])*1e3:.2f} ms, round script {min(res[True])*1e3:.2f} ms ({min(res[True])/min(res[False]):.3f}x)")
