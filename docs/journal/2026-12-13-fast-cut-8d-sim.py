"""Processor-sharing model: S stages on C cores, chunks in order; makespan / whole work."""
import itertools
def sim(stage_units, chunks, cores=2, row_cost=lambda n: 1.0, overhead=0.0):
    total_units = sum(stage_units)
    S, K = len(stage_units), len(chunks)
    work = [[stage_units[s] * chunks[k] * row_cost(chunks[k]) + overhead for k in range(K)] for s in range(S)]
    done = [[None]*K for _ in range(S)]
    nxt = [0]*S; left = [None]*S; t = 0.0
    while any(n < K for n in nxt):
        run = []
        for s in range(S):
            k = nxt[s]
            if k < K and (s == 0 or (done[s-1][k] is not None and done[s-1][k] <= t + 1e-12)):
                if left[s] is None: left[s] = work[s][k]
                run.append(s)
        rate = min(1.0, cores / len(run))
        # next event: a running stage finishes, or an upstream finish enabling another
        dt = min(left[s] / rate for s in run)
        t += dt
        for s in run:
            left[s] -= dt * rate
            if left[s] <= 1e-9:
                done[s][nxt[s]] = t; nxt[s] += 1; left[s] = None
    whole = total_units * sum(chunks)
    return t / whole
units = [11, 13, 8 + 1.7]  # the head ~ 1.7 layers of prefill? (last token only: ~0)
units = [11, 13, 8]
rc = {32: 1.06, 64: 1.08, 96: 1.02, 128: 1.0, 256: 1.0, 512: 1.0}
f = lambda n: rc.get(n, 1.0)
for ch in ([512], [128]*4, [64]*8, [64,128,128,128,64], [32,96,128,128,96,32], [64,64,128,128,64,64], [96,160,160,96], [64,96,128,128,96], [32]*16, [128,128,128,64,64], [64, 128, 128, 192]):
    print(ch, round(sim(units, ch, row_cost=f), 3), "balanced:", round(sim([11,11,10], ch, row_cost=f), 3))
print("--- per-chunk overhead (units of layer-rows: 1 layer-row = 1.7s/32/512 = 0.1ms); 80 = 8 ms")
for oh in (0, 80, 200):
    for ch in ([128]*4, [85,171,171,85], [64,192,192,64], [64,128,128,128,64], [64]*8, [32,96,128,128,96,32], [48, 104, 104, 104, 104, 48]):
        print(oh, ch, round(sim(units, ch, row_cost=f, overhead=oh), 3))
