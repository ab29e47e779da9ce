#!/usr/bin/env bash
# one run: kernel_parity on this tree and on a copy whose ThresholdConfig defaults
# to gated_down (in parallel), then the Llama-3-8B threshold step under block variants
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpus.csv
mkdir -p /tmp/flip && cp -r dejavu_jax kernels eval train scripts pyproject.toml /tmp/flip/
sed -i 's/^    gated_down: bool = False$/    gated_down: bool = True/' /tmp/flip/kernels/threshold_matvec.py
grep -n "gated_down: bool" /tmp/flip/kernels/threshold_matvec.py > $OUT/flip.txt
(cd /tmp/flip && python -m dejavu_jax.eval.kernel_parity --out $OUT/kp-flip > $OUT/kp-flip.out 2>&1) &
python -m dejavu_jax.eval.kernel_parity --out $OUT/kp > $OUT/kp.out 2>&1
wait
tail -2 $OUT/kp.out $OUT/kp-flip.out
V="gated:gated_down=1;gated64:gated_down=1,gate_up.row_blocks=4;deepdown:down.row_blocks=8,down.num_stages=4;gated-deepdown:gated_down=1,down.row_blocks=8,down.num_stages=4"
timeout 330 python -m dejavu_jax.eval.bench_thresholds --models llama3-8b --levels uniform:0.5 --block-variants "$V" --parity $OUT/kp/kernel_parity.json --out $OUT/l8 > $OUT/l8.out 2>&1
grep '^{"model"' $OUT/l8.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r.get('blocks'), round(r['ms'],3), round(r['ms_loop'],3))"
