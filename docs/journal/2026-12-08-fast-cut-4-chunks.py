"""CPU of a 512-token prefill through the three stages of the cut, whole and in n chunks (thread CPU, alternating, best of R)."""
import time, torch, sys
torch.set_num_threads(1)
from hetmesh.partition.store import resolve_model
from hetmesh.partition.stage import load_stage
from hetmesh.partition.prefill import prefill_chunks
md = resolve_model(None)
parts = [load_stage(md, a, b, weights="native") for a, b in [(0, 13), (13, 25), (25, 32)]]
ids = torch.tensor([(7 * i + 11) % 40000 + 20 for i in range(512)])
def run(n):
    kvs = [s.new_kv() for s in parts]
    sizes = prefill_chunks(512, 512 // n, n) if n > 1 else [512]
    per = [0.0] * 3; out = None
    for chunk in torch.split(ids, sizes):
        x = chunk
        for i, (s, kv) in enumerate(zip(parts, kvs)):
            a = time.thread_time(); x = s.forward(x, kv, last_only=s.has_head); per[i] += time.thread_time() - a
        out = x
    return sum(per), int(out[-1].argmax())
R = int(sys.argv[1]) if len(sys.argv) > 1 else 4
res = {n: [] for n in (1, 4, 6, 8)}; toks = {}
for r in range(R):
    for n in (list(res) if r % 2 == 0 else list(res)[::-1]):
        t, tok = run(n); res[n].append(t); toks[n] = tok
base = min(res[1])
for n, v in res.items(): print(f"{n} chunks: min {min(v)*1e3:.0f} ms CPU ({min(v)/base:.3f}x whole), last token {toks[n]}")
