"""Ad-hoc (cutF, issue 42 item 3): where a 512-token prefill's CPU goes, whole against
the mesh's chunks, op by op, in one process through the stage's own path (lean layers,
exact attention, the KV writes, the head); thread CPU, best of N, arms alternated.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/journal/2026-12-14-fast-cut-9f-ops.py \
        [MODEL|-] [REPEATS] [CUT] [POOL]

MODEL: a model folder (``-``: the default model). CUT: the stages' unit bounds, e.g.
``0,13,25,32`` (default: the whole model as one stage). POOL: ``private`` (a growable pool
per session, its blocks one run: a view) or ``server`` (a fixed pool whose blocks another
session interleaves, as a stage server's pool: a gather per layer per chunk).

Each stage gets its own arm per schedule: ``1x512`` (the reference: the whole prompt in
one forward) and the mesh's ``85/171/171/85`` (and ``4x128``). A later stage takes hidden
states; those come from running the earlier stages once (the same bits as the mesh's).
"""

import sys
import time
from collections import defaultdict

import torch

import hetmesh.partition.lean as lean
import hetmesh.partition.stage as stage_mod
from hetmesh.partition.store import resolve_model
from hetmesh.partition.stage import load_stage

torch.set_num_threads(1)
model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
md = resolve_model(model)
probe = load_stage(md, 0, 1, weights="int4")
units = probe.profile.num_units
cut = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0, units]
pool_kind = sys.argv[4] if len(sys.argv) > 4 else "private"
del probe
SCHEDULES = {"1x512": [512], "taper": [85, 171, 171, 85], "4x128": [128] * 4}

acc: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.thread_time() - t0
            calls[name] += 1

    return wrapper


# the lean layer's parts, by the module globals lean_layer reads
lean._norm = timed("norm", lean._norm)
lean._rope = timed("rope", lean._rope)
lean.exact_attention = timed("attention", lean.exact_attention)
lean.F = type("F", (), {"silu": staticmethod(timed("silu", torch.nn.functional.silu))})
stage_mod._BatchCache.update = timed("kv_write", stage_mod._BatchCache.update)
_call = lean._Products.__call__
names: dict[int, str] = {}


def products(self, x):
    name = names.get(id(self), "products?")
    rows = x.shape[0] * x.shape[1]
    t0 = time.thread_time()
    out = _call(self, x)
    acc[name] += time.thread_time() - t0
    calls[name] += 1
    del rows
    return out


lean._Products.__call__ = products

stages = []
for lo, hi in zip(cut, cut[1:]):
    st = load_stage(md, lo, hi, weights="int4")
    for plan in st._lean_plans():
        for g in ("qkv", "o", "mlp_in", "mlp_down"):
            names[id(getattr(plan, g))] = "mm_" + g
    if st.lm_head is not None:
        st.lm_head.forward = timed("head", st.lm_head.forward)
    if st.embed_tokens is not None:
        st.embed_tokens.forward = timed("embed", st.embed_tokens.forward)
    stages.append(st)
vocab = stages[0].vocab_size
torch.manual_seed(0)
ids = torch.randint(0, min(vocab, 40000), (512,), dtype=torch.int64)


def new_kv(st):
    if pool_kind == "private":
        return st.new_kv(), None
    pool = st.new_pool(2 * 512 // 16 + 8)
    kv, other = st.new_kv(pool), st.new_kv(pool)
    for n in range(16, 513, 16):  # blocks taken in turn: neither session's is one run
        kv.reserve(n)
        other.reserve(n)
    return kv, other


# each stage's inputs per schedule: the previous stages' outputs, chunk by chunk
inputs: dict[str, list[list[torch.Tensor]]] = {}
with torch.inference_mode():
    for sched, sizes in SCHEDULES.items():
        chunks = list(torch.split(ids, sizes))
        per_stage = []
        for st in stages:
            per_stage.append(chunks)
            kv, _ = new_kv(st)
            chunks = [st.forward_batch([(c, kv)], heads=[False])[0] for c in chunks]
        inputs[sched] = per_stage


def run(si, sched):
    st = stages[si]
    kv, _other = new_kv(st)
    acc.clear()
    calls.clear()
    t0 = time.thread_time()
    chunks = inputs[sched][si]
    for i, c in enumerate(chunks):  # the head on the last chunk only, as the mesh's
        st.forward_batch([(c, kv)], last_only=True, heads=[i == len(chunks) - 1])
    total = time.thread_time() - t0
    return total, dict(acc)


best: dict[tuple[int, str], tuple[float, dict[str, float]]] = {}
for si in range(len(stages)):
    run(si, "taper")
    run(si, "1x512")
for _ in range(repeats):
    for si in range(len(stages)):
        for sched in SCHEDULES:
            total, parts = run(si, sched)
            key = (si, sched)
            if key not in best or total < best[key][0]:
                best[key] = (total, parts)
            else:  # per part, the best of the runs too
                old = best[key][1]
                for k, v in parts.items():
                    old[k] = min(old.get(k, v), v)

cols = ["embed", "norm", "mm_qkv", "rope", "kv_write", "attention", "mm_o", "mm_mlp_in",
        "silu", "mm_mlp_down", "head", "other"]
print(f"pool={pool_kind} cut={cut} repeats={repeats} (ms, thread CPU, best)")
print(f"{'stage':>10} {'sched':>6} {'total':>7} " + " ".join(f"{c[-8:]:>8}" for c in cols))
for si, st in enumerate(stages):
    for sched in SCHEDULES:
        total, parts = best[(si, sched)]
        parts = dict(parts)
        parts["other"] = total - sum(v for k, v in parts.items())
        row = " ".join(f"{parts.get(c, 0.0) * 1e3:8.1f}" for c in cols)
        print(f"[{cut[si]},{cut[si + 1]}) {sched:>6} {total * 1e3:7.1f} {row}")
grand = {s: sum(best[(si, s)][0] for si in range(len(stages))) for s in SCHEDULES}
print("all stages:", {s: round(v * 1e3, 1) for s, v in grand.items()})
