#!/usr/bin/env bash
# kernel_parity, then the host's and the device's spans of Llama-3-8B's activation-sparse
# step over stacked weights (every TEAL site at 50%), host-synchronised steps traced.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
date -u | tee $R/date.txt
timeout 200 python -m dejavu_jax.eval.kernel_parity --out $R/kp > $R/kp.out 2>&1
echo "kernel_parity exit $? at ${SECONDS}s"; tail -2 $R/kp.out
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout $(( 300 - SECONDS )) \
  python -m dejavu_jax.eval.profile_decode --model llama3-8b --modes threshold:uniform:0.5 \
  --layout stacked --context 128 --parity $R/kp/kernel_parity.json --out /tmp/prof > $R/prof.out 2>&1
echo "profile exit $? at ${SECONDS}s"; date -u >> $R/date.txt
cp /tmp/prof/profile.json $R/ 2>/dev/null
python - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "res", "profile.json")
if os.path.exists(p):
    for r in json.load(open(p))["rows"]:
        print({k: r.get(k) for k in ("mode", "layout", "ms_synced", "ms_device_loop",
                                     "launches_per_token", "device_busy_ms_per_token",
                                     "device_idle_ms_per_token")})
        for s in sorted(r.get("host_spans") or [], key=lambda s: -s["us"])[:25]:
            print("  ", s)
PY
