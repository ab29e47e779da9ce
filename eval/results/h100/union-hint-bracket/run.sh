#!/usr/bin/env bash
# A/B: "new" = the search near the row before's key (bracket/), then "old" = narrowed/hint.patch reversed, main's narrowed start (narrowed/).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=/tmp/device_results; mkdir -p $R
pack() { tar czf $OUT/device_results.tgz -C /tmp device_results; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
BENCH="--models opt-13b --contexts 128 --batch 4 --modes dense,sparse,fixed --mlp 0.1,0.4 --heads 0.5 --batch-policy union --select local --loop-only"
for v in new old; do
  [ $v = old ] && { patch -R -p1 < eval/results/h100/union-hint-bracket/narrowed/hint.patch > $R/patch.out 2>&1 || { echo patch failed; cat $R/patch.out; pack; exit 1; }; }
  python -c "from dejavu_jax.eval.provenance import code_fingerprint; print(code_fingerprint())" > $R/fp_$v.txt
  date -u +%FT%TZ > $R/date_$v.txt
  timeout 140 python -m dejavu_jax.eval.kernel_parity --out $R/kp_$v > $R/kp_$v.out 2>&1
  echo "$v kp exit $? $(grep -c '"ok": true' $R/kp_$v.out) ok, $(grep -c '"ok": false' $R/kp_$v.out) failed, fp $(cat $R/fp_$v.txt)"
  pack
  timeout 150 python -m dejavu_jax.eval.bench_decode $BENCH --parity $R/kp_$v/kernel_parity.json --out $R/b_$v > $R/b_$v.out 2>&1
  echo "$v bench exit $?"
  grep -o '{"model.*' $R/b_$v.out | python -c "
import sys, json
for l in sys.stdin:
    try: r = json.loads(l)
    except Exception: continue
    print(r['batch'], r.get('batch_policy'), r['mode'], r['mlp'], r['indices'], r.get('ms_loop'))"
  pack
done
