"""Ad-hoc (cutC, 2026-12-13): a stage's decode forward in a bare process, thread CPU a
token, as a node runs it (load_stage, int4, one thread, the stage's forward_batch on one
session), to hold beside the reader thread's CPU a token inside a node (8c-ab.py).

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-13-fast-cut-8c-bare.py START END [TOKENS]
A stage starting at 0 takes token ids; a later one takes hidden states (random, fixed seed).
EVICT_MB=N: between two tokens (not timed) the thread reads and writes an N MiB buffer, as
the other stages' forwards on the same machine do to this one's weights in the caches.
"""

import os

import statistics
import sys
import time

import torch

from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import resolve_model

START, END = int(sys.argv[1]), int(sys.argv[2])
TOKENS = int(sys.argv[3]) if len(sys.argv) > 3 else 200
torch.set_num_threads(1)
stage = load_stage(resolve_model(None), START, END, weights="native")
kv = stage.new_kv()
gen = torch.Generator().manual_seed(0)


def inputs(n: int) -> torch.Tensor:
    if stage.has_embed:
        return torch.randint(0, 1000, (n,), generator=gen)
    hidden = stage.config.hidden_size
    return torch.randn((n, hidden), generator=gen) * 0.5


EVICT = torch.ones(int(os.environ.get("EVICT_MB", "0")) << 18)  # float32: 4 bytes each

with torch.inference_mode():
    stage.forward_batch([(inputs(40), kv)], last_only=stage.has_head)
    cpu = []
    for _ in range(TOKENS):
        if EVICT.numel():
            EVICT.add_(1.0)
        t0 = time.thread_time()
        stage.forward_batch([(inputs(1), kv)], last_only=stage.has_head)
        cpu.append(time.thread_time() - t0)
print(
    f"EVICT_MB={os.environ.get('EVICT_MB', '0')} [{START}, {END}): {statistics.median(cpu) * 1e3:.2f} ms median, "
    f"{statistics.mean(cpu) * 1e3:.2f} mean thread CPU a token over {TOKENS}"
)
