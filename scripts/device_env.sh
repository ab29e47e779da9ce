#!/usr/bin/env bash
# Source on a machine where the project cannot be pip-installed (the GPU image):
# lays out the dejavu_jax package with its mapped subpackages under /tmp/dj and puts it
# on PYTHONPATH.   usage: source scripts/device_env.sh
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf /tmp/dj && mkdir -p /tmp/dj/dejavu_jax
for f in "$root"/dejavu_jax/*; do ln -s "$f" /tmp/dj/dejavu_jax/; done
for sub in kernels train eval; do ln -s "$root/$sub" "/tmp/dj/dejavu_jax/$sub"; done
export PYTHONPATH=/tmp/dj${PYTHONPATH:+:$PYTHONPATH}
