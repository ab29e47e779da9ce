#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs the project with its test extras; ./dejavu runs
# it on first use and whenever pyproject.toml is newer than .venv/.dejavu-setup.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=$(pyenv versions --bare | grep -m1 '^3\.12') pyenv which python3.12 2>/dev/null)"; do
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  for cand in /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  echo "error: Python 3.12 not found; set PYTHON=/path/to/python3.12" >&2; return 1
}
PY=$(find_python)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# uv installs the same resolution as pip in a fifth of the time (parallel downloads and
# installs); pip does it where uv cannot be had.
if ! { .venv/bin/python -m pip install -q uv \
       && .venv/bin/python -m uv pip install -q --python .venv/bin/python -e ".[dev]"; }; then
  echo "setup: uv failed; installing with pip" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
fi
.venv/bin/python -c 'import jax, dejavu_jax; print("dejavu_jax ready: jax", jax.__version__)'
touch .venv/.dejavu-setup
