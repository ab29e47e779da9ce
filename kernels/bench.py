"""GPU benchmark of the sparse kernels against XLA dense and XLA gather.

Run on a GPU machine::

    python -m dejavu_jax.kernels.bench --quick            # one model, few points
    python -m dejavu_jax.kernels.bench --models opt-30b --densities 0.05,0.1,0.25 --batches 1
    python -m dejavu_jax.kernels.bench --check            # compiled Pallas vs reference
    python -m dejavu_jax.kernels.bench --tune             # block-size variants (OPT-30B MLP)

Method (docs/benchmarks.md, "Kernel benchmarks"): each measurement is one jitted
``fori_loop`` whose body makes several calls, each call's input chained on the
previous call's output (so XLA can neither merge nor hoist them).  Consecutive calls
use disjoint index sets, so between two reads of one weight row the other calls touch
more bytes than the 60 MB L2 (or one call alone already reads more than L2).  The
per-call time is the run's wall time over the number of calls; we report the median
of several runs.  "bytes" are the bytes that must be read: selected weight rows (and,
for attention, the selected heads' K/V up to ``pos``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from ._common import sm_count
from .head_attention import AttnConfig, head_sparse_attention_pallas, \
    head_sparse_attention_reference
from .sparse_mlp import MLPConfig, sparse_mlp_pallas, sparse_mlp_reference
from . import mosaic_gemv

MODELS = {  # name: (d, heads); F = 4d, hd = 128
    "opt-13b": (5120, 40),
    "opt-30b": (7168, 56),
    "opt-66b": (9216, 72),
}
HD = 128
L2_BYTES = 60e6
DENSITIES = (0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 0.8, 1.0)   # fractions of the F neurons
HEAD_FRACTIONS = (0.1, 0.25, 0.5, 1.0)                     # fractions of the heads
CONTEXTS = (128, 2048, 8192)
INTERPRET = False  # --interpret: CPU smoke test of this script with tiny shapes


# ----------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------

def chain_time(step, carry0, shared, sets, *, est_s, target_s=4e-3, reps=5,
               min_calls=24, max_calls=800):
    """Median seconds per call of ``carry = step(carry, shared, s)`` over ``s`` in ``sets``.

    The calls run inside one jitted fori_loop (body unrolled over ``sets``).
    ``est_s`` is a guess of one call's time, used to size the loop to ``target_s``.
    """
    m = len(sets)
    n = int(min(max_calls, max(min_calls, target_s / max(est_s, 1e-6))))
    R = max(1, math.ceil(n / m))

    @jax.jit
    def run(carry, shared, sets):
        def body(_, c):
            for s in sets:
                c = step(c, shared, s)
            return c
        return lax.fori_loop(0, R, body, carry)

    t0 = time.perf_counter()
    carry = jax.block_until_ready(run(carry0, shared, sets))   # compile + warm up
    chain_time.last_compile_s = time.perf_counter() - t0
    carry = jax.block_until_ready(run(carry, shared, sets))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(carry, shared, sets))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (R * m), carry


def disjoint_sets(n_total: int, k: int, *, seed: int, min_sets: int = 4, sort=True):
    """Index sets of size k: disjoint where possible (cycled to at least ``min_sets``)."""
    rng = np.random.default_rng(seed)
    n_disjoint = max(1, n_total // k)
    perm = rng.permutation(n_total)
    sets = []
    for i in range(max(min_sets, min(n_disjoint, 8))):
        j = i % n_disjoint
        if n_disjoint > 1:
            s = perm[j * k:(j + 1) * k]
        else:
            s = rng.permutation(n_total)[:k]
        sets.append(np.sort(s) if sort else s)
    return [jnp.asarray(s, jnp.int32) for s in sets]


def _rand(key, shape, dtype, scale):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


# ----------------------------------------------------------------------------
# MLP
# ----------------------------------------------------------------------------

def mlp_weights(d, seed=0, dtype=jnp.bfloat16):
    F = 4 * d
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return dict(w1=_rand(k[0], (F, d), dtype, d ** -0.5), b1=_rand(k[1], (F,), dtype, 0.1),
                w2t=_rand(k[2], (F, d), dtype, F ** -0.5), b2=_rand(k[3], (d,), dtype, 0.1))


def _renorm(y, x_dtype):
    # The chain needs no extra op: with these weight scales every step contracts
    # (gain < 1) and the biases keep the activations away from zero.
    return y.astype(x_dtype)


def bench_mlp_point(W, d, B, density, *, which, config=None, seed=0, residual=False):
    """Time one MLP variant: which in {"sparse", "gather", "dense", "slab", "mosaic"};
    `density` is the fraction of the F = 4d neurons read; returns dict. "slab": XLA's
    dense MLP over contiguous copies of K neurons' rows, the same bytes as a sparse call
    without a gather (what the memory system gives a read of that size). "mosaic": the
    same slabs (K rounded down to a multiple of 128) through the Mosaic GPU GEMVs of
    :mod:`.mosaic_gemv`, `config` a pair of their configs; the row records its largest
    difference from the slab step's output. residual (sparse): the
    output is added into fp32 residual rows in the launch, as a decode step does (half
    the input, so that the chain still contracts)."""
    F = 4 * d
    K = max(1, round(F * density))
    x0 = _rand(jax.random.PRNGKey(seed + 7), (B, d), jnp.bfloat16, 1.0)
    if which == "dense":
        sets = [jnp.zeros((1,), jnp.int32)] * 4
        K = F

        def step(x, W, s):
            h = jnp.dot(x, W["w1"].T, preferred_element_type=jnp.float32) + W["b1"]
            a = jnp.maximum(h, 0).astype(x.dtype)
            y = jnp.dot(a, W["w2t"], preferred_element_type=jnp.float32) + W["b2"]
            return _renorm(y, x.dtype)
    elif which in ("slab", "mosaic"):
        if which == "mosaic":
            K = max(128, K // 128 * 128)
        sets = [dict(w1=W["w1"][idx], b1=W["b1"][idx], w2t=W["w2t"][idx])
                for idx in disjoint_sets(F, K, seed=seed)]

        def slab_step(x, W, s):
            h = jnp.dot(x, s["w1"].T, preferred_element_type=jnp.float32) + s["b1"]
            a = jnp.maximum(h, 0).astype(x.dtype)
            y = jnp.dot(a, s["w2t"], preferred_element_type=jnp.float32) + W["b2"]
            return _renorm(y, x.dtype)

        def mosaic_step(x, W, s):
            rows_cfg, cols_cfg = config or MOSAIC_VARIANTS[0]
            h = mosaic_gemv.rows_gemv(s["w1"], x[0], rows_cfg, interpret=INTERPRET) + s["b1"]
            a = jnp.maximum(h, 0)
            y = mosaic_gemv.cols_gemv(a, s["w2t"], cols_cfg, interpret=INTERPRET) + W["b2"]
            return _renorm(y[None], x.dtype)

        step = slab_step if which == "slab" else mosaic_step
        if which == "mosaic":
            if B != 1:
                raise ValueError("the Mosaic GPU GEMVs take one row (B = 1)")
            max_diff = float(jnp.max(jnp.abs(
                jax.jit(mosaic_step)(x0, W, sets[0]).astype(jnp.float32)
                - jax.jit(slab_step)(x0, W, sets[0]).astype(jnp.float32))))
    elif which == "gather":
        sets = disjoint_sets(F, K, seed=seed)

        def step(x, W, idx):
            h = jnp.dot(x, W["w1"][idx].T, preferred_element_type=jnp.float32) + W["b1"][idx]
            a = jnp.maximum(h, 0).astype(x.dtype)
            y = jnp.dot(a, W["w2t"][idx], preferred_element_type=jnp.float32) + W["b2"]
            return _renorm(y, x.dtype)
    else:
        sets = disjoint_sets(F, K, seed=seed)

        def step(x, W, idx):
            res = 0.5 * x.astype(jnp.float32) if residual else None
            y = sparse_mlp_pallas(x, W["w1"], W["b1"], W["w2t"], W["b2"], idx, config=config,
                                  interpret=INTERPRET, residual=res)
            return _renorm(y, x.dtype)
    need = 2 * K * d * 2
    t, _ = chain_time(step, x0, W, sets, est_s=need / 3e12 + 8e-6)
    row = dict(kind="mlp", which=which, d=d, F=F, B=B, density=density, K=K,
               residual=bool(residual), bytes=need, time_us=t * 1e6, gbps=need / t / 1e9)
    if which == "mosaic":
        row.update(config=[dataclasses.asdict(c) for c in (config or MOSAIC_VARIANTS[0])],
                   max_diff_vs_slab=max_diff)
    else:
        row["config"] = None if config is None else dataclasses.asdict(config)
    return row


# ----------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------

def attn_weights(d, H, seed=0, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.PRNGKey(seed + 1), 8)
    s = d ** -0.5
    return dict(wq=_rand(k[0], (H, HD, d), dtype, s), bq=_rand(k[1], (H, HD), dtype, 0.1),
                wk=_rand(k[2], (H, HD, d), dtype, s), bk=_rand(k[3], (H, HD), dtype, 0.1),
                wv=_rand(k[4], (H, HD, d), dtype, s), bv=_rand(k[5], (H, HD), dtype, 0.1),
                wo=_rand(k[6], (d, H, HD), dtype, (H * HD) ** -0.5),
                bo=_rand(k[7], (d,), dtype, 0.1))


def dense_attention(x, W, kc, vc, pos):
    """XLA all-heads decode step (baseline): in-place cache update, masked softmax."""
    f32 = jnp.float32
    S = kc.shape[2]
    q = jnp.einsum("bd,hkd->bhk", x, W["wq"], preferred_element_type=f32) + W["bq"]
    k = jnp.einsum("bd,hkd->bhk", x, W["wk"], preferred_element_type=f32) + W["bk"]
    v = jnp.einsum("bd,hkd->bhk", x, W["wv"], preferred_element_type=f32) + W["bv"]
    kc = lax.dynamic_update_slice(kc, k[:, :, None].astype(kc.dtype), (0, 0, pos, 0))
    vc = lax.dynamic_update_slice(vc, v[:, :, None].astype(vc.dtype), (0, 0, pos, 0))
    s = jnp.einsum("bhk,bhsk->bhs", (q * HD ** -0.5).astype(kc.dtype), kc,
                   preferred_element_type=f32)
    s = jnp.where(jnp.arange(S) <= pos, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhs,bhsk->bhk", p.astype(vc.dtype), vc, preferred_element_type=f32)
    y = jnp.einsum("bhk,dhk->bd", o.astype(x.dtype), W["wo"], preferred_element_type=f32)
    return y + W["bo"], kc, vc


def bench_attn_point(W, d, H, B, ctx, frac, *, which, config=None, seed=0):
    """Time one attention variant: which in {"sparse", "dense"}; cache length = ctx; `frac`
    is the fraction of the heads read."""
    Kh = H if which == "dense" else max(1, round(H * frac))
    pos = ctx - 1
    kk = jax.random.split(jax.random.PRNGKey(seed + 3), 3)
    x0 = _rand(kk[0], (B, d), jnp.bfloat16, 1.0)
    kc = _rand(kk[1], (B, H, ctx, HD), jnp.bfloat16, 1.0)
    vc = _rand(kk[2], (B, H, ctx, HD), jnp.bfloat16, 1.0)
    posa = jnp.asarray(pos, jnp.int32)
    if which == "dense":
        sets = [jnp.zeros((1,), jnp.int32)] * 4

        def step(c, W, s):
            x, kc, vc = c
            y, kc, vc = dense_attention(x, W, kc, vc, posa)
            return _renorm(y, x.dtype), kc, vc
    else:
        sets = disjoint_sets(H, Kh, seed=seed)

        def step(c, W, hidx):
            x, kc, vc = c
            y, kc, vc = head_sparse_attention_pallas(
                x, W["wq"], W["bq"], W["wk"], W["bk"], W["wv"], W["bv"], W["wo"], W["bo"],
                kc, vc, posa, hidx, config=config, interpret=INTERPRET)
            return _renorm(y, x.dtype), kc, vc
    need = 4 * Kh * HD * d * 2 + 2 * B * Kh * ctx * HD * 2
    t, _ = chain_time(step, (x0, kc, vc), W, sets, est_s=need / 3e12 + 15e-6)
    return dict(kind="attn", which=which, d=d, H=H, B=B, ctx=ctx, frac=frac, Kh=Kh,
                bytes=need, time_us=t * 1e6, gbps=need / t / 1e9,
                config=None if config is None else dataclasses.asdict(config))


# ----------------------------------------------------------------------------
# correctness on the device
# ----------------------------------------------------------------------------

def check_on_device(log):
    """Compiled Pallas vs the jnp reference (fp32 math) on random inputs; returns rows."""
    rows = []
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))

    def rel(a, b):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    for (B, d, K, dt, gate) in [(1, 7168, 2867, jnp.bfloat16, False),
                                (8, 7168, 2867, jnp.bfloat16, False),
                                (1, 96, 1, jnp.float32, False), (3, 1536, 6144, jnp.float32, False),
                                (1, 5120, 777, jnp.bfloat16, True), (5, 576, 1536, jnp.bfloat16, True)]:
        F = 4 * d if d != 1536 else 6144
        r = lambda *s: rng.standard_normal(s).astype(np.float32)
        x = jnp.asarray(r(B, d), dt)
        w1 = jnp.asarray(r(F, d) / np.sqrt(d), dt)
        w2t = jnp.asarray(r(F, d) / np.sqrt(K), dt)
        wg = jnp.asarray(r(F, d) / np.sqrt(d), dt) if gate else None
        b1 = None if gate else jnp.asarray(r(F), dt)
        b2 = None if gate else jnp.asarray(r(d), dt)
        idx = jnp.asarray(rng.permutation(F)[:K], jnp.int32)
        act = "silu" if gate else "relu"
        out = jax.jit(lambda *a: sparse_mlp_pallas(*a, activation=act, w_gate=wg))(
            x, w1, b1, w2t, b2, idx)
        ref = jax.jit(lambda *a: sparse_mlp_reference(*a, activation=act, w_gate=wg))(
            x, w1, b1, w2t, b2, idx)
        e = rel(out, ref)
        ok = bool(np.isfinite(np.asarray(out, np.float32)).all() and e < (2e-2 if dt == jnp.bfloat16 else 1e-4))
        rows.append(dict(kind="mlp", B=B, d=d, F=F, K=K, dtype=str(np.dtype(dt)), gated=gate,
                         rel_err=e, ok=ok))
        log(f"check mlp B={B} d={d} F={F} K={K} {np.dtype(dt)} gated={gate}: rel {e:.2e} {'OK' if ok else 'FAIL'}")

    for (B, d, H, nkv, S, Kh, pos, dt, rope, mask) in [
            (1, 7168, 56, 56, 2048, 28, 2047, jnp.bfloat16, False, False),
            (8, 7168, 56, 56, 300, 13, 0, jnp.bfloat16, False, False),
            (2, 2048, 32, 8, 1000, 3, 517, jnp.bfloat16, True, True),
            (3, 576, 9, 3, 77, 2, 40, jnp.float32, True, False)]:
        hd = 128 if d >= 2048 else 64
        r = lambda *s: rng.standard_normal(s).astype(np.float32)
        args = [jnp.asarray(a, dt) for a in (
            r(B, d), r(H, hd, d) / np.sqrt(d), r(H, hd), r(nkv, hd, d) / np.sqrt(d), r(nkv, hd),
            r(nkv, hd, d) / np.sqrt(d), r(nkv, hd), r(H, hd, d) / np.sqrt(H * hd), r(d),
            r(B, nkv, S, hd), r(B, nkv, S, hd))]
        hidx = jnp.asarray(rng.permutation(nkv)[:Kh], jnp.int32)
        ang = rng.standard_normal(hd // 2)
        rp = (jnp.asarray(np.cos(np.r_[ang, ang]), jnp.float32),
              jnp.asarray(np.sin(np.r_[ang, ang]), jnp.float32)) if rope else None
        km = jnp.asarray(rng.random((B, S)) > 0.2) if mask else None
        kc0 = np.asarray(args[9], np.float32)
        o1, k1, v1 = jax.jit(lambda *a: head_sparse_attention_pallas(*a, rope=rp, kv_mask=km))(
            *args, jnp.asarray(pos, jnp.int32), hidx)
        o2, k2, v2 = jax.jit(lambda *a: head_sparse_attention_reference(*a, rope=rp, kv_mask=km))(
            *args, jnp.asarray(pos, jnp.int32), hidx)
        e = rel(o1, o2)
        ek = rel(k1, k2) + rel(v1, v2)
        sel = np.zeros(nkv, bool)
        sel[np.asarray(hidx)] = True
        untouched = bool(np.array_equal(np.asarray(k1, np.float32)[:, ~sel], kc0[:, ~sel]))
        ok = bool(e < (2e-2 if dt == jnp.bfloat16 else 1e-4) and ek < 1e-2 and untouched)
        rows.append(dict(kind="attn", B=B, d=d, H=H, n_kv=nkv, S=S, Kh=Kh, pos=pos,
                         dtype=str(np.dtype(dt)), rope=rope, mask=mask, rel_err=e,
                         cache_err=ek, untouched=untouched, ok=ok))
        log(f"check attn B={B} d={d} H={H} nkv={nkv} S={S} Kh={Kh} pos={pos} {np.dtype(dt)} "
            f"rope={rope} mask={mask}: rel {e:.2e} cache {ek:.1e} untouched={untouched} "
            f"{'OK' if ok else 'FAIL'}")
    return rows


# ----------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------

def _versions():
    v = dict(jax=jax.__version__, python=platform.python_version())
    try:
        import jaxlib
        v["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = "n/a (jax's bundled Triton lowering)"
    d = jax.devices()[0]
    v["device"] = getattr(d, "device_kind", str(d))
    return v


MOSAIC_VARIANTS = [   # (rows_gemv config, cols_gemv config)
    (mosaic_gemv.MosaicConfig(tile_out=128, max_steps=4),
     mosaic_gemv.MosaicConfig(tile_out=256, max_steps=4)),
    (mosaic_gemv.MosaicConfig(tile_out=64, max_steps=4),
     mosaic_gemv.MosaicConfig(tile_out=128, max_steps=4)),
    (mosaic_gemv.MosaicConfig(tile_out=128, tile_k=128, max_steps=2),
     mosaic_gemv.MosaicConfig(tile_out=128, tile_k=128, max_steps=2)),
]

TUNE_MLP = [
    MLPConfig(),
    MLPConfig(fc1_d_chunks=1, fc2_row_blocks=1),
    MLPConfig(fc1_d_chunks=2, fc2_row_blocks=4),
    MLPConfig(fc1_block_rows=8, fc2_block_rows=8),
    MLPConfig(fc1_block_rows=32, fc2_block_rows=32),
    MLPConfig(fc1_block_d=256, fc2_block_d=256),
    MLPConfig(fc1_block_d=1024, fc2_block_d=1024, num_warps=8),
    MLPConfig(num_warps=8),
    MLPConfig(num_warps=2),
    MLPConfig(target_programs=4 * sm_count()),
    MLPConfig(target_programs=16 * sm_count()),
    MLPConfig(num_stages=3),
]

TUNE_ATTN = [
    AttnConfig(),
    AttnConfig(block_s=32),
    AttnConfig(block_s=128),
    AttnConfig(target_programs=4 * sm_count()),
    AttnConfig(target_programs=16 * sm_count()),
    AttnConfig(num_warps=8, attn_num_warps=8),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="opt-30b, densities 0.05,0.1,0.25,0.5, batch 1, context 2048")
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma list of " + ", ".join(MODELS) + " (the shapes of their layers)")
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)),
                   help="MLP densities: fractions of the neurons, e.g. 0.05,0.1")
    p.add_argument("--head-fractions", default=",".join(map(str, HEAD_FRACTIONS)),
                   help="attention densities: fractions of the heads, e.g. 0.25,0.5,1")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--what", default="mlp,attn", help="comma list of mlp, attn")
    p.add_argument("--attn-models", default=None, help="models for attention (default --models)")
    p.add_argument("--attn-batches", default=None, help="batches for attention (default --batches)")
    p.add_argument("--baselines", default="dense,gather,slab",
                   help="comma list of dense, gather, slab (XLA's dense MLP over contiguous "
                        "copies of the selected rows: the same bytes without a gather), "
                        "mosaic (those copies through Mosaic GPU GEMVs, batch 1, "
                        "each of kernels.bench.MOSAIC_VARIANTS)")
    p.add_argument("--gather-batches", default="1", help="batches at which to time W[idx]@x")
    p.add_argument("--check", action="store_true", help="GPU correctness checks first")
    p.add_argument("--tune", action="store_true", help="time block-size variants first")
    p.add_argument("--tune-densities", default="0.05,0.1,0.25")
    p.add_argument("--no-sweep", action="store_true", help="skip the main sweep")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    p.add_argument("--tag", default="bench")
    p.add_argument("--time-limit-s", type=float, default=1e9,
                   help="start no new point after this many seconds (the rows so far are kept)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU smoke test: Pallas interpreter, tiny model shapes")
    from dejavu_jax.eval.parity_gate import add_parity_argument, require_parity
    add_parity_argument(p)
    a = p.parse_args(argv)
    if a.interpret:
        global INTERPRET
        INTERPRET = True
        MODELS.update({"opt-13b": (256, 2), "opt-30b": (384, 3), "opt-66b": (512, 4)})
    if a.quick:
        a.models, a.densities, a.batches, a.contexts = "opt-30b", "0.05,0.1,0.25,0.5", "1", "2048"
        a.head_fractions = "0.25,0.5,1"
    for name in a.models.split(",") + (a.attn_models or "").split(","):
        if name and name not in MODELS:
            p.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    for flag in ("densities", "head_fractions", "tune_densities"):
        for v in getattr(a, flag).split(","):
            try:
                ok = 0 < float(v) <= 1
            except ValueError:
                ok = False
            if not ok:
                p.error(f"--{flag.replace('_', '-')}: {v!r} is not a fraction in (0, 1] "
                        f"(e.g. 0.1 for 10%)")
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    parity = require_parity(a.parity, a.out)
    log_f = open(os.path.join(a.out, f"{a.tag}.log"), "a")

    def log(msg):
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    meta = dict(command="python -m dejavu_jax.kernels.bench " + " ".join(sys.argv[1:] if argv is None else argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                versions=_versions(), method=__doc__.split("Method")[1].strip(),
                kernel_parity=parity)
    log(json.dumps(meta["versions"]))
    res = dict(meta=meta, check=[], tune=[], mlp=[], attn=[])

    def save():
        with open(os.path.join(a.out, f"{a.tag}.json"), "w") as f:
            json.dump(res, f, indent=1)

    def over_time_limit():
        return time.time() - t_start > a.time_limit_s

    def guarded(fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:  # keep the sweep going; record the failure
            log(f"ERROR {fn.__name__} {args[1:]} {kw}: {type(e).__name__}: {str(e)[:800]}")
            log_f.write(traceback.format_exc() + "\n")
            return None

    if a.check:
        res["check"] = check_on_device(log)
        save()

    if a.tune:
        d, H = MODELS["opt-30b"]
        W = mlp_weights(d)
        for dens in [float(v) for v in a.tune_densities.split(",")]:
            for cfg in TUNE_MLP:
                if over_time_limit():
                    break
                r = guarded(bench_mlp_point, W, d, 1, dens, which="sparse", config=cfg)
                if r:
                    res["tune"].append(r)
                    log(f"tune mlp opt-30b B=1 density {dens:g}: {r['time_us']:8.1f} us "
                        f"{r['gbps']:7.0f} GB/s  {cfg}")
            save()
        del W
        W = attn_weights(d, H)
        for frac in (0.5, 1.0):
            for cfg in TUNE_ATTN:
                if over_time_limit():
                    break
                r = guarded(bench_attn_point, W, d, H, 1, 2048, frac, which="sparse", config=cfg)
                if r:
                    res["tune"].append(r)
                    log(f"tune attn opt-30b B=1 ctx2048 heads {frac:g}: {r['time_us']:8.1f} us "
                        f"{r['gbps']:7.0f} GB/s  {cfg}")
            save()
        del W

    if not a.no_sweep:
        models = [m for m in a.models.split(",") if m]
        batches = [int(b) for b in a.batches.split(",")]
        gather_b = [int(b) for b in a.gather_batches.split(",") if b]
        base = a.baselines.split(",")
        for mname in (models if "mlp" in a.what else []):
            d, H = MODELS[mname]
            if True:
                W = mlp_weights(d)
                for B in batches:
                    if over_time_limit():
                        break
                    dense = guarded(bench_mlp_point, W, d, B, 1.0, which="dense") \
                        if "dense" in base else None
                    if dense:
                        dense["model"] = mname
                        res["mlp"].append(dense)
                        log(f"mlp {mname} B={B} dense: {dense['time_us']:.1f} us "
                            f"{dense['gbps']:.0f} GB/s")
                    for dens in [float(v) for v in a.densities.split(",")]:
                        if over_time_limit():
                            break
                        sparse_row = None
                        variants = [("sparse", None), ("gather", None), ("slab", None)]
                        if "mosaic" in base and B == 1:
                            variants += [("mosaic", c) for c in MOSAIC_VARIANTS]
                        for which, cfg in variants:
                            if which == "gather" and ("gather" not in base or B not in gather_b):
                                continue
                            if which == "slab" and "slab" not in base:
                                continue
                            r = guarded(bench_mlp_point, W, d, B, dens, which=which, config=cfg)
                            if not r:
                                continue
                            r["model"] = mname
                            if dense:
                                r["speedup_vs_dense"] = dense["time_us"] / r["time_us"]
                                r["frac_of_dense_bw"] = r["gbps"] / dense["gbps"]
                            if which == "sparse":
                                sparse_row = r
                            if which == "slab" and sparse_row:
                                sparse_row["frac_of_slab_speed"] = r["time_us"] / sparse_row["time_us"]
                            res["mlp"].append(r)
                            log(f"mlp {mname} B={B} density {dens:<5g} {variant_label(r):6s}: "
                                f"{r['time_us']:8.1f} us {r['gbps']:7.0f} GB/s  "
                                f"x{r.get('speedup_vs_dense', float('nan')):.2f}"
                                + (f"  max diff vs slab {r['max_diff_vs_slab']:.3g}"
                                   if "max_diff_vs_slab" in r else ""))
                        save()
                del W
        attn_models = (a.attn_models or a.models).split(",") if "attn" in a.what else []
        for mname in [m for m in attn_models if m]:
            d, H = MODELS[mname]
            if True:
                W = attn_weights(d, H)
                for B in [int(b) for b in (a.attn_batches or a.batches).split(",")]:
                    for ctx in [int(c) for c in a.contexts.split(",")]:
                        if over_time_limit():
                            break
                        dense = guarded(bench_attn_point, W, d, H, B, ctx, 1.0, which="dense") \
                            if "dense" in base else None
                        if dense:
                            dense["model"] = mname
                            res["attn"].append(dense)
                            log(f"attn {mname} B={B} ctx={ctx} XLA dense: {dense['time_us']:.1f} us")
                        full = None
                        for frac in sorted([float(v) for v in a.head_fractions.split(",")],
                                           reverse=True):
                            r = guarded(bench_attn_point, W, d, H, B, ctx, frac, which="sparse")
                            if not r:
                                continue
                            r["model"] = mname
                            if frac == 1.0:
                                full = r
                            if full:
                                r["time_vs_all_heads"] = r["time_us"] / full["time_us"]
                            if dense:
                                r["speedup_vs_dense"] = dense["time_us"] / r["time_us"]
                            res["attn"].append(r)
                            log(f"attn {mname} B={B} ctx={ctx} heads {frac:<5g}: "
                                f"{r['time_us']:8.1f} us {r['gbps']:7.0f} GB/s "
                                f"vs-all {r.get('time_vs_all_heads', float('nan')):.2f} "
                                f"vs-XLA x{r.get('speedup_vs_dense', float('nan')):.2f}")
                        save()
                del W
    save()
    md = markdown_table(res)
    with open(os.path.join(a.out, f"{a.tag}.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"total {time.time() - t_start:.0f} s")


def variant_label(r) -> str:
    """An MLP row's variant, with the Mosaic GEMVs' tiles (rows/cols tile, contracted
    tile, pipeline depth)."""
    if r["which"] != "mosaic":
        return r["which"]
    rows, cols = r["config"]
    return (f"mosaic {rows['tile_out']}/{cols['tile_out']}, k {rows['tile_k']}, "
            f"{rows['max_steps']} deep")


def markdown_table(res):
    """Markdown summary of a result dict (meta, mlp and attn rows)."""
    m = res["meta"]
    v = m["versions"]
    out = [f"# Sparse kernel benchmark ({v.get('device')})", "",
           f"- command: `{m['command']}`", f"- date: {m['date']}",
           f"- versions: jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, triton {v.get('triton')}, "
           f"python {v.get('python')}", "- method: " + " ".join(m["method"].split()), ""]
    if res["check"]:
        ok = sum(r["ok"] for r in res["check"])
        out += [f"GPU correctness checks (compiled Pallas vs jnp reference): {ok}/{len(res['check'])} OK", ""]
    if res["mlp"]:
        out += ["## Sparse MLP (fc1 + fc2, bf16)", "",
                "| model | B | density | K | variant | MB needed | time µs | GB/s | × dense | % dense BW "
                "| % slab speed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["mlp"]:
            out.append(f"| {r.get('model')} | {r['B']} | {r['density']:g} | {r['K']} | {variant_label(r)} | "
                       f"{r['bytes'] / 1e6:.1f} | {r['time_us']:.1f} | {r['gbps']:.0f} | "
                       f"{r.get('speedup_vs_dense', float('nan')):.2f} | "
                       f"{100 * r.get('frac_of_dense_bw', float('nan')):.0f} | "
                       f"{100 * r.get('frac_of_slab_speed', float('nan')):.0f} |")
        out.append("")
    if res["attn"]:
        out += ["## Head-sparse decode attention (bf16, pos = ctx - 1)", "",
                "| model | B | ctx | heads | variant | MB needed | time µs | GB/s | ÷ all-heads | × XLA dense |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["attn"]:
            out.append(f"| {r.get('model')} | {r['B']} | {r['ctx']} | {r['Kh']}/{r['H']} | {r['which']} | "
                       f"{r['bytes'] / 1e6:.1f} | {r['time_us']:.1f} | {r['gbps']:.0f} | "
                       f"{r.get('time_vs_all_heads', float('nan')):.2f} | "
                       f"{r.get('speedup_vs_dense', float('nan')):.2f} |")
        out.append("")
    if res["tune"]:
        out += ["## Tuning variants (opt-30b, B=1)", "", "| kind | density/heads | time µs | GB/s | config |",
                "|---|---|---|---|---|"]
        for r in res["tune"]:
            c = {k: v for k, v in (r["config"] or {}).items()}
            out.append(f"| {r['kind']} | {r.get('density', r.get('frac'))} | {r['time_us']:.1f} | "
                       f"{r['gbps']:.0f} | `{c}` |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
