#!/usr/bin/env bash
# kernel_parity, then batch 4 at context 128: the union selection against fixed sets of
# its size (OPT-13B) and the union and shared policies against dense (OPT-13B, OPT-30B).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=/tmp/device_results; mkdir -p $R
pack() { tar czf $OUT/device_results.tgz -C /tmp device_results; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
python -c "from dejavu_jax.eval.provenance import code_fingerprint; print(code_fingerprint())" > $R/fingerprint.txt
date -u +%FT%TZ > $R/date.txt
timeout 130 python -m dejavu_jax.eval.kernel_parity --out $R/kernel_parity > $R/kernel_parity.out 2>&1
echo "kp exit $? $(grep -c '"ok": true' $R/kernel_parity.out) ok, $(grep -c '"ok": false' $R/kernel_parity.out) failed, fp $(cat $R/fingerprint.txt)"
pack
COMMON="--contexts 128 --batch 4 --heads 0.5 --select local --loop-only --parity $R/kernel_parity/kernel_parity.json"
run() {  # name seconds args...
  local name=$1 secs=$2; shift 2
  timeout $secs python -m dejavu_jax.eval.bench_decode "$@" $COMMON --out $R/$name > $R/$name.out 2>&1
  echo "$name exit $?"
  grep -o '{"model.*' $R/$name.out | python -c "
import sys, json
for l in sys.stdin:
    try: r = json.loads(l)
    except Exception: continue
    print(r['model'], r['batch'], r['mode'], r['mlp'], r['indices'], r.get('ms_loop'))"
  pack
}
run opt-13b 150 --models opt-13b --modes dense,sparse,fixed --mlp 0.1,0.4 --batch-policy union,shared
[ "${1:-}" = all ] && run opt-30b 170 --models opt-30b --modes dense,sparse --mlp 0.1 --batch-policy union,shared
