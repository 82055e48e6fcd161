"""Ad-hoc (cutC, 2026-12-13): a stage's decode forward in a bare process, thread CPU a
token, as a node runs it (load_stage, int4, one thread, the stage's forward_batch on one
session), to hold beside the reader thread's CPU a token inside a node (8c-ab.py).

PYTHONPATH=. OMP_NUM_THREADS=1 python docs/journal/2026-12-13-fast-cut-8c-bare.py START END [TOKENS]
A stage starting at 0 takes token ids; a later one takes hidden states (random, fixed seed).
EVICT_MB=N: between two tokens (not timed) the thread reads and writes an N MiB buffer, as
the other stages' forwards on the same machine do to this one's weights in the caches.
HUGE=1: every weight tensor of 2 MiB or more is copied into memory advised for
transparent huge pages (madvise(MADV_HUGEPAGE) on an anonymous mapping) before the run.
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
MAPS = []


def arena(total: int) -> torch.Tensor:
    """``total`` bytes in a fresh anonymous mapping advised for huge pages, 2 MiB-aligned."""
    import mmap

    mm = mmap.mmap(-1, total + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    MAPS.append(mm)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    off = (-raw.data_ptr()) % (2 << 20)
    return raw[off : off + total]


if os.environ.get("HUGE") == "1":  # every weight of 4 KiB or more, packed in one arena
    found = []
    for mod in stage.modules():
        for name, t in list(mod.named_parameters(recurse=False)) + list(
            mod.named_buffers(recurse=False)
        ):
            if t is not None and t.nbytes >= 4096 and t.is_contiguous():
                found.append((mod, name, t))
    total = sum((t.nbytes + 63) // 64 * 64 for _, _, t in found)
    space, at = arena(total), 0
    with torch.no_grad():
        for mod, name, t in found:
            out = space[at : at + t.nbytes].view(t.dtype).view(t.shape)
            out.copy_(t.detach())
            at += (t.nbytes + 63) // 64 * 64
            if name in mod._parameters:
                mod._parameters[name] = torch.nn.Parameter(out, requires_grad=False)
            else:
                mod._buffers[name] = out
    moved = total
    with open("/proc/self/smaps_rollup") as f:
        print([x.strip() for x in f if x.startswith("AnonHugePages")], flush=True)
    print(f"huge pages: {moved >> 20} MiB moved", flush=True)
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
    f"EVICT_MB={os.environ.get('EVICT_MB', '0')} HUGE={os.environ.get('HUGE', '0')} [{START}, {END}): {statistics.median(cpu) * 1e3:.2f} ms median, "
    f"{statistics.mean(cpu) * 1e3:.2f} mean thread CPU a token over {TOKENS}"
)
