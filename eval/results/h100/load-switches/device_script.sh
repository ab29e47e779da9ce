#!/usr/bin/env bash
# kernel_parity on this code (reused from the previous command on a warm machine), then the
# load switches against the defaults in one process per model: Llama-3-8B's activation-
# sparse step (every TEAL site at 50%) under each switch, OPT-30B's predictor step with the
# MLP pair's evict-first hint, Llama-3-8B's dense step synchronised per layout, Qwen2.5-7B
# under the switches. Everything lands in $OUT/res.tgz. Usage: final.sh [short]
set -u
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv
cp $R/gpus.csv $OUT/
date -u | tee $R/date.txt
finish() { date -u >> $R/date.txt; tar -C /tmp -czf $OUT/res.tgz res; ls -la $OUT; }
trap finish EXIT
left() { echo $(( ${1} - SECONDS )); }
END=${END:-585}
if [[ -f /tmp/kp/kernel_parity.json ]]; then
  echo "kernel_parity of the previous command on this machine reused" | tee $R/kp-reused.txt
  mkdir -p $R/kp; cp /tmp/kp/kernel_parity.json $R/kp/; cp /tmp/kp.out $R/ 2>/dev/null
  KP=/tmp/kp/kernel_parity.json
else
  timeout 200 python -m dejavu_jax.eval.kernel_parity --out $R/kp > $R/kp.out 2>&1
  echo "kernel_parity exit $? at ${SECONDS}s"; tail -2 $R/kp.out
  KP=$R/kp/kernel_parity.json
fi
S="qkv o gate_up down"
sw() { local f=$1 out=""; for s in $S; do out="$out,$s.$f=1"; done; echo "${out#,}"; }
V="evict:$(sw evict_first);cols:$(sw columns_first);partials:o.residual_atomics=0,down.residual_atomics=0;all:$(sw evict_first),$(sw columns_first),o.residual_atomics=0,down.residual_atomics=0"
echo "variants: $V" > $R/variants.txt
timeout $(( $(left $END) < 200 ? $(left $END) : 200 )) python -m dejavu_jax.eval.bench_thresholds \
  --models llama3-8b --levels uniform:0.5 --block-variants "$V" --parity $KP --out $R/l8 > $R/l8.out 2>&1
echo "l8 exit $? at ${SECONDS}s"
grep '^{"model"' $R/l8.out | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['mode'], r.get('blocks'), round(r['ms'],3), round(r['ms_loop'],3))"
# A switch set that took the chained step 2% or more below the defaults: kernel_parity on
# a copy whose defaults are that set (.carry/flip.py), so that the switch can become default
B=$(python - <<'PY'
import json
rows = [json.loads(l) for l in open("/tmp/res/l8.out") if l.startswith('{"model"')]
ms = {r["blocks"]: r["ms_loop"] for r in rows if r["mode"] == "threshold"}
names = {"evict": "evict_first", "cols": "columns_first", "partials": "residual_atomics",
         "all": "evict_first,columns_first,residual_atomics"}
best = None
if "default" in ms:
    for k, v in ms.items():
        if k in names and v <= 0.98 * ms["default"] and (best is None or v < ms[best]):
            best = k
print(names[best] if best else "")
PY
)
echo "switches to test as defaults: '${B}'" | tee $R/flip.txt
if [[ -n "$B" && $(left $END) -gt 150 ]]; then
  rm -rf /tmp/B; cp -r . /tmp/B; rm -rf /tmp/B/.carry
  python .carry/flip.py /tmp/B "$B" >> $R/flip.txt
  (cd /tmp/B && timeout $(( $(left $END) < 200 ? $(left $END) : 200 )) python -m dejavu_jax.eval.kernel_parity --out $R/kpB > $R/kpB.out 2>&1)
  echo "kernel_parity (flipped copy) exit $? at ${SECONDS}s"; tail -2 $R/kpB.out
fi
[[ "${1:-}" == short ]] && exit 0
timeout $(( $(left $END) < 130 ? $(left $END) : 130 )) python -m dejavu_jax.eval.bench_decode --models opt-30b \
  --contexts 128 --modes dense,sparse --mlp 0.1 --heads 0.5 --select local --loop-only \
  --mlp-config "base/evict_first=1" --parity $KP --out $R/o30 > $R/o30.out 2>&1
echo "o30 exit $? at ${SECONDS}s"; grep -o '"mlp_config[^}]*}\|"ms_loop": [0-9.]*' $R/o30/bench_decode.log 2>/dev/null | paste - - | head
timeout $(( $(left $END) < 100 ? $(left $END) : 100 )) python -m dejavu_jax.eval.bench_decode --models llama3-8b \
  --contexts 128 --layouts unrolled,stacked --modes dense --prefill-tokens 0 --parity $KP --out $R/l8dense > $R/l8dense.out 2>&1
echo "l8dense exit $? at ${SECONDS}s"
if [[ $(left $END) -gt 150 ]] && command -v ncu > /dev/null; then
  timeout 120 ncu --clock-control none -k regex:threshold --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section LaunchStats --section SchedulerStats -f -o /tmp/ncu_down \
    env PYTHONPATH=$PWD python .carry/ncu_down.py > $R/ncu.out 2>&1
  echo "ncu exit $? at ${SECONDS}s"
  ncu -i /tmp/ncu_down.ncu-rep --page details > $R/ncu_down.txt 2>&1
  grep -E "^  [a-z_]+|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Waves Per SM" $R/ncu_down.txt | head -60
fi
V2="evict:$(sw evict_first);all:$(sw evict_first),$(sw columns_first),o.residual_atomics=0,down.residual_atomics=0"
timeout $(( $(left $END) - 5 )) python -m dejavu_jax.eval.bench_thresholds \
  --models qwen2.5-7b --levels uniform:0.5 --block-variants "$V2" --parity $KP --out $R/q7 > $R/q7.out 2>&1
echo "q7 exit $? at ${SECONDS}s"
