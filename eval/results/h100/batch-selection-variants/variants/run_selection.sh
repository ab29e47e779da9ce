#!/bin/bash
# selection variants at OPT-13B batch 4: base (+ fc warps 8), row-at-a-time, chunk 1024
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpus.csv
B="--models opt-13b --modes dense,sparse --batch-policy union --select local --contexts 128 --batch 4 --heads 0.5 --loop-only"
fp() { python3 -c "from dejavu_jax.eval.provenance import run_meta; print(run_meta()['code_fingerprint'])"; }
run() {  # name, kp checks, extra bench args
  echo "== $1 fingerprint $(fp) $(date -u +%H:%M:%S)" >> $OUT/sel.out
  timeout 200 python3 -m dejavu_jax.eval.kernel_parity --checks $2 --out /tmp/kp-$1 >> $OUT/sel.out 2>&1
  echo "kp rc=$? $(date -u +%H:%M:%S)" >> $OUT/sel.out
  timeout 200 python3 -m dejavu_jax.eval.bench_decode $B $3 --parity /tmp/kp-$1/kernel_parity.json --out /tmp/b-$1 >> $OUT/sel.out 2>&1
  echo "bench rc=$? $(date -u +%H:%M:%S)" >> $OUT/sel.out
}
export DEJAVU_COMMIT=04143f8
run base norm,window,decode,split,batch-select,top-k,predictor,threshold "--mlp 0.1,0.4 --mlp-config base/num_warps=8"
patch -p1 < variants/row-at-a-time.patch >> $OUT/sel.out
export DEJAVU_COMMIT=04143f8+row-at-a-time
run rows decode,batch-select "--mlp 0.1"
patch -R -p1 < variants/row-at-a-time.patch >> $OUT/sel.out
patch -p1 < variants/chunk-1024.patch >> $OUT/sel.out
export DEJAVU_COMMIT=04143f8+chunk-1024
run chunk decode,batch-select "--mlp 0.1"
patch -R -p1 < variants/chunk-1024.patch >> $OUT/sel.out
