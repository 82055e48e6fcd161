#!/bin/sh
# cutF, for the lead's quiet rerun: four tapered prefill chunks (today) against five
# (64 / 128 / 128 / 128 / 64: HETMESH_PREFILL_MAX_CHUNKS=5 HETMESH_PREFILL_CHUNK_TOKENS=96),
# alternated, through bench/pipeline.py's cut only. MODEL=1b runs synth-llama-3.2-1b.
#   sh docs/journal/2026-12-14-fast-cut-9f-ab.sh [4 5 4 5]
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-/tmp/cutF-ab}
mkdir -p "$out"
if [ "${MODEL:-}" = 1b ]; then
  args="--repeats 1 --tokens 32 --model synth-llama-3.2-1b --prefix synth1b_"
else
  args="--repeats 3 --no-synth1b"
fi
i=0
for arm in ${*:-4 5 4 5}; do
  i=$((i + 1))
  if [ "$arm" = 5 ]; then set -- HETMESH_PREFILL_MAX_CHUNKS=5 HETMESH_PREFILL_CHUNK_TOKENS=96; else set --; fi
  echo "== $arm chunks $(date -u +%T) $(uptime)"
  # shellcheck disable=SC2086
  env "$@" OMP_NUM_THREADS=1 timeout 900 .venv/bin/python bench/pipeline.py --json \
    --no-replicas --no-single-process $args > "$out/bench_$i.json" 2>/dev/null
  python3 -c "
import json
t = open('$out/bench_$i.json').read()
d = json.loads(t[t.rindex('\n{') + 1:] if '\n{' in t else t[t.index('{'):])
print({k: d[k] for k in d if any(x in k for x in ('ttft', 'stages', 'identical'))})
"
done
echo "== end $(date -u +%T) $(uptime)"
