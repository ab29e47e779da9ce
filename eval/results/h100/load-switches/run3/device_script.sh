#!/usr/bin/env bash
# kernel_parity on this code, then in one process per model: OPT-30B's predictor step with
# the evict-first hint on the attention's and the MLP pair's weight loads (each, both),
# and Llama-3-8B's activation-sparse step at 40% and 50% per layout (synced and chained).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=/tmp/res; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
cp $R/gpus.csv $OUT/
date -u | tee $R/date.txt
finish() { date -u >> $R/date.txt; tar -C /tmp -czf $OUT/res.tgz res; ls -la $OUT; }
trap finish EXIT
left() { echo $(( ${1} - SECONDS )); }
END=${END:-588}
timeout 200 python -m dejavu_jax.eval.kernel_parity --out $R/kp > $R/kp.out 2>&1
echo "kernel_parity exit $? at ${SECONDS}s"; tail -2 $R/kp.out
KP=$R/kp/kernel_parity.json
mkdir -p /tmp/kp; cp $KP /tmp/kp/; cp $R/kp.out /tmp/kp.out
timeout $(( $(left $END) < 140 ? $(left $END) : 140 )) python -m dejavu_jax.eval.bench_decode --models opt-30b \
  --contexts 128 --modes dense,sparse --mlp 0.1 --heads 0.5 --select local --loop-only --prefill-tokens 0 \
  --compile-options "base/xla_gpu_enable_pdl=false/xla_gpu_enable_pdl=true+xla_gpu_enable_pdl_launch=true" \
  --parity $KP --out $R/o30pdl > $R/o30pdl.out 2>&1
echo "o30pdl exit $? at ${SECONDS}s"
grep '^{"model"' $R/o30pdl.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r['indices'], round(r['ms_loop'],3), r.get('logits_vs_base'))"
grep -i "pdl\|error" $R/o30pdl.out | head -5
timeout $(( $(left $END) < 170 ? $(left $END) : 170 )) python -m dejavu_jax.eval.bench_decode --models opt-30b \
  --contexts 128 --modes dense,sparse --mlp 0.1 --heads 0.5 --select local --loop-only --prefill-tokens 0 \
  --attn-config "base/evict_first=1" --mlp-config "base/evict_first=1" --parity $KP --out $R/o30 > $R/o30.out 2>&1
echo "o30 exit $? at ${SECONDS}s"
grep '^{"model"' $R/o30.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r['indices'], round(r['ms_loop'],3))"
timeout $(( $(left $END) - 3 )) python -m dejavu_jax.eval.bench_thresholds \
  --models llama3-8b --levels uniform:0.5 --layouts unrolled,stacked --parity $KP --out $R/l8 > $R/l8.out 2>&1
echo "l8 exit $? at ${SECONDS}s"
grep '^{"model"' $R/l8.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print({k: r.get(k) for k in ('mode', 'levels', 'layout', 'skipped', 'ms', 'ms_loop', 'x_dense_synced', 'x_dense_loop')})"
