"""Ad-hoc (cutF, issue 42 item 3): a prefill's chunks through a fixed cut on C cores.

    python3 docs/journal/2026-12-14-fast-cut-9f-sim.py [LAYERS] [OVERHEAD_MS] [MS_PER_LAYER_ROW]

(env ATT, LAYER_CHUNK and CORES override the 135M model's constants below; the 1B's:
ATT=0.00021 LAYER_CHUNK=3 with MS_PER_LAYER_ROW 1.5.)
LAYERS: each stage's decoder layers, e.g. ``12,12,6`` (the default model's decode cut
[0,13) [13,25) [25,32): the embedding and the head cost ~nothing in a prefill). The
stages share C=2 cores (processor sharing); a stage starts chunk k once it finished k-1
and its upstream finished k. A chunk of n rows after p held costs a stage
``layers * (n * row(n) + ATT * n * (p + n / 2) + LAYER_CHUNK)`` ms plus OVERHEAD_MS (the
node's trio thread a chunk: the frames in and out). Prints the makespan / the whole prefill on one core for schedules: today's,
:func:`hetmesh.partition.prefill.prefill_schedule`'s, and the best found by search.
"""

import itertools
import sys

sys.path.insert(0, ".")
layers = [float(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "12,12,6").split(",")]
overhead = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
per_row = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0965  # ms a layer a row (int4)
ATT = float(__import__("os").environ.get("ATT", "0.00006"))  # ms a layer a query a key (exact attention): 9f-ops, 8.2 ms a layer at 512
LAYER_CHUNK = float(__import__("os").environ.get("LAYER_CHUNK", "1.0"))  # ms a layer a chunk (9f-ops: 4 chunks cost 31-44 ms more than 1 a 12-layer stage)
CORES = float(__import__("os").environ.get("CORES", "2"))
TOTAL = 512


def row(n: int) -> float:
    """int4's cost a row by rows a product, relative to 128 (8d-rows: 64 rows +7 %)."""
    if n >= 128:
        return 1.0
    if n >= 64:
        return 1.0 + 0.07 * (128 - n) / 64
    return 1.07 + 0.10 * (64 - n) / 64


def cost(s: int, n: int, past: int) -> float:
    return layers[s] * (n * per_row * row(n) + ATT * n * (past + n / 2) + LAYER_CHUNK) + overhead


def sim(chunks: list[int]) -> float:
    S, K = len(layers), len(chunks)
    pasts = list(itertools.accumulate([0, *chunks[:-1]]))
    work = [[cost(s, chunks[k], pasts[k]) for k in range(K)] for s in range(S)]
    done = [[None] * K for _ in range(S)]
    nxt, left, t = [0] * S, [None] * S, 0.0
    while any(n < K for n in nxt):
        run = []
        for s in range(S):
            k = nxt[s]
            if k < K and (s == 0 or (done[s - 1][k] is not None and done[s - 1][k] <= t + 1e-12)):
                if left[s] is None:
                    left[s] = work[s][k]
                run.append(s)
        rate = min(1.0, CORES / len(run))
        dt = min(left[s] / rate for s in run)
        t += dt
        for s in run:
            left[s] -= dt * rate
            if left[s] <= 1e-9:
                done[s][nxt[s]] = t
                nxt[s] += 1
                left[s] = None
    return t


def whole() -> float:
    return sum(layers) * (TOTAL * per_row + ATT * TOTAL * TOTAL / 2)


def search(count: int, step: int = 8) -> tuple[float, list[int]]:
    """The best schedule of ``count`` chunks, sizes in multiples of ``step``: a coordinate
    descent from even chunks, moving ``step`` tokens between two chunks while it gains."""
    best = [TOTAL // count] * count
    best[-1] += TOTAL - sum(best)
    value = sim(best)
    improved = True
    while improved:
        improved = False
        for i, j in itertools.permutations(range(count), 2):
            for d in (step * 4, step):
                if best[i] - d < 16:
                    continue
                trial = list(best)
                trial[i] -= d
                trial[j] += d
                v = sim(trial)
                if v < value - 1e-9:
                    best, value, improved = trial, v, True
    return value, best


if __name__ == "__main__":
    from hetmesh.partition.prefill import prefill_schedule

    base = whole()
    print(f"layers {layers}, overhead {overhead} ms a chunk a stage, whole {base:.0f} ms")
    for name, ch in (
        ("1x512", [512]),
        ("4x128", [128] * 4),
        ("taper", prefill_schedule(512, 128, 4, stages=3, taper=True)),
    ):
        print(f"{name:>8} {ch} {sim(ch) / base:.3f}")
    candidates = {
        "5 tapered": [64, 128, 128, 128, 64],
        "5 even": [103, 103, 102, 102, 102],
        "5 mid": [80, 128, 128, 112, 64],
        "6 tapered": [51, 102, 103, 103, 102, 51],
        "8 tapered": [37, 73, 73, 73, 73, 73, 73, 37],
    }
    for name, ch in candidates.items():
        print(f"{name:>9} {ch} {sim(ch) / base:.3f}")
    for count in range(3, 9):
        value, ch = search(count)
        print(f"best of {count}: {ch} {value / base:.3f}")
