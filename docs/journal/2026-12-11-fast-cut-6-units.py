"""Ad-hoc: what a decode step of the default model's units costs in one process (thread
CPU, int4, one torch thread): a block (stage [13,25) ÷ 12), the head (stage [25,32)
minus stage [25,31): the final norm and the int8 lm_head) and the embedding (stage
[0,13) minus 12 blocks); beside the planner's FLOPs for them (its head charge is the
head's FLOPs at the measured block's rate, cost.CostModel.head_extra_s).

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-11-fast-cut-6-units.py ROUNDS [PROMPT]
(PROMPT: the prompt's tokens before the 48 decode steps, default 30; the planner predicts
decode at half the nodes' --max-context: 512 for bench/pipeline.py's nodes)
"""

import json
import sys
import time

import torch

from hetmesh.partition.profile import model_profile
from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import resolve_model

torch.set_num_threads(1)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
PROMPT = int(sys.argv[2]) if len(sys.argv) > 2 else 30
md = resolve_model(None)
s0, s1 = load_stage(md, 0, 13), load_stage(md, 13, 25)
tail, whole = load_stage(md, 25, 31), load_stage(md, 25, 32)
prompt = torch.tensor([100 + i % 1000 for i in range(PROMPT)])


def run(steps: int, order: int) -> dict[str, float]:
    kv = {id(s): s.new_kv() for s in (s0, s1, tail, whole)}
    spent = {"s0": 0.0, "s1": 0.0, "tail": 0.0, "whole": 0.0}
    x = prompt
    h = s1.forward(s0.forward(x, kv[id(s0)]), kv[id(s1)])
    tail.forward(h, kv[id(tail)])
    tok = int(whole.forward(h, kv[id(whole)], last_only=True)[-1].argmax())
    for _ in range(steps):
        a = time.thread_time()
        h0 = s0.forward(torch.tensor([tok]), kv[id(s0)])
        b = time.thread_time()
        h1 = s1.forward(h0, kv[id(s1)])
        c = time.thread_time()
        spent["s0"] += b - a
        spent["s1"] += c - b
        pair = [("tail", tail, {}), ("whole", whole, {"last_only": True})]
        for name, stage, kw in pair[::order]:
            a = time.thread_time()
            out = stage.forward(h1, kv[id(stage)], **kw)
            spent[name] += time.thread_time() - a
            if name == "whole":
                tok = int(out[-1].argmax())
    return {k: v / steps * 1e3 for k, v in spent.items()}


runs = [run(48, 1 if r % 2 else -1) for r in range(ROUNDS)]
best = {k: min(r[k] for r in runs) for k in runs[0]}
med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
config = json.loads((md / "config.json").read_text())
units = model_profile(config).units  # FLOPs do not depend on the format
block = next(u for u in units if u.kind == "block")
head = next(u for u in units if u.kind == "head")
for label, f in (("best", best), ("median", med)):
    b = f["s1"] / 12
    print(
        f"{label}: [0,13) {f['s0']:.3f}  [13,25) {f['s1']:.3f}  [25,31) {f['tail']:.3f}  "
        f"[25,32) {f['whole']:.3f} ms | block {b:.3f}  head {f['whole'] - f['tail']:.3f} "
        f"({(f['whole'] - f['tail']) / b:.2f} blocks)  embed {f['s0'] - 12 * b:.3f} ms"
    )
print(f"planner: head FLOPs / block FLOPs = {head.flops_per_token / block.flops_per_token:.2f}")
