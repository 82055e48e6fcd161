#!/bin/sh
# taper on / off / on / off through bench/pipeline.py, the cut only
cd /work/wt/cutD
i=0
for arm in 1 0 1 0; do
  i=$((i+1))
  echo "== HETMESH_PREFILL_TAPER=$arm $(date -u +%T) $(uptime)"
  HETMESH_PREFILL_TAPER=$arm OMP_NUM_THREADS=1 timeout 400 .venv/bin/python bench/pipeline.py --json --no-replicas --repeats 2 --no-single-process --no-synth1b > /tmp/cutD/bench_$i.json 2>/dev/null
  python3 -c "
import json,sys
t=open('/tmp/cutD/bench_$i.json').read(); d=json.loads(t[t.rindex('\n{')+1:] if '\n{' in t else t[t.index('{'):])
print({k: d[k] for k in d if any(x in k for x in ('ttft', 'decode_ratio', 'gain_8', 'stages', 'identical', 'plan'))})
"
done
echo "== end $(date -u +%T) $(uptime)"
