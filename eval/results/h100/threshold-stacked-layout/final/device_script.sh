#!/usr/bin/env bash
# kernel_parity on this tree, then Qwen2.5-7B's activation-sparse step over stacked weights.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpus.csv
date -u > $OUT/date.txt
python -m dejavu_jax.eval.kernel_parity --out $OUT/kp > $OUT/kp.out 2>&1
tail -2 $OUT/kp.out
timeout 105 python -m dejavu_jax.eval.bench_thresholds --models qwen2.5-7b --levels uniform:0.5 \
  --layouts stacked --parity $OUT/kp/kernel_parity.json --out $OUT/q7 > $OUT/q7.out 2>&1
echo "exit $?"
grep '^{"model"' $OUT/q7.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r.get('layout'), r['levels'], round(r['ms'],3), round(r['ms_loop'],3))"
date -u >> $OUT/date.txt
