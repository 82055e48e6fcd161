# Reads the timestamp traces of the temporary marks described in 2026-12-08-fast-cut-4.md §1
# (/tmp/cut7/trace-PID.txt); argument: the first stage process id.
import glob, statistics, collections, sys
ev = []
for f in glob.glob("/tmp/cut7/trace-*.txt"):
    pid = f.split("-")[-1][:-4]
    for line in open(f):
        tag, t, c, tid = line.split()
        ev.append((int(t), pid, tag, int(c), tid))
ev.sort()
stats = collections.defaultdict(list)
last = {}  # (pid, tid) -> dict of last tag times
pending_sends = []  # (t, pid)
for t, pid, tag, c, tid in ev:
    k = (pid, tid); d = last.setdefault(k, {})
    if tag == "read":
        # hop: the latest send0 from another pid not yet matched
        for i, (ts, sp) in enumerate(pending_sends):
            if sp != pid:
                stats[f"hop {sp}->{pid}"].append((t - ts) / 1e3); del pending_sends[i]; break
    if tag == "fwd0" and "read" in d: stats[f"{pid} read->fwd0 wall"].append((t - d["read"][0]) / 1e3); stats[f"{pid} read->fwd0 cpu"].append((c - d["read"][1]) / 1e3)
    if tag == "fwd1" and "fwd0" in d: stats[f"{pid} fwd cpu"].append((c - d["fwd0"][1]) / 1e3); stats[f"{pid} fwd wall"].append((t - d["fwd0"][0]) / 1e3)
    if tag == "send0" and "fwd1" in d and d["fwd1"][0] > d.get("send1", (0,))[0]: stats[f"{pid} fwd1->send0 cpu"].append((c - d["fwd1"][1]) / 1e3)
    if tag == "send0" and "read" in d and d.get("fwd0", (0,))[0] < d["read"][0]: stats[f"{pid} read->send0 (no fwd) cpu"].append((c - d["read"][1]) / 1e3)
    if tag == "send1": stats[f"{pid} send syscall wall"].append((t - d["send0"][0]) / 1e3); stats[f"{pid} send syscall cpu"].append((c - d["send0"][1]) / 1e3)
    if tag == "send0": pending_sends.append((t, pid))
    pending_sends = [p for p in pending_sends if t - p[0] < 50e6]
    d[tag] = (t, c)
for k in sorted(stats):
    v = sorted(stats[k])
    if len(v) < 20: continue
    print(f"{k:<36} n={len(v):4d} min {v[0]:8.1f} p10 {v[len(v)//10]:8.1f} med {statistics.median(v):8.1f} µs")
# token cycle: between consecutive fwd0 at the first-stage process (the one with the largest fwd cpu... pick by arg)
first = sys.argv[1] if len(sys.argv) > 1 else None
if first:
    f0 = [t for t, pid, tag, c, tid in ev if pid == first and tag == "fwd0"]
    fw = [(t, pid, tag) for t, pid, tag, c, tid in ev if tag in ("fwd0", "fwd1")]
    periods, over = [], []
    import bisect
    times = [x[0] for x in fw]
    for a, b in zip(f0, f0[1:]):
        if b - a > 200e6: continue
        i = bisect.bisect_left(times, a); j = bisect.bisect_left(times, b)
        open_ = {}; tot = 0
        for t, pid, tag in fw[i:j]:
            if tag == "fwd0": open_[pid] = t
            elif pid in open_: tot += t - open_.pop(pid)
        periods.append((b - a) / 1e3); over.append((b - a - tot) / 1e3)
    for name, v in (("period", periods), ("period - forwards", over)):
        v = sorted(v); print(f"{name:<20} n={len(v)} min {v[0]:.0f} p10 {v[len(v)//10]:.0f} med {statistics.median(v):.0f} µs")
