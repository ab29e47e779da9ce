#!/usr/bin/env bash
# H200: the OPT-13B batch x context table in one process (kernel_parity in it first).
# Otherwise: kernel_parity, then Llama-3-8B's activation-sparse step per layout and under
# block variants.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpus.csv
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
date -u > $OUT/date.txt
git rev-parse HEAD > $OUT/commit.txt 2>&1; git status --short >> $OUT/commit.txt 2>&1
if [[ "$name" == *H200* ]]; then
  timeout 575 python -m dejavu_jax.eval.bench_decode --models opt-13b --contexts 1024,4096,128 \
    --batch 1,4,16 --modes dense,sparse --mlp 0.1 --heads 0.5 --batch-policy shared,measured \
    --select local --loop-only --prefill-tokens 0 --steps 12 --parity /tmp/none.json --out $OUT/opt13 > $OUT/opt13.out 2>&1
  echo "exit $?" >> $OUT/opt13.out
else
  python -m dejavu_jax.eval.kernel_parity --out $OUT/kp > $OUT/kp.out 2>&1
  tail -2 $OUT/kp.out
  timeout 230 python -m dejavu_jax.eval.bench_thresholds --models llama3-8b --levels uniform:0.5,uniform:0 \
    --layouts unrolled,stacked --parity $OUT/kp/kernel_parity.json --out $OUT/lay > $OUT/lay.out 2>&1
  echo "exit $?"
  V="gu8:gate_up.max_row_blocks=8,gate_up.num_stages=4;guw8:gate_up.num_warps=8;qo2:qkv.max_row_blocks=2,o.max_row_blocks=2"
  timeout 200 python -m dejavu_jax.eval.bench_thresholds --models llama3-8b --levels uniform:0.5 \
    --block-variants "$V" --parity $OUT/kp/kernel_parity.json --out $OUT/var > $OUT/var.out 2>&1
  echo "exit $?"
  cat $OUT/lay.out $OUT/var.out | grep '^{"model"' | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r.get('layout'), r['levels'], r.get('blocks'), round(r['ms'],3), round(r['ms_loop'],3))"
fi
date -u >> $OUT/date.txt
