#!/usr/bin/env bash
# kernel_parity on this code, then Llama-3-8B's activation-sparse step at 50% over stacked
# weights: the defaults against the attention and gated-unit kernels switched on, and
# block variants of the input-sparse GEMVs; every row in one process.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
date -u | tee $R/date.txt
python -c "from eval.provenance import code_fingerprint; print(code_fingerprint())" | tee $R/fingerprint.txt
timeout 200 python -m dejavu_jax.eval.kernel_parity --out $R/kp > $R/kp.out 2>&1
echo "kernel_parity exit $? at ${SECONDS}s"; tail -2 $R/kp.out
KP=$R/kp/kernel_parity.json
V="${V:-on:attention_kernel=1,gated_kernel=1;attn:attention_kernel=1;gated:gated_kernel=1;on-qkv16:attention_kernel=1,gated_kernel=1,qkv.max_row_blocks=16,qkv.num_stages=4;deferred:qkv.deferred_sum=1,o.deferred_sum=1,gate_up.deferred_sum=1,down.deferred_sum=1;down19:down.row_blocks=19;down28:down.row_blocks=28;down14:down.row_blocks=14;down-partials:down.residual_atomics=0;down1024:down.block_n=1024;gu8:gate_up.max_row_blocks=8,gate_up.num_stages=4;gu16:gate_up.max_row_blocks=16,gate_up.num_stages=4;qkv8:qkv.max_row_blocks=8,qkv.num_stages=4;o8:o.max_row_blocks=8,o.num_stages=4}"
echo "$V" > $R/variants.txt
timeout $(( ${END:-590} - SECONDS )) python -m dejavu_jax.eval.bench_thresholds --models llama3-8b \
  --levels uniform:0.5 --layouts stacked --block-variants "$V" --parity $KP --out $R/l8 > $R/l8.out 2>&1
echo "l8 exit $? at ${SECONDS}s"; date -u >> $R/date.txt
grep '^{"model"' $R/l8.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r.get('blocks'), round(r['ms'],3), round(r['ms_loop'],3))"
