#!/bin/sh
# Ad-hoc (the lead, 2026-12-15): bench/pipeline.py's cut (default model only), arms
# alternated: "0" as is, "N" with every node's trio (main) thread at nice N and its other
# threads at 0 (docs/journal/2026-12-15-lead-nice.sh beside it, root). Results appended
# to $OUT/log.   sh docs/journal/2026-12-15-lead-nice-ab.sh 0 10 0 10
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-/tmp/nab}
mkdir -p "$out"
i=0
for arm in "$@"; do
  i=$((i + 1))
  if [ "$arm" != 0 ]; then sh docs/journal/2026-12-15-lead-nice.sh "$arm" & W=$!; fi
  echo "== arm $arm $(date -u +%T) $(uptime)" >> "$out/log"
  OMP_NUM_THREADS=1 timeout 900 .venv/bin/python bench/pipeline.py --json --no-replicas \
    --no-single-process --no-synth1b > "$out/run$i.json" 2>/dev/null
  [ "$arm" != 0 ] && kill "$W"
  python3 -c "
import json; d = json.load(open('$out/run$i.json'))
keys = ('split_decode_ratio', 'split_ttft_ratio_512', 'split_concurrency_gain_8',
        'split_outputs_identical', 'split_reference_cpu_ms')
print('$arm', {k: d[k] for k in keys}, d['split_stage_cpu_ms'], d['split_stage_cpu_ms_8'], d['split_plan'])
" >> "$out/log"
done
echo "end $(date -u +%T)" >> "$out/log"
