"""Reads the CUT8_TRACE files of docs/journal/2026-12-09-fast-cut-5-trace.patch (stage server rounds) for the 8-stream phases that the -eight.py driver logged.

Usage: python docs/journal/2026-12-09-fast-cut-5-trace.py EIGHT_LOG TRACE_DIR [TRACE_DIR...]
"""
import sys, glob, re, collections
log = open(sys.argv[1]).read()
for d in sys.argv[2:]:
    arm = d.split("/")[-1]
    phases = []
    sec = log.split("CUT8_TRACE=" + d)[1].split("CUT8_TRACE=")[0]
    for a, b in re.findall(r"phase ([\d.]+)\.\.([\d.]+)", sec):
        phases.append((float(a), float(b)))
    wall = sum(b - a for a, b in phases)
    print("==", arm, f"8-stream wall {wall:.2f} s")
    for f in sorted(glob.glob(d + "/r-*.txt")):
        sizes = collections.Counter(); busy = gather = cpu = 0.0; nb = 0; items = 0
        for line in open(f):
            p = line.split()
            t0, t1, t2, c = map(float, p[:4])
            if not any(a <= t1 <= b for a, b in phases): continue
            nb += 1; busy += t2 - t1; gather += t1 - t0; cpu += c
            for r in p[4:]:
                n, t = r.split(":"); sizes[int(n)] += 1; items += int(n)
        print(f"  {f.split('/')[-1]}: batches {nb}, items {items}, rounds by size {dict(sorted(sizes.items()))}, busy {busy/wall:.2f} of the wall (device CPU {cpu/wall:.2f}), waiting {gather/wall:.2f}; per batch busy {busy/nb*1e3:.2f} ms, device CPU {cpu/nb*1e3:.2f} ms, per item {cpu/items*1e3:.2f} ms")
