"""Per decode round of N sessions on a stage: forward_batch's thread CPU and the part inside round_layers (best of R)."""
import sys, time, torch
torch.set_num_threads(1)
from hetmesh.partition.store import resolve_model
from hetmesh.partition import stage as sm
from hetmesh.partition.stage import load_stage
lo, hi = (int(a) for a in sys.argv[1].split(",")); R = int(sys.argv[2])
s = load_stage(resolve_model(None), lo, hi, weights="native")
pool = s.new_pool(512); H = s.hidden_size
g = torch.Generator().manual_seed(0)
def inp(n): return torch.randint(4, 1000, (n,), generator=g) if s.has_embed else torch.randn(n, H, generator=g)
kvs = [s.new_kv(pool) for _ in range(8)]
for i, kv in enumerate(kvs): s.forward(inp(30 + 7 * i), kv)
inside = [0.0]
real = sm.round_layers
def timed(*a, **k):
    t = time.thread_time(); out = real(*a, **k); inside[0] += time.thread_time() - t; return out
sm.round_layers = timed
for n in (2, 4, 8):
    tot, ins = [], []
    for r in range(R):
        items = [(inp(1), kvs[i]) for i in range(n)]
        inside[0] = 0.0
        t = time.thread_time(); s.forward_batch(items, last_only=True); tot.append(time.thread_time() - t); ins.append(inside[0])
    best = min(range(R), key=lambda i: tot[i])
    print(f"[{lo},{hi}) N={n}: forward_batch {tot[best]*1e3:.2f} ms, round_layers {ins[best]*1e3:.2f} ms, outside {(tot[best]-ins[best])*1e3:.3f} ms (min outside {min(a-b for a,b in zip(tot,ins))*1e3:.3f})")
