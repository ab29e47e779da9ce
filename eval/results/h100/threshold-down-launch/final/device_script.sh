#!/usr/bin/env bash
# kernel_parity on this code, then the threshold step at the default down blocks against
# the previous ones (up to 4 unrolled blocks), Llama-3-8B and Qwen2.5-7B shapes
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpus.csv
python -m dejavu_jax.eval.kernel_parity --out $OUT/kp > $OUT/kp.out 2>&1
tail -n 2 $OUT/kp.out
V="previous:down.max_row_blocks=4,down.num_stages=2"
timeout 230 python -m dejavu_jax.eval.bench_thresholds --models llama3-8b --levels uniform:0.5,uniform:0.4 --block-variants "$V" --parity $OUT/kp/kernel_parity.json --out $OUT/l8 > $OUT/l8.out 2>&1
timeout 150 python -m dejavu_jax.eval.bench_thresholds --models qwen2.5-7b --levels uniform:0.5 --block-variants "$V" --parity $OUT/kp/kernel_parity.json --out $OUT/q7 > $OUT/q7.out 2>&1
for m in l8 q7; do grep '^{"model"' $OUT/$m.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['model'], r['mode'], r['levels'], r.get('blocks'), round(r['ms'],3), round(r['ms_loop'],3))"; done
