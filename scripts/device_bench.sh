#!/usr/bin/env bash
# Run benchmark pieces on a GPU machine, each under its own timeout, and pack every result
# into one archive, device_results.tgz under $OUT (default /tmp): the results come back as
# one file.
#
#   bash scripts/device_bench.sh "NAME SECONDS [VAR=VALUE ...] MODULE ARGS..." [...]
#
# e.g. bash scripts/device_bench.sh \
#   "opt30b 280 eval.bench_decode --models opt-30b --contexts 128,1024 --mlp 0.1 --heads 0.5" \
#   "prof13 150 eval.profile_decode --model opt-13b --modes dense,sparse-predictor-chunked"
#
# Leading VAR=VALUE words set the piece's environment (e.g. one XLA_FLAGS=--flag=value).
# MODULE is run as `python -m dejavu_jax.MODULE ARGS --out RESULTS/NAME`; its output goes to
# RESULTS/NAME.out. A piece cut by its timeout keeps what it wrote (bench_decode rewrites its
# JSON after every row); profile traces stay behind (their summary is profile.json).
# Runs from the repository root with no install: dejavu_jax/__init__.py adds the checkout's
# root to the package path, so dejavu_jax.kernels / .train / .eval resolve to its folders.
# PYTHON picks the interpreter (default: python).
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
py=${PYTHON:-python}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} PYTHONUNBUFFERED=1
results=/tmp/device_results
mkdir -p "$results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$results/gpus.csv" 2>&1
for piece in "$@"; do
  read -r name seconds rest <<< "$piece"
  envs=()
  while [[ "$rest" =~ ^([A-Za-z_][A-Za-z0-9_]*=[^ ]*)\ +(.*)$ ]]; do
    envs+=("${BASH_REMATCH[1]}"); rest=${BASH_REMATCH[2]}
  done
  read -r module args <<< "$rest"
  echo "== $name ($seconds s): ${envs[*]} $py -m dejavu_jax.$module $args"
  # shellcheck disable=SC2086
  timeout "$seconds" env "${envs[@]}" "$py" -m "dejavu_jax.$module" $args \
    --out "$results/$name" > "$results/$name.out" 2>&1
  echo "   exit $? ; $(grep -c '^{' "$results/$name.out" 2>/dev/null) rows logged"
  # packed after every piece: a run cut short still returns what finished (traces: large)
  tar czf "${OUT:-/tmp}/device_results.tgz" --exclude="trace_*" -C /tmp device_results
done
echo "packed into ${OUT:-/tmp}/device_results.tgz"
