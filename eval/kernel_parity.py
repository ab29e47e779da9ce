"""Compiled kernels against the jnp references, on whatever device runs this.

  python -m dejavu_jax.eval.kernel_parity --out results/      # on the GPU: impl pallas

1. Sparse decode, teacher-forced for --steps tokens on tiny OPT and Llama presets (fp32
   weights), unrolled layers (the GPU layout: per-layer caches and input rings) and
   stacked, at density 1.0 and at MLP 0.3 / heads 0.5 with index sets that change every
   layer, missing-KV window 4: the largest |logit| and |K cache| difference between
   `--impl` kernels and the jnp references.
2. Top-k selection: the radix, chunked and local kernels return exactly their references'
   sets on random scores of MLP sizes.
3. Head-sparse attention with a missing-KV window whose needed entries are random (so
   selected heads attend to rewritten entries and refresh heads only write), MHA and GQA
   with rotary tables, rows rotated as in a ring: output and caches. In the batch case
   one head misses no earlier entry (its programs take the current-rows-only path).
4. The fused LayerNorm / RMSNorm (`kernels.layer_norm`, which every decode path uses on
   GPU, the reference runs of check 1 included), with and without its RMS-scaled second
   output, against its reference at model widths.
5. The split predictor's selection (`kernels.predictor_select`) returns its reference's
   sets at OPT-13B / 30B predictor sizes.
6. ("split") Batch-1 sparse decode on tiny OPT with the split predictor (local top-k),
   its selection riding in the MLP launches and in launches of its own, unrolled and
   stacked, against the reference step (sets and all): logits and K cache.

Writes kernel_parity.json and exits 1 when a difference exceeds --tol or a set differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import config as config_lib
from dejavu_jax import sparse
from dejavu_jax.eval.bench_decode import random_sets
from dejavu_jax.params import init_params, unstack_layers


def _decode(config, scfg, params, sets, steps: int, per_layer: bool,
            select=sparse.fixed_selector, batch: int = 2):
    eng = sparse.sparse_engine(config, scfg, select)
    ids = jnp.asarray([[5, 9, 14, 3, 7], [8, 2, 4, 11, 6]])[:batch]
    state = eng.init_state(batch, 64, jnp.float32, per_layer=per_layer)
    logits, state = jax.jit(eng.prefill)((params, sets), ids, jnp.ones_like(ids), state)
    step = jax.jit(eng.step)
    tokens = np.random.default_rng(1).integers(3, config.vocab_size, (steps, batch))
    out = []
    for t in range(steps):
        logits, state = step((params, sets), state, jnp.asarray(tokens[t], jnp.int32))
        out.append(np.asarray(logits))
    k = state.dense.k
    k = np.stack(k, axis=1) if isinstance(k, tuple) else np.asarray(k)
    return np.stack(out), k


def decode_rows(impl: str, steps: int) -> list[dict]:
    """Largest logit / K-cache differences, `impl` kernels against the references.

    XLA's own products (dense layers, LM head) run at full fp32 precision here: on the GPU
    they default to TF32, whose 10-bit rounding turns the kernels' 1e-6 differences into
    either nothing or ~1e-4 on a logit."""
    with jax.default_matmul_precision("highest"):
        return _decode_rows(impl, steps)


def _decode_rows(impl: str, steps: int) -> list[dict]:
    rows = []
    for preset in ("opt-tiny", "llama-tiny"):
        config = config_lib.preset(preset)
        params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
        for mlp, heads in ((1.0, 1.0), (0.3, 0.5)):
            # batch_dense=False: full sets at batch 2 would otherwise run XLA's dense layer
            scfg = dataclasses.replace(sparse.sparse_config(
                config, mlp, heads, dense_layers=1, kv_window=4), batch_dense=False)
            sets = random_sets(config, scfg, seed=3)
            for layout in ("unrolled", "stacked"):
                p = unstack_layers(params) if layout == "unrolled" else params
                per_layer = layout == "unrolled"
                ref = _decode(config, dataclasses.replace(scfg, impl="reference"), p, sets,
                              steps, per_layer)
                got = _decode(config, dataclasses.replace(scfg, impl=impl), p, sets, steps,
                              per_layer)
                rows.append(dict(check="decode", preset=preset, mlp=mlp, heads=heads,
                                 layout=layout, steps=steps,
                                 logits=float(np.abs(got[0] - ref[0]).max()),
                                 k_cache=float(np.abs(got[1] - ref[1]).max())))
    return rows


def split_rows(impl: str, steps: int) -> list[dict]:
    """The decode step with the split predictor (batch 1, local top-k; its selection riding
    in the MLP launches or in launches of its own) against the reference step."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    rows = []
    config = config_lib.preset("opt-tiny")
    params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
    preds = decode_predictors(random_predictors(config, 16, jax.random.key(1)))
    scfg = sparse.sparse_config(config, 0.3, 0.5, dense_layers=1, kv_window=4)
    with jax.default_matmul_precision("highest"):
        ref = _decode(config, dataclasses.replace(scfg, impl="reference"), params, preds,
                      steps, False, sparse.predictor_selector(1, method="local",
                                                              impl="reference"), batch=1)
        for ride in (True, False):
            for layout in ("unrolled", "stacked"):
                p = unstack_layers(params) if layout == "unrolled" else params
                select = sparse.predictor_selector(1, method="local", impl=impl,
                                                   ride_mlp_launches=ride)
                got = _decode(config, dataclasses.replace(scfg, impl=impl), p, preds, steps,
                              layout == "unrolled", select, batch=1)
                rows.append(dict(check="split", preset="opt-tiny", ride=ride, layout=layout,
                                 steps=steps, logits=float(np.abs(got[0] - ref[0]).max()),
                                 k_cache=float(np.abs(got[1] - ref[1]).max())))
    return rows


def top_k_rows(impl: str) -> list[dict]:
    """Whether each top-k kernel returns its reference's set."""
    from dejavu_jax.kernels.top_k import (top_k_indices, top_k_indices_chunked,
                                          top_k_indices_local)
    rows = []
    rng = np.random.default_rng(5)
    for n, k in ((28672, 2867), (20480, 2048), (1536, 154), (56, 28)):
        s = jnp.asarray(rng.standard_normal(n), jnp.float32)
        for name, fn in (("radix", top_k_indices), ("chunked", top_k_indices_chunked),
                         ("local", top_k_indices_local)):
            same = bool(np.array_equal(np.asarray(fn(s, k, impl=impl)),
                                       np.asarray(fn(s, k, impl="reference"))))
            rows.append(dict(check="top-k", method=name, n=n, k=k, equal=same))
    return rows


def window_rows(impl: str) -> list[dict]:
    """Largest output / cache difference of windowed head-sparse attention."""
    from dejavu_jax.kernels import KVWindow, head_sparse_attention
    rows = []
    rng = np.random.default_rng(7)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for B, d, H, n_kv, hd, S, W, pos, rope in ((1, 512, 8, 8, 64, 64, 16, 40, False),
                                              (2, 512, 8, 4, 64, 64, 16, 21, True),
                                              (1, 256, 4, 4, 64, 32, 16, 5, False)):
        hidx = jnp.asarray(rng.permutation(n_kv)[: n_kv // 2], jnp.int32)
        extra = jnp.asarray([int(np.setdiff1d(np.arange(n_kv), hidx)[0])], jnp.int32)
        raw = (pos - (pos - np.arange(W)) % W).astype(np.int32)      # ring order
        need = rng.random((B, len(hidx) + 1, W)) > 0.5
        need[:, :, raw == pos] = True
        need[:, :, raw < 0] = False
        if B > 1:   # head slot 0 misses nothing earlier: a batch multiplies its current rows
            need[:, 0, raw != pos] = False
        x = f(B, d)
        ring = f(B, W, d).at[:, pos % W].set(x)
        cos = sin = rope_now = None
        if rope:
            ang = f(B, W, hd // 2)
            cos = jnp.cos(jnp.concatenate([ang, ang], -1))
            sin = jnp.sin(jnp.concatenate([ang, ang], -1))
            rope_now = (cos[:, pos % W], sin[:, pos % W])
        window = KVWindow(x=ring, current=jnp.int32(pos % W), extra_ids=extra,
                          need=jnp.asarray(need), slots=jnp.asarray(np.maximum(raw, 0)),
                          cos=cos, sin=sin)
        w = [f(H, hd, d) * d ** -0.5, f(H, hd), f(n_kv, hd, d) * d ** -0.5, f(n_kv, hd),
             f(n_kv, hd, d) * d ** -0.5, f(n_kv, hd), f(d, H, hd) * (H * hd) ** -0.5, f(d)]
        caches = (f(B, n_kv, S, hd), f(B, n_kv, S, hd))
        got, ref = (head_sparse_attention(x, *w, *caches, jnp.int32(pos), hidx, rope=rope_now,
                                          impl=i, window=window) for i in (impl, "reference"))
        rows.append(dict(check="window", B=B, H=H, n_kv=n_kv, pos=pos, rope=rope,
                         out=float(jnp.abs(got[0] - ref[0]).max()),
                         k_cache=float(jnp.abs(got[1] - ref[1]).max()),
                         v_cache=float(jnp.abs(got[2] - ref[2]).max())))
    return rows


def norm_rows(impl: str) -> list[dict]:
    """Largest difference of the fused norm from its reference (fp32 output)."""
    from dejavu_jax.kernels.layer_norm import layer_norm
    rows = []
    rng = np.random.default_rng(6)
    for B, d, rms in ((1, 7168, False), (16, 5120, False), (1, 576, True), (3, 4096, True)):
        x = jnp.asarray(rng.standard_normal((B, d)) * 4 + 1, jnp.float32)
        scale = jnp.asarray(rng.standard_normal(d), jnp.float32)
        bias = None if rms else jnp.asarray(rng.standard_normal(d), jnp.float32)
        got, ref = (layer_norm(x, scale, bias, 1e-5, impl=i) for i in (impl, "reference"))
        rows.append(dict(check="norm", rows=B, d=d, rms=rms,
                         max_diff=float(jnp.abs(got - ref).max())))
        got, ref = (layer_norm(x, scale, bias, 1e-5, rms_dtype=jnp.float32, impl=i)
                    for i in (impl, "reference"))
        rows.append(dict(check="norm", kernel="layer_norm+rms", rows=B, d=d, rms=rms,
                         max_diff=max(float(jnp.abs(a - b).max()) for a, b in zip(got, ref))))
    return rows


def predictor_rows(impl: str) -> list[dict]:
    """Whether the split predictor's selection returns its reference's sets."""
    from dejavu_jax.kernels.predictor_select import predictor_select
    rows = []
    rng = np.random.default_rng(8)
    for F, H, r, k_mlp, k_heads in ((28672, 56, 256, 2867, 28), (20480, 40, 256, 2048, 20)):
        L = 3
        args = (rng.standard_normal((2, 1, 2 * r)), rng.standard_normal((L, 2 * r)),
                rng.standard_normal((L, r, F)) * r ** -0.5, rng.standard_normal((L, F)),
                rng.standard_normal((L, r, H)) * r ** -0.5, rng.standard_normal((L, H)))
        args = tuple(jnp.asarray(a, jnp.float32) for a in args[:2]) + tuple(
            jnp.asarray(a, jnp.bfloat16 if i % 2 == 0 else jnp.float32)
            for i, a in enumerate(args[2:]))
        got, ref = (predictor_select(*args, jnp.int32(1), k_mlp, k_heads, impl=i)
                    for i in (impl, "reference"))
        rows.append(dict(check="predictor", F=F, H=H, rank=r,
                         equal=bool(np.array_equal(np.asarray(got[0]), np.asarray(ref[0]))
                                    and np.array_equal(np.asarray(got[1]), np.asarray(ref[1])))))
    return rows


def main(argv=None) -> int:
    """Run the checks; print one JSON line per check; exit 1 on a failure."""
    p = argparse.ArgumentParser(prog="python -m dejavu_jax.eval.kernel_parity")
    p.add_argument("--impl", default="pallas", choices=("pallas", "interpret"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--checks", default="norm,window,decode,split,top-k,predictor",
                   help="comma list of norm, window, decode, split, top-k, predictor")
    p.add_argument("--out", default="eval/results/kernel_parity")
    args = p.parse_args(argv)
    checks = {"norm": lambda: norm_rows(args.impl), "window": lambda: window_rows(args.impl),
              "decode": lambda: decode_rows(args.impl, args.steps),
              "split": lambda: split_rows(args.impl, args.steps),
              "top-k": lambda: top_k_rows(args.impl),
              "predictor": lambda: predictor_rows(args.impl)}
    names = args.checks.split(",")
    unknown = [n for n in names if n not in checks]
    if unknown:
        p.error(f"unknown checks {unknown}; choose from {', '.join(checks)}")

    def passed(r) -> bool:
        if r["check"] in ("top-k", "predictor"):
            return r["equal"]
        if r["check"] == "norm":
            return r["max_diff"] <= args.tol
        if r["check"] == "window":
            return max(r["out"], r["k_cache"], r["v_cache"]) <= args.tol
        return max(r["logits"], r["k_cache"]) <= args.tol

    rows, ok = [], True
    for name in names:  # each check's rows print as it finishes (a run cut short keeps them)
        for r in checks[name]():
            r["ok"] = passed(r)
            ok &= r["ok"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, impl=args.impl,
                tol=args.tol)
    (out / "kernel_parity.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("all checks passed" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
