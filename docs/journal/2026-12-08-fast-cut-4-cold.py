import time, torch
torch.set_num_threads(1)
from hetmesh.partition.store import resolve_model
from hetmesh.partition.stage import load_stage
md = resolve_model(None)
cuts = [(0, 13), (13, 25), (25, 32)]
parts = [load_stage(md, a, b, weights="native") for a, b in cuts]
prompt = torch.tensor(list(range(100, 130)))
junk = torch.zeros(16 * 2**20 // 4)  # 16 MiB: more than L2, as another process's working set
def prefill():
    kvs = [s.new_kv() for s in parts]; x = prompt
    for s, kv in zip(parts, kvs): x = s.forward(x, kv, last_only=s.has_head)
    return kvs, int(x[-1].argmax())
def run(n, evict):
    kvs, tok = prefill(); fw = 0.0
    for _ in range(n):
        x = torch.tensor([tok])
        for s, kv in zip(parts, kvs):
            if evict: junk.add_(1.0)
            a = time.thread_time(); x = s.forward(x, kv, last_only=s.has_head); fw += time.thread_time() - a
        tok = int(x[-1].argmax())
    return fw / n
res = {True: [], False: []}
for r in range(10):
    for ev in ((True, False) if r % 2 else (False, True)):
        res[ev].append(run(24, ev))
for k, v in res.items(): print("evict" if k else "warm ", "min %.2f med %.2f ms" % (min(v)*1e3, sorted(v)[len(v)//2]*1e3))
