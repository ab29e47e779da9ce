#!/usr/bin/env bash
# Apply .carry/flip_$FLIP.patch (the kernels' defaults switched on), then kernel_parity on
# that code, then Llama-3-8B's activation-sparse step at 50% over stacked weights: the new
# defaults against the switches off, in one process.
set -u
export PYTHONUNBUFFERED=1
patch -p1 < .carry/flip_${FLIP}.patch || exit 4
R=$OUT/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
date -u | tee $R/date.txt
python -c "from eval.provenance import code_fingerprint; print(code_fingerprint())" | tee $R/fingerprint.txt
timeout 200 python -m dejavu_jax.eval.kernel_parity --out $R/kp > $R/kp.out 2>&1
echo "kernel_parity exit $? at ${SECONDS}s"; tail -2 $R/kp.out
KP=$R/kp/kernel_parity.json
V="${V:-off:attention_kernel=0,gated_kernel=0}"
echo "$V" > $R/variants.txt
timeout $(( ${END:-590} - SECONDS )) python -m dejavu_jax.eval.bench_thresholds --models ${MODELS:-llama3-8b,qwen2.5-7b} \
  --levels uniform:0.5 --layouts stacked --block-variants "$V" --parity $KP --out $R/l8 > $R/l8.out 2>&1
echo "l8 exit $? at ${SECONDS}s"; date -u >> $R/date.txt
grep '^{"model"' $R/l8.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['model'], r['mode'], r.get('blocks'), round(r['ms'],3), round(r['ms_loop'],3))"
