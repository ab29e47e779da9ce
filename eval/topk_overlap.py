"""How much of the exact top-k set the local top-k keeps, on random normal scores.

  ./dejavu run eval.topk_overlap --out eval/results/cpu/topk-overlap/topk_overlap.json

``kernels.top_k.top_k_indices_local`` keeps the top ``round(k / P)`` scores of each of P
chunks of ``--chunk`` (2048) scores. For every (n, k) this draws ``--trials`` score vectors
of n independent standard normal values and compares the local set (``impl="reference"``,
the jnp reference of the kernel, which returns the same ids) with

- ``exact``: ``kernels.top_k.top_k_indices`` (``impl="reference"``), the exact top-k of
  the same bfloat16-precision keys, ties to the lower id;
- ``lax``: ``jax.lax.top_k`` of the fp32 scores.

``overlap`` is |local ∩ exact| / k (the share of the exact set that the local set keeps),
``local_size`` is |local| (P * round(k / P), which can differ from k). The figures are for
scores without structure: a predictor whose large scores gather in a few chunks loses more.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax.kernels.top_k import local_top_k_shape, top_k_indices, top_k_indices_local

# neurons per layer (F) of the OPT sizes the benchmarks use, and SmolLM2-135M's
SIZES = {"opt-6.7b": 16384, "opt-13b": 20480, "opt-30b": 28672, "opt-66b": 36864,
         "smollm2-135m": 1536}


def overlap_row(n: int, k: int, trials: int, chunk: int, seed: int) -> dict:
    """Mean, min and max overlap of the local set with the exact sets over `trials` draws."""
    rng = np.random.default_rng(seed)
    exact, lax_, sizes = [], [], []
    for _ in range(trials):
        scores = jnp.asarray(rng.standard_normal(n), jnp.float32)
        local = top_k_indices_local(scores, k, chunk=chunk, impl="reference")
        local = set(np.asarray(local).tolist())
        ex = set(np.asarray(top_k_indices(scores, k, impl="reference")).tolist())
        lx = set(np.asarray(jax.lax.top_k(scores, k)[1]).tolist())
        exact.append(len(local & ex) / k)
        lax_.append(len(local & lx) / k)
        sizes.append(len(local))
    P, c, kc = local_top_k_shape(n, k, chunk)
    return dict(n=n, k=k, k_fraction=k / n, chunk=chunk, chunks=P, per_chunk=kc,
                local_size=int(np.median(sizes)), trials=trials,
                overlap_exact_mean=float(np.mean(exact)), overlap_exact_min=float(np.min(exact)),
                overlap_exact_max=float(np.max(exact)), overlap_lax_mean=float(np.mean(lax_)))


def _commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "*.py"],
                               capture_output=True, text=True).stdout  # code, not results
        return out + ("+uncommitted" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(SIZES), help="comma list of " + ", ".join(SIZES))
    p.add_argument("--fractions", default="0.05,0.1,0.25", help="k as a fraction of n")
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    rows = []
    for name in [m for m in a.models.split(",") if m]:
        if name not in SIZES:
            p.error(f"unknown model {name!r}; choose from {', '.join(SIZES)}")
        n = SIZES[name]
        for frac in [float(f) for f in a.fractions.split(",") if f]:
            k = max(1, round(n * frac))
            row = dict(model=name, **overlap_row(n, k, a.trials, a.chunk, a.seed))
            rows.append(row)
            print(f"{name:13s} n={n:6d} k={k:5d} ({frac:.0%}) chunks={row['chunks']:2d} "
                  f"local={row['local_size']:5d}  overlap with exact "
                  f"{row['overlap_exact_mean']:.4f} (min {row['overlap_exact_min']:.4f}), "
                  f"with lax.top_k {row['overlap_lax_mean']:.4f}", flush=True)
    args = list(sys.argv[1:] if argv is None else argv)
    meta = dict(command="python -m dejavu_jax.eval.topk_overlap " + " ".join(args),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=_commit(), python=platform.python_version(), jax=jax.__version__,
                jaxlib=getattr(__import__("jaxlib"), "__version__", None), numpy=np.__version__,
                device=str(jax.devices()[0].platform), scores="standard normal, float32",
                impl="reference")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
