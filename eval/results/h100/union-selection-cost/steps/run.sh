#!/usr/bin/env bash
# kernel_parity on the working tree's code, then OPT-13B batch 1 and 4 (union policy) at context 128.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=/tmp/device_results; mkdir -p $R
pack() { tar czf $OUT/device_results.tgz -C /tmp device_results; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
python -c "from dejavu_jax.eval.provenance import code_fingerprint; print(code_fingerprint())" > $R/fingerprint.txt
date -u +%FT%TZ > $R/date.txt
timeout 170 python -m dejavu_jax.eval.kernel_parity --out $R/kernel_parity > $R/kernel_parity.out 2>&1
echo "kp exit $? $(grep -c '"ok": true' $R/kernel_parity.out) ok, $(grep -c '"ok": false' $R/kernel_parity.out) failed, fp $(cat $R/fingerprint.txt)"
pack
timeout 150 python -m dejavu_jax.eval.bench_decode --models opt-13b --contexts 128 --batch 1,4 --modes dense,sparse --mlp 0.1 --heads 0.5 --batch-policy union --select local --loop-only --parity $R/kernel_parity/kernel_parity.json --out $R/bench > $R/bench.out 2>&1
echo "bench exit $?"
grep -o '{"model.*' $R/bench.out | python -c "
import sys, json
for l in sys.stdin:
    try: r = json.loads(l)
    except Exception: continue
    print(r['batch'], r['mode'], r['mlp'], r['indices'], r.get('ms_loop'))"
pack
