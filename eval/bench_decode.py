"""Decode latency benchmark: dense (ours) against DejaVu sparse (ours) and Hugging Face peers.

  python -m dejavu_jax.eval.bench_decode --models opt-6.7b,opt-13b --contexts 128,1024 \
      --batch 1,4,16 --modes dense,sparse,hf-eager,hf-compiled \
      --mlp 0.05,0.1,0.15 --heads 0.25,0.5,1.0 --out results/

Random weights (bf16) and random predictors of rank `--rank`. Modes:
  dense        our dense decode step (`generation.dense_engine`)
  sparse       our sparse engine per (--mlp, --heads) density: one row per predictor top-k
               method (`--select`)
  fixed        the sparse engine with precomputed index sets (`indices=fixed`, no
               predictor) at head density 0.5 and the first context, which isolates the
               predictor's cost
  hf-eager     transformers, eager PyTorch with its dynamic cache (`bench_hf`)
  hf-compiled  transformers, static cache + torch.compile(mode="reduce-overhead")
The HF modes run in a child process (`bench_hf.py`, under `--hf-python`) before JAX
touches the accelerator, since JAX preallocates most of its memory; without torch they are
skipped with a log line.

Every row of ours reports (`measure_engine`): `ms` / `p90_ms`, ms per token with the host
synchronising after every step; `ms_loop`, ms per token with `--steps` steps chained in one
jitted `lax.fori_loop` (no host round trip; the difference is launch and sync overhead);
with `--host-choice`, `ms_host`: the same loop with every token chosen on the host (the
logits' argmax, by a callback from the loop: `host_choice`); `prefill_ms`; compile seconds (`compile_s`, split into prefill, step and loop); the device
peak memory (`peak_bytes`; a process-lifetime peak, null on CPU) and XLA's estimate for the
step (`step_peak_bytes`); the bytes a step must read (`step_bytes`), and GB/s and tokens/s
from `ms_loop`. Bandwidth is reported against two references: the device's specified
memory bandwidth (`spec_gbs`, e.g. 4,800 GB/s on an H200; None where unknown) and
`best_gbs`, the fastest large device-to-device copy or dense GEMV measured in the same run
(`measure_best_bandwidth`; every form in `best_detail`). Speedups: sparse against dense-ours of the same
(model, context, batch), and every row of ours against the HF rows of the same setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dejavu_jax import cli
from dejavu_jax import config as config_lib
from dejavu_jax import sparse
from dejavu_jax.batch_plan import chained_loop, held_context
from dejavu_jax.eval import bench_hf, common
from dejavu_jax.eval.common import device_free_bytes
from dejavu_jax.sparse_variants import (TOP_K_VARIANTS, UNION_HEADS, is_selector_name,
                                        variant_selector, without_kv_recompute)
from dejavu_jax.eval.bench_hf import cache_len
from dejavu_jax.eval.parity_gate import add_parity_argument, require_parity
from dejavu_jax.eval.provenance import run_meta
from dejavu_jax.host_choice import host_argmax, raise_failed_choice
from dejavu_jax.params import fuse_qkv, init_params, param_bytes, unstack_layers
from dejavu_jax.train.predict import default_union_size
from dejavu_jax.train.predictor_model import Predictor, PredictorParams, decode_predictors

BF16 = jnp.bfloat16
OURS = ("dense", "sparse", "fixed")
MODES = OURS + bench_hf.HF_MODES


@functools.partial(jax.jit, static_argnums=(0, 1))
def random_predictors(config, rank: int, key) -> PredictorParams:
    """Random bf16 predictors of the shapes a trained set would have."""
    L, d = config.n_layers, config.hidden
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def one(ka, kb, n):
        return Predictor(mean=jnp.zeros((L, d), jnp.float32), inv_std=jnp.ones((L, d), jnp.float32),
                         w1=(jax.random.normal(ka, (L, d, rank)) * d ** -0.5).astype(BF16),
                         w2=(jax.random.normal(kb, (L, rank, n)) * rank ** -0.5).astype(BF16),
                         b2=jnp.zeros((L, n), jnp.float32))

    return PredictorParams(mlp=one(k1, k2, config.ffn), heads=one(k3, k4, config.n_heads))


def layer_rows(rng, n: int, ks, width: int) -> np.ndarray:
    """[len(ks), width] ids in [0, n): row l starts with a sorted random ks[l]-subset (what
    `sparse.fixed_selector` reads for layer l) and goes on with other distinct ids."""
    rows = []
    for k in ks:
        perm = rng.permutation(n)[:width]
        rows.append(np.concatenate([np.sort(perm[:k]), perm[k:]]))
    return np.stack(rows)


def random_sets(config, scfg, seed: int = 0, per_layer: bool = False,
                row_heads: int | None = None):
    """Random index sets per layer, each layer's first k (its own density) sorted:
    (neurons [L, Kmax], query heads [L, Khmax]), or with per_layer tuples of each layer's
    own [k] arrays (`sparse.fixed_selector`). row_heads=B: each of B batch rows its own
    heads, [L, B, Khmax] (per_layer: [B, k] arrays)."""
    rng = np.random.default_rng(seed)
    neurons = layer_rows(rng, config.ffn, scfg.mlp_k, max(scfg.mlp_k))
    heads = layer_rows(rng, config.n_heads, scfg.head_k, max(scfg.head_k))
    if row_heads is not None:
        heads = np.stack([heads] + [layer_rows(rng, config.n_heads, scfg.head_k,
                                               max(scfg.head_k))
                                    for _ in range(row_heads - 1)], axis=1)
    if per_layer:
        return (tuple(jnp.asarray(neurons[l, :k], jnp.int32) for l, k in enumerate(scfg.mlp_k)),
                tuple(jnp.asarray(heads[l, ..., :k], jnp.int32)
                      for l, k in enumerate(scfg.head_k)))
    return jnp.asarray(neurons, jnp.int32), jnp.asarray(heads, jnp.int32)


def select_method(config, method: str):
    """The predictor selector of a --select entry: "exact" or "local", a benchmark variant
    (`dejavu_jax.sparse_variants`), optionally with the suffix "-apart" (the split
    selector's score product and selection in launches of their own rather than riding in
    the MLP's launches)."""
    return variant_selector(config.group_size, method)


def sparse_row_kinds(config, preds, select_methods, fixed_sets=None,
                    diagnose_kv_recompute=False):
    """(row label, selector, selector params) for the sparse rows of one setting.

    One predictor row per top-k method; with fixed_sets, a row with precomputed indices
    (and optionally the same without missing-KV recomputation, a diagnostic).
    """
    variants = [(f"predictor-{m}", select_method(config, m), preds) for m in select_methods]
    if fixed_sets is not None:
        variants.append(("fixed", sparse.fixed_selector, fixed_sets))
        if diagnose_kv_recompute:
            variants.append(("fixed/no-kv-recompute", sparse.fixed_selector, fixed_sets))
    return variants


def step_bytes(config, scfg, context: int, batch: int, rank: int, predictors: bool,
               row_heads: bool = True) -> int:
    """Bytes (bf16) a decode step must read at least.

    Every weight a step uses, once: the LM head (the embedding when tied), project_in/out,
    the final norm; per layer both norms, the q/o rows of the selected query heads, the k/v
    rows of the KV groups holding them (counted as min(Hk, k) groups, every group k query
    heads can touch: exact for multi-head models, an upper bound where selected heads
    share a group), their biases, `bo`, the selected neurons' `w_in` (`w_gate`),
    `w_out_t` rows and `b_in`, and `b_out`. Gathered rows: the `batch` embedding rows of the
    new tokens and (OPT) their position rows. Those KV groups' K and V over `context`
    tokens per row (the new token's and the cache's padding slots are not counted), and, for
    predictor rows, both predictors of every sparse layer. scfg None: dense. At density 1.0
    this is the model's weight bytes minus the position table plus the gathered rows plus
    the KV (tests/test_bench.py checks it against the parameter arrays).

    Predictor rows with batch > 1 read the union's static capacity of neurons
    (`train.predict.default_union_size`); fixed-index rows read their k neurons for every
    batch. Heads are per row at batch > 1 (both kinds): the weights of their union's
    capacity, each row's K and V of its own groups (row_heads False: a predictor row's
    heads are the union's for every row). Under the "shared" batch policy a predictor row
    reads one set of k neurons and k heads for the whole batch, each row the K and V of
    those heads' groups. Where `sparse.batch_dense_parts` runs
    a batch's attention or MLP dense, every head or neuron is read; a layer it runs dense
    reads no predictor.
    """
    c = config
    d, E, hd = c.hidden, c.embed_dim, c.head_dim
    layer_norm = c.family == "opt"
    total = c.vocab_size * E + batch * E  # LM head; embedding rows of the new tokens
    if c.family == "opt":
        total += batch * d  # learned position rows
    if c.has_projections:
        total += 2 * d * E
    if c.final_norm:
        total += d * (2 if layer_norm else 1)
    mlp_mats = 3 if c.gated_mlp else 2
    shared = (predictors and batch > 1 and scfg is not None
              and scfg.batch_policy == "shared")
    for layer in range(c.n_layers):
        km = c.ffn if scfg is None else scfg.mlp_k[layer]
        kh = c.n_heads if scfg is None else scfg.head_k[layer]
        if predictors and batch > 1 and not shared:
            km = default_union_size(c.ffn, km, batch)
            if not row_heads:
                kh = default_union_size(c.n_heads, kh, batch)
        dense_layer = False
        mode = scfg.batch_layers[layer] if scfg is not None and batch > 1 and \
            scfg.batch_layers else None
        if mode == "dense":
            km, kh, dense_layer = c.ffn, c.n_heads, True
        elif scfg is not None:
            attention, dense_mlp, dense_layer = sparse.batch_dense_parts(
                c, sparse.planned_config(scfg, mode), km, kh, batch)
            km = c.ffn if dense_mlp else km  # XLA's dense MLP, the other neurons masked
            kh = c.n_heads if attention else kh
        kh_row = kh
        if not shared:
            kh = default_union_size(c.n_heads, kh, batch)  # the rows' union: weights
        kg = min(c.n_kv_heads, kh)  # the KV groups of kh query heads, at most
        kg_row = min(c.n_kv_heads, kh_row)
        total += 2 * d * (2 if layer_norm else 1)  # attention and MLP norms
        total += (2 * kh + 2 * kg) * hd * d  # q and o of the query heads, k and v
        if c.attention_bias:
            total += (kh + 2 * kg) * hd + d  # bq, bk, bv; bo
        total += km * mlp_mats * d
        if c.mlp_bias:
            total += km + d  # b_in of the selected neurons; b_out
        total += batch * kg_row * 2 * context * hd  # K and V of each row's own groups
        if (predictors and scfg is not None and layer >= scfg.dense_layers
                and not dense_layer):
            # both predictors in decode form (`decode_predictors`): w1t [2r, d] and
            # w2 [r, n] bf16, b1 [2r] and b2 [n] fp32 (2 bf16 units each), n = ffn, n_heads
            total += 2 * d * rank + rank * (c.ffn + c.n_heads)
            total += 2 * (2 * rank + c.ffn + c.n_heads)
    return total * 2


SPEC_GBS = {"NVIDIA H200": 4800.0, "NVIDIA H100 80GB HBM3": 3350.0}


def spec_bandwidth(device_kind: str) -> float | None:
    """The device's specified memory bandwidth in GB/s, None where unknown."""
    return SPEC_GBS.get(device_kind)


def measure_best_bandwidth(gb: float = 4.0, detail: dict | None = None) -> float:
    """GB/s of the fastest of four large memory-bound operations over `gb` GB of bf16 (all
    in `detail`): a device-to-device copy (`w + 1`, bytes read plus written), a square
    `W @ x` and `x @ W` (median of 20 synchronised calls each), and "chain": a decode-like
    chain of [4·n, n] GEMVs (n = 4096) whose output feeds the next, in one jitted call
    (median of 5)."""
    n = int((gb * 1e9 / 2) ** 0.5) // 128 * 128
    w = jax.random.normal(jax.random.key(0), (n, n), BF16)
    x = jax.random.normal(jax.random.key(1), (n,), BF16)
    rates = {}

    def median_rate(f, args, nbytes, reps):
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t)
        return nbytes / float(np.median(times)) / 1e9

    for label, f in (("W@x", jax.jit(lambda w, x: w @ x)), ("x@W", jax.jit(lambda w, x: x @ w))):
        rates[label] = median_rate(f, (w, x), n * n * 2, 20)
    rates["copy"] = median_rate(jax.jit(lambda w, one: w + one), (w, jnp.asarray(1, BF16)),
                                2 * n * n * 2, 20)
    del w
    cols = min(4096, max(128, n // 4 // 128 * 128))
    count = max(1, int(gb * 1e9 / 2 // (4 * cols * cols)))
    ws = [jax.random.normal(jax.random.key(2 + i), (4 * cols, cols), BF16) for i in range(count)]

    @jax.jit
    def chain(ws, x):
        for m in ws:
            x = (m @ x)[:cols] * 0.5
        return x

    rates["chain"] = median_rate(chain, (ws, x[:cols]), count * 4 * cols * cols * 2, 5)
    if detail is not None:
        detail.update(rates)
    return max(rates.values())


def time_decode(step, params, state, tokens, warmup: int, steps: int):
    """Median and p90 seconds per decode step (each step synchronised)."""
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        _, state = step(params, state, tokens)
        jax.block_until_ready(state)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return float(np.median(times)), float(np.percentile(times, 90)), state


def time_loop(step_fn, params, state, tokens, steps: int, choose=None,
              compiler_options=None):
    """(seconds per step, compile seconds, state) with `steps` decode steps chained inside
    one jitted `lax.fori_loop`, the state donated: no host round trip between tokens (each
    step feeds the argmax of its logits to the next), or with `choose` each token picked on
    the host by a callback from the loop (`host_choice`). Compiled ahead of time (with
    XLA's `compiler_options`, if given), run once to warm, then timed once."""
    t = time.perf_counter()
    run = jax.jit(chained_loop(step_fn, steps, choose), donate_argnums=1).lower(
        params, state, tokens).compile(compiler_options)
    compile_s = time.perf_counter() - t
    state, out = run(params, state, tokens)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state, out = run(params, state, tokens)
    jax.block_until_ready((state, out))
    seconds = (time.perf_counter() - t) / steps
    raise_failed_choice()
    return seconds, compile_s, state


def device_peak_bytes() -> int | None:
    """`peak_bytes_in_use` of the local devices (the largest), None where the backend
    keeps no memory stats (CPU). A process-lifetime peak: JAX cannot reset it."""
    peaks = []
    for dev in jax.local_devices():
        try:
            stats = dev.memory_stats()
        except Exception:  # backends without memory stats
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def state_bytes(engine, batch: int, max_len: int, init_kwargs: dict) -> int:
    """Bytes of the decode state (the K/V cache) `engine.init_state` would allocate for
    `batch` rows of `max_len` slots; nothing is allocated."""
    state = jax.eval_shape(lambda: engine.init_state(batch, max_len, BF16, **init_kwargs))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))


def compiled_peak_bytes(compiled) -> int | None:
    """XLA's peak memory estimate of one compiled executable (arguments, outputs and
    temporaries; per device), None where unavailable."""
    try:
        return int(compiled.memory_analysis().peak_memory_in_bytes)
    except Exception:  # no memory analysis on this backend/version
        return None


def prefill_key(engine, params, prompt, mask, state):
    """A key under which a compiled prefill can be reused: the prefill partial's function
    and static arguments, and every input's shape and dtype; None when the prefill is not
    a `functools.partial` (e.g. the tensor-parallel engines' wrappers) or its arguments
    are unhashable."""
    fn = engine.prefill
    if not isinstance(fn, functools.partial):
        return None
    ident = (fn.func, fn.args, tuple(fn.keywords.items()))
    try:
        hash(ident)
    except TypeError:
        return None
    leaves, tree = jax.tree.flatten((params, prompt, mask, state))
    return ident, tree, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def _timed_prefill(engine, params, prompt, mask, state, fresh, reps: int, prefill_cache,
                   res: dict):
    """The state after `reps` prefills of a fresh cache after a warm one; records their
    median (`prefill_ms`), `compile_prefill_s` and `prefill_cached` in res."""
    key = None if prefill_cache is None else prefill_key(engine, params, prompt, mask, state)
    t = time.perf_counter()
    if key is not None and key in prefill_cache:
        prefill = prefill_cache[key]
        res["prefill_cached"] = True
    else:
        prefill = jax.jit(engine.prefill, donate_argnums=3).lower(params, prompt, mask,
                                                                   state).compile()
        if key is not None:
            prefill_cache[key] = prefill
    res["compile_prefill_s"] = 0.0 if res.get("prefill_cached") else time.perf_counter() - t
    times = []
    for i in range(1 + reps):
        if i:
            del state
            state = fresh()
            jax.block_until_ready(state)
        t = time.perf_counter()
        _, state = prefill(params, prompt, mask, state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    res["prefill_ms"] = float(np.median(times[1:] or times)) * 1e3
    return state


def measure_engine(engine, params, prompt, mask, tokens, max_len: int, warmup: int,
                   steps: int, init_kwargs: dict, prefill_reps: int = 3,
                   prefill_cache: dict | None = None, loop_only: bool = False,
                   context: int | None = None, host_choice: bool = False,
                   compiler_options: dict | None = None) -> dict:
    """Timings of one engine at one (context, batch).

    Prefill, step and device loop are compiled ahead of time, and each compile is timed
    on its own (`compile_prefill_s`, `compile_step_s`, `compile_loop_s`; `compile_s` is
    their sum). prefill_ms: median of `prefill_reps` prefills of a fresh cache after a
    warm one (None for a prompt of no tokens: no prefill, the context held as zeros).
    ms / p90_ms: the decode step with the host synchronising after every token
    (`time_decode`); ms_loop: steps chained on the device (`time_loop`), on the same
    cache. peak_bytes: the devices' peak so far (`device_peak_bytes`); step_peak_bytes:
    XLA's estimate for the step executable.

    prefill_cache: a dict that keeps compiled prefills across calls (`prefill_key`); a
    reused one reports `compile_prefill_s` 0 and `prefill_cached` True. loop_only: skip
    the host-synchronised step (its compile and timing; `ms`, `p90_ms` are None), for grids.
    context: a context longer than the prompt, held after the prefill (`held_context`).
    host_choice: also ms_host, the device loop with each token picked on the host by a
    callback (`host_choice.host_argmax`): a serving loop that chooses on the host.
    compiler_options: XLA options for the step's and the loop's compiles; the row then
    also holds `logits_vs_base` (`logits_against_base`).
    """
    batch = prompt.shape[0]

    def fresh():
        return engine.init_state(batch, max_len, BF16, **init_kwargs)

    res = {}
    state = fresh()
    if prompt.shape[1] == 0:  # no prefill: the context is held as zeros
        res.update(compile_prefill_s=0.0, prefill_ms=None)
    else:
        state = _timed_prefill(engine, params, prompt, mask, state, fresh, prefill_reps,
                               prefill_cache, res)
    if context is not None and context > prompt.shape[1]:
        state = held_context(state, context)
    if compiler_options:
        res["logits_vs_base"] = logits_against_base(engine, params, state, tokens,
                                                    compiler_options)
    if loop_only:
        res.update(compile_step_s=0.0, step_peak_bytes=None, ms=None, p90_ms=None)
    else:
        t = time.perf_counter()
        step = jax.jit(engine.step, donate_argnums=1).lower(params, state, tokens).compile(
            compiler_options)
        res["compile_step_s"] = time.perf_counter() - t
        res["step_peak_bytes"] = compiled_peak_bytes(step)
        med, p90, state = time_decode(step, params, state, tokens, warmup, steps)
        res.update(ms=med * 1e3, p90_ms=p90 * 1e3)
    per_step, res["compile_loop_s"], state = time_loop(engine.step, params, state, tokens,
                                                       steps, None, compiler_options)
    res["ms_loop"] = per_step * 1e3
    if host_choice:
        per_step, _, state = time_loop(engine.step, params, state, tokens, steps, host_argmax,
                                       compiler_options)
        res["ms_host"] = per_step * 1e3
    res["compile_s"] = res["compile_prefill_s"] + res["compile_step_s"] + res["compile_loop_s"]
    res["peak_bytes"] = device_peak_bytes()
    del state
    return res


def logits_against_base(engine, params, state, tokens, compiler_options: dict
                        ) -> list[float]:
    """[largest |logit| difference between one step compiled with `compiler_options` and
    one without, the same between two runs of the one without, largest |logit|], every
    step from `state` (not donated). The second is the step's own run-to-run spread: on a
    GPU its atomic sums vary in the low bits, and a predictor's near-tied scores can then
    pick other units, so the first means something only against it."""
    base = jax.jit(engine.step).lower(params, state, tokens).compile()
    other = jax.jit(engine.step).lower(params, state, tokens).compile(compiler_options)
    a, again = base(params, state, tokens)[0], base(params, state, tokens)[0]
    b = other(params, state, tokens)[0]
    if not bool(jnp.isfinite(a).all() & jnp.isfinite(b).all() & jnp.isfinite(again).all()):
        raise FloatingPointError("a step's logits are not finite")
    return [float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(a - again))),
            float(jnp.max(jnp.abs(a)))]


def time_generate(engine, params, prompt, new_tokens: int, chunks=(8, 1)) -> dict:
    """ms per token of `generation.generate_tokens` end to end (greedy, no stop id), from a
    second run (the first compiles): `generate_ms` at chunk 8 (steps per device call, as
    `generate` runs) and `stream_ms` at chunk 1, the host handed every token as it is
    made."""
    from dejavu_jax.generation import generate_tokens
    rows = np.asarray(prompt).tolist()
    res = dict(generate_new_tokens=new_tokens)
    for chunk in chunks:
        for _ in range(2):
            result = generate_tokens(engine, params, rows, new_tokens, stop_ids=[],
                                     chunk=chunk)
        rate = result.tokens_per_second          # 0 when one call made every token
        res["stream_ms" if chunk == 1 else "generate_ms"] = 1e3 / rate if rate else None
        if chunk != 1:
            res["generate_chunk"] = chunk
    return res


def rates(nbytes: int, batch: int, ms: float, ms_loop: float | None) -> dict:
    """GB/s and tokens/s of a row: from ms_loop (device-chained steps) where measured,
    else from the synchronised ms (HF rows); gbs_synced always from ms."""
    per_token = ms_loop if ms_loop else ms
    return dict(bytes=nbytes, gbs=nbytes / per_token / 1e6,
                gbs_synced=None if ms is None else nbytes / ms / 1e6,
                tokens_per_s=batch * 1e3 / per_token)


def _unchanged(params):
    return params


# --dense-qkv: the dense rows' (indices label, weights preparation)
DENSE_QKV = {"fused": [("-", fuse_qkv)], "separate": [("-", _unchanged)],
             "both": [("-", fuse_qkv), ("qkv-separate", _unchanged)]}


def measure_rows(config, params, preds, contexts, mlp_densities, head_densities, batches,
                 rank, dense_layers, warmup, steps, bar, log, select_methods, modes,
                 prefill_reps, *, init_kwargs, label, dense, sparse_engine, fixed_sets,
                 make_row, kv_recompute_off=False, loop_only=False,
                 dense_qkv="fused", kernel_configs=None, generate_tokens=0,
                 dense_engine_for_dense_batches=False,
                 prefill_tokens: int | None = None, host_choice=False) -> list[dict]:
    """The rows of one model for every context and batch: the `dense` engine, then for each
    density pair the sparse rows (`sparse_row_kinds`) built by `sparse_engine(scfg,
    select)`; precomputed sets come from `fixed_sets(scfg, batch)` (at heads 0.5, first
    context; per-row heads at batch > 1).
    `make_row(columns)` completes each row (model, layout, device columns); every row is
    logged as one JSON line. A setting that fails (OOM, lowering) is logged and skipped; a
    (context, batch) whose K/V cache exceeds the device's free memory is skipped unrun.
    Compiled prefills are reused across rows of equal shapes (the sparse engines of a model
    share one); loop_only skips the host-synchronised timing (`measure_engine`).
    dense_qkv: the dense row's q/k/v weights "fused" (`params.fuse_qkv`, the dense
    engine's form), "separate", or "both" (the separate row is labelled "qkv-separate").
    kernel_configs: variants of `SparseConfig` fields (attn_config, mlp_config), each
    measured for every sparse row (see `parse_kernel_configs`). generate_tokens: when above
    0, the dense and predictor rows also time `generation.generate_tokens` making that many
    tokens end to end (`time_generate`: `generate_ms`). dense_engine_for_dense_batches: a
    sparse row whose batch runs every layer dense (`sparse.batch_runs_dense`) times the
    `dense` engine on its fused weights instead, as `generate` runs such a batch (its
    indices label ends in "(dense engine)"). prefill_tokens: prefill only that many prompt
    tokens and hold the rest of the context (`held_context`: the step reads the same
    bytes), where a whole prompt's prefill would not fit beside a long cache. host_choice:
    also time the loop with host-chosen tokens (`measure_engine`)."""
    rows = []
    prefill_cache = {}
    for ctx in contexts:
        max_len = cache_len(ctx, warmup, steps)
        for batch in batches:
            prompt_len = ctx if prefill_tokens is None else min(ctx, prefill_tokens)
            prompt = jax.random.randint(jax.random.key(2), (batch, prompt_len), 3,
                                        config.vocab_size)
            mask = jnp.ones_like(prompt)
            tokens = jnp.full((batch,), 42, jnp.int32)
            free = device_free_bytes()
            need = None if free is None else state_bytes(dense, batch, max_len, init_kwargs)
            if need is not None and need > free:  # spares the allocator's long retries
                log(f"SKIPPED {label} ctx={ctx} batch={batch}: its K/V cache needs "
                    f"{need / 1e9:.1f} GB beside the weights, the device has "
                    f"{free / 1e9:.1f} GB free")
                continue

            def measure(what, engine, engine_params, compiler_options=None):
                try:
                    res = measure_engine(engine, engine_params, prompt, mask, tokens, max_len,
                                         warmup, steps, init_kwargs, prefill_reps,
                                         prefill_cache, loop_only, context=ctx,
                                         host_choice=host_choice,
                                         compiler_options=compiler_options)
                    if generate_tokens and ("dense" in what or "predictor" in what):
                        res.update(time_generate(engine, engine_params, prompt,
                                                 generate_tokens))
                    return res
                except Exception as e:  # report (OOM, lowering errors) and go on
                    log(f"FAILED {label} ctx={ctx} batch={batch} {what}: "
                        f"{type(e).__name__}: {str(e)[:400]}")
                    return None

            def add(res, nbytes, **columns):
                rows.append(make_row(dict(columns, context=ctx, batch=batch, cache_len=max_len,
                                          prefill_tokens=prompt.shape[1],
                                          **res, **rates(nbytes, batch, res["ms"],
                                                         res["ms_loop"]))))
                log(json.dumps(rows[-1]))

            if "dense" in modes:
                for label_qkv, prepare in DENSE_QKV[dense_qkv]:
                    try:  # the fused copy may not fit beside the model
                        dense_params = prepare(params)
                    except Exception as e:
                        log(f"FAILED {label} ctx={ctx} batch={batch} dense {label_qkv}: "
                            f"{type(e).__name__}: {str(e)[:400]}")
                        continue
                    res = measure(f"dense {label_qkv}", dense, dense_params)
                    del dense_params  # a fused copy is freed before the next rows
                    if res is not None:
                        add(res, step_bytes(config, None, ctx, batch, rank, False),
                            mode="dense", mlp=1.0, heads=1.0, indices=label_qkv)
                bar.update()
            if "sparse" not in modes and "fixed" not in modes:
                continue
            for md in mlp_densities:
                for hdn in head_densities:
                    base_cfg = sparse.sparse_config(config, md, hdn, dense_layers=dense_layers)
                    fixed = (fixed_sets(base_cfg, batch) if "fixed" in modes and hdn == 0.5
                             and ctx == contexts[0] else None)
                    seen = set()
                    for kernel_cfg, (kind, select, sel_params) in itertools.product(
                            kernel_configs or [{}], sparse_row_kinds(
                                config, preds, select_methods if "sparse" in modes else (),
                                fixed, kv_recompute_off)):
                        policy = kernel_cfg.get("batch_policy", "dense")
                        if kind == "fixed" and policy == "shared":
                            continue   # the policy shares predicted sets; fixed ones are
                        if batch == 1:  # the policies differ only for a batch: one row
                            same = (kind, without_policy(kernel_cfg))
                            if same in seen:
                                continue
                            seen.add(same)
                        measured = policy == MEASURED
                        compile_opts = kernel_cfg.get(COMPILE_OPTIONS)
                        scfg = dataclasses.replace(
                            base_cfg, **{k: v for k, v in kernel_cfg.items()
                                         if not (measured and k == "batch_policy")
                                         and k != COMPILE_OPTIONS})
                        run_cfg = (without_kv_recompute(scfg)
                                   if kind.endswith("no-kv-recompute") else scfg)
                        what = f"mlp={md} heads={hdn} {kind}{config_label(kernel_cfg)}"
                        plan = None
                        if measured and batch > 1:
                            plan = measure_plan(config, run_cfg, select, (params, sel_params),
                                                ctx, batch, log)
                            if plan is None:
                                continue
                            run_cfg = dataclasses.replace(run_cfg, batch_policy="union",
                                                          batch_layers=plan.layers)
                            scfg = run_cfg
                        as_dense = (dense_engine_for_dense_batches
                                    and sparse.batch_runs_dense(run_cfg, batch)
                                    or plan is not None and plan.all_dense)
                        if as_dense:
                            what += " (dense engine)"
                            res = measure(what, dense, fuse_qkv(params))
                        else:
                            res = measure(what, sparse_engine(run_cfg, select),
                                          (params, sel_params), compile_opts)
                        bar.update()
                        if res is not None and plan is not None:
                            res["batch_plan"] = {"layers": list(plan.layers), "ms": plan.ms,
                                                 "dense_ms": plan.dense_ms,
                                                 "trials": [list(t) for t in plan.trials]}
                        if res is not None:
                            add(res, step_bytes(config, scfg, ctx, batch, rank,
                                                kind.startswith("predictor"),
                                                not kind.endswith(UNION_HEADS)),
                                mode="sparse", mlp=md, heads=hdn,
                                indices=(kind + config_label(kernel_cfg)
                                         + " (dense engine)" * as_dense),
                                **({"kernel_config": {key: cfg if isinstance(cfg, (str, int, dict))
                                                      else dataclasses.asdict(cfg)
                                                      for key, cfg in kernel_cfg.items()}}
                                   if kernel_cfg else {}))
    return rows


def without_policy(kernel_cfg: dict) -> str:
    """A kernel variant's identity apart from its batch policy (batch 1 has one row for all
    policies)."""
    return repr({k: v for k, v in kernel_cfg.items() if k != "batch_policy"})


MEASURED = "measured"  # --batch-policy: `batch_plan.measure_batch_plan` picks each layer's mode


def measure_plan(config, scfg, select, engine_params, context: int, batch: int, log):
    """`batch_plan.plan_for` this row's batch and context, or None where it fails."""
    from dejavu_jax import batch_plan
    try:
        plan = batch_plan.plan_for(config, scfg, select, engine_params, batch, context,
                                   log=log)
        log(plan.summary())
        return plan
    except Exception as e:  # report (OOM, lowering errors) and go on
        log(f"FAILED batch plan ctx={context} batch={batch}: {type(e).__name__}: "
            f"{str(e)[:400]}")
        return None


CONFIG_PREFIX = {"attn_config": "attn.", "mlp_config": "mlp."}


def config_label(kernel_configs) -> str:
    """" [attn.field=value,mlp.field=value,...]" naming the kernel config fields that
    differ from the defaults ("" when none do), appended to a sparse row's indices label."""
    fields = []
    for key, cfg in (kernel_configs or {}).items():
        if key == "batch_policy":
            fields.append(f"policy={cfg}")
        elif key == "layer_unroll":
            fields.append(f"unroll={'all' if cfg is True else cfg}")
        elif key == COMPILE_OPTIONS:
            fields += [f"xla.{name}={value}" for name, value in cfg.items()]
        elif cfg is not None:
            default = type(cfg)()
            fields += [f"{CONFIG_PREFIX[key]}{f.name}={getattr(cfg, f.name)}"
                       for f in dataclasses.fields(cfg)
                       if getattr(cfg, f.name) != getattr(default, f.name)]
    return f" [{','.join(fields)}]" if fields else ""


COMPILE_OPTIONS = "compile_options"


def parse_compile_options(text: str) -> list[dict | None]:
    """--compile-options: '/'-separated sets of XLA options, each "name=value+name=value"
    ("base": none). Values "true" / "false" are booleans, integers are integers, anything
    else (an empty value too) a string."""
    def value(v: str):
        if v in ("true", "false"):
            return v == "true"
        return int(v) if v.lstrip("-").isdigit() else v

    sets = []
    for variant in (v.strip() for v in text.split("/") if v.strip()):
        if variant == "base":
            sets.append(None)
            continue
        options = {}
        for pair in variant.split("+"):
            name, eq, v = pair.partition("=")
            if not eq or not name.strip().startswith("xla_"):
                raise ValueError(f"--compile-options: {pair!r} is not xla_<option>=value")
            options[name.strip()] = value(v.strip())
        sets.append(options)
    return sets


def parse_kernel_configs(attn: str, mlp: str, batch_policies: str = "dense",
                         layer_unrolls: str = "", compile_options: str = "") -> list[dict]:
    """SparseConfig fields for each sparse-row variant, from --attn-config / --mlp-config:
    '/'-separated variants of "field=value,..." ("base": the defaults); every attention
    variant with every MLP variant, each under every comma-separated --batch-policy
    (`sparse.BATCH_POLICIES`; "dense", the engine's default, adds no field) and
    --layer-unroll (`SparseConfig.layer_unroll`: integers, or "all"; none given: the
    engine's default, no field) and --compile-options set (`parse_compile_options`; the
    key `COMPILE_OPTIONS`, absent for "base")."""
    from dejavu_jax.kernels import AttnConfig, MLPConfig
    from dejavu_jax.kernels.bench_step_parts import parse_variants
    choices = []
    for key, text, cls in (("attn_config", attn, AttnConfig), ("mlp_config", mlp, MLPConfig)):
        variants = parse_variants(text, cls) if text else []
        choices.append([{key: cfg} for _, cfg in variants] or [{}])
    policies = [p.strip() for p in batch_policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in (*sparse.BATCH_POLICIES, MEASURED)]
    if unknown or not policies:
        raise ValueError(f"--batch-policy: unknown {unknown or batch_policies!r}; choose "
                         f"from {', '.join((*sparse.BATCH_POLICIES, MEASURED))}")
    unrolls = []
    for text in (u.strip() for u in layer_unrolls.split(",") if u.strip()):
        if text != "all" and not (text.isdigit() and int(text) >= 1):
            raise ValueError(f"--layer-unroll: {text!r} is not an integer >= 1 or 'all'")
        unrolls.append(True if text == "all" else int(text))
    option_sets = parse_compile_options(compile_options) or [None]
    return [{**a, **m, **({} if p == "dense" else {"batch_policy": p}),
             **({} if u is None else {"layer_unroll": u}),
             **({} if o is None else {COMPILE_OPTIONS: o})}
            for p in policies for a in choices[0] for m in choices[1]
            for u in unrolls or [None] for o in option_sets]


def run_model(name, contexts, mlp_densities, head_densities, batches, rank, dense_layers,
              warmup, steps, bar, log, layout="unrolled", select_methods=("exact",),
              kv_recompute_off=False, modes=("dense", "sparse"), prefill_reps=3,
              loop_only=False, dense_qkv="fused", kernel_configs=None, generate_tokens=0,
              prefill_tokens=None, host_choice=False):
    """All rows for one model preset, with the layers stacked (scan) or unrolled: for every
    context and batch, dense (ours) and the sparse rows (`sparse_row_kinds`)."""
    from dejavu_jax.generation import dense_engine
    config = config_lib.preset(name)
    if isinstance(batches, int):
        batches = [batches]
    t0 = time.perf_counter()
    params = init_params(config, jax.random.key(0), BF16)
    if layout == "unrolled":
        params = unstack_layers(params, free_stacked=True)
    jax.block_until_ready(params)
    log(f"{name}: {param_bytes(params) / 1e9:.1f} GB weights, init {time.perf_counter() - t0:.1f}s")
    preds = decode_predictors(random_predictors(config, rank, jax.random.key(1)))
    rows = measure_rows(
        config, params, preds, contexts, mlp_densities, head_densities, batches, rank,
        dense_layers, warmup, steps, bar, log, select_methods, modes, prefill_reps,
        init_kwargs=dict(per_layer=layout == "unrolled"), label=f"{name} {layout}",
        dense=dense_engine(config), sparse_engine=functools.partial(sparse.sparse_engine, config),
        fixed_sets=lambda scfg, batch: random_sets(config, scfg, per_layer=layout == "unrolled",
                                                   row_heads=batch if batch > 1 else None),
        make_row=lambda r: dict(model=name, layout=layout, **r),
        kv_recompute_off=kv_recompute_off, loop_only=loop_only, dense_qkv=dense_qkv,
        kernel_configs=kernel_configs, generate_tokens=generate_tokens,
        dense_engine_for_dense_batches=True, prefill_tokens=prefill_tokens,
        host_choice=host_choice)
    del params
    return rows


MODE_ORDER = {"hf-eager": 0, "hf-compiled": 1, "dense": 2, "sparse": 3}


def add_speedups(rows) -> list[dict]:
    """Rows sorted by (model, context, batch, mode), with speedups filled in.

    Ours (dense and sparse): `speedup` = dense ms / ms and `speedup_loop` = dense ms_loop /
    ms_loop against dense-ours of the same (model, layout, context, batch);
    `speedup_vs_hf_eager` / `speedup_vs_hf_compiled` = the HF row's ms / ms (both
    host-synchronised per token) of the same (model, context, batch), where present.
    """
    rows = sorted(rows, key=lambda r: (r["model"], r["context"], r["batch"],
                                       MODE_ORDER.get(r["mode"], 9)))
    dense = {}
    for r in rows:  # keyed with and without the run a merged row came from
        if r["mode"] == "dense" and r.get("indices", "-") == "-":
            key = (r["model"], r.get("layout"), r["context"], r["batch"])
            dense[key] = dense[key + (r.get("source"),)] = r
    hf = {(r["mode"], r["model"], r["context"], r["batch"]): r
          for r in rows if r["mode"] in bench_hf.HF_MODES}
    for r in rows:
        if r["mode"] not in ("dense", "sparse"):
            continue
        key = (r["model"], r.get("layout"), r["context"], r["batch"])
        d = dense.get(key + (r.get("source"),)) or dense.get(key)
        if d is not None and d.get("source") != r.get("source"):
            r["dense_source"] = d.get("source")  # a merged run without its own dense row
        r["speedup"] = d["ms"] / r["ms"] if d and d.get("ms") and r.get("ms") else None
        r["speedup_loop"] = (d["ms_loop"] / r["ms_loop"]
                             if d and d.get("ms_loop") and r.get("ms_loop") else None)
        for m in bench_hf.HF_MODES:
            h = hf.get((m, r["model"], r["context"], r["batch"]))
            r["speedup_vs_" + m.replace("-", "_")] = (h["ms"] / r["ms"] if h and r.get("ms")
                                                      else None)
    return rows


def _f(value, spec: str, suffix: str = "") -> str:
    """`value` formatted, or an en dash for None."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def write_table(out: Path, meta: dict, rows, log=print):
    """bench_decode.md: the meta and the table; tensor-parallel rows in their own table
    (`bench_tp.markdown_tp`) after the others."""
    tables = []
    single = [r for r in rows if "tp" not in r]
    if single or not rows:
        tables.append(markdown(single, meta))
    if len(single) < len(rows):
        from dejavu_jax.eval.bench_tp import markdown_tp
        tables.append(markdown_tp([r for r in rows if "tp" in r], meta))
    table = "\n\n".join(tables)
    (out / "bench_decode.md").write_text(
        f"# Decode benchmark\n\n{json.dumps(meta, indent=1)}\n\n{table}\n")
    log(table)


def merge_runs(dirs, out: Path, argv_text: str, log) -> int:
    """One JSON and table from the bench_decode.json of several runs (say one per model,
    or HF rows from a separate run): rows concatenated, each with its run's folder below the
    runs' common parent as `source`; speedups are against the dense row of the same run
    where it has one, else of another run (named in the row's `dense_source`)."""
    metas, rows = [], []
    common = Path(os.path.commonpath([str(Path(d).resolve()) for d in dirs]))
    for d in dirs:
        run = json.loads((d / "bench_decode.json").read_text())
        metas.append(dict(run["meta"], source=str(d)))
        # the run's folder below the merged folders' common parent: unique per run
        name = str(Path(d).resolve().relative_to(common)) if len(dirs) > 1 else d.name
        rows += [dict(r, best_gbs=best_gbs(r, run["meta"]),
                      spec_gbs=r.get("spec_gbs", run["meta"].get("spec_gbs")),
                      source=r.get("source", name)) for r in run["rows"]]
    known = [best_gbs(m, {}) for m in metas if best_gbs(m, {})]
    meta = dict(command="python -m dejavu_jax.eval.bench_decode " + argv_text,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                best_gbs=max(known) if known else None,
                spec_gbs=next((m.get("spec_gbs") for m in metas if m.get("spec_gbs")), None),
                merged=metas)
    rows = add_speedups(rows)
    (out / "bench_decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    write_table(out, meta, rows, log)
    return 0


def table(cols, rows, cells) -> str:
    """A markdown table: header `cols`, one line per row from `cells(row)`."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def speedup_cells(r) -> tuple[str, str, str]:
    """The speedup columns: vs dense (synced / loop), vs hf-eager, vs hf-compiled."""
    vs_dense = ("–" if r.get("speedup") is None and r.get("speedup_loop") is None else
                f"{_f(r.get('speedup'), '.2f', 'x')} / {_f(r.get('speedup_loop'), '.2f', 'x')}")
    return (vs_dense, _f(r.get("speedup_vs_hf_eager"), ".2f", "x"),
            _f(r.get("speedup_vs_hf_compiled"), ".2f", "x"))


def best_gbs(r: dict, meta: dict) -> float | None:
    """The run's best measured bandwidth a row refers to (older runs: `roofline_gbs`)."""
    return (r.get("best_gbs") or r.get("roofline_gbs") or meta.get("best_gbs")
            or meta.get("roofline_gbs"))


def bandwidth_cells(gbs: float | None, r: dict, meta: dict) -> tuple[str, str]:
    """GB/s as a percentage of the device's specification and of the run's best measured
    copy or GEMV ("–" where either is unknown)."""
    spec = r.get("spec_gbs") or meta.get("spec_gbs")
    best = best_gbs(r, meta)
    return (_f(gbs and spec and 100 * gbs / spec, ".0f", "%"),
            _f(gbs and best and 100 * gbs / best, ".0f", "%"))


def markdown(rows, meta: dict) -> str:
    """A markdown table of the rows (see `add_speedups` for the speedup columns)."""
    cols = ("model", "layers", "mode", "ctx", "batch", "mlp", "heads", "indices",
            "ms (synced)", "ms_loop", "ms host-chosen", "generate ms", "stream ms", "p90", "tokens/s", "GB read",
            "GB/s", "% spec", "% best measured", "prefill ms", "compile s", "peak GB",
            "vs dense (synced / loop)", "vs hf-eager", "vs hf-compiled")

    merged = any("source" in r for r in rows)
    if merged:
        cols += ("run",)

    def cells(r):
        peak = r.get("peak_bytes")
        return (r["model"], r.get("layout", "stacked"), r["mode"], r["context"], r["batch"],
                f"{r['mlp']:.2f}", f"{r['heads']:.2f}", r["indices"], _f(r.get("ms"), ".3f"),
                _f(r.get("ms_loop"), ".3f"), _f(r.get("ms_host"), ".3f"),
                _f(r.get("generate_ms"), ".3f"),
                _f(r.get("stream_ms"), ".3f"),
                _f(r.get("p90_ms"), ".3f"),
                _f(r.get("tokens_per_s"), ".0f"), _f(r.get("bytes") and r["bytes"] / 1e9, ".2f"),
                _f(r.get("gbs"), ".0f"), *bandwidth_cells(r.get("gbs"), r, meta),
                _f(r.get("prefill_ms"), ".1f"), _f(r.get("compile_s"), ".1f"),
                _f(peak and peak / 1e9, ".1f"), *speedup_cells(r)) + (
                    (r.get("source", "–"),) if merged else ())

    return table(cols, rows, cells)


def run_hf(python: str, models, contexts, batches, modes, warmup: int, steps: int, out: Path,
           log, device: str = "cuda", compile_mode: str = "reduce-overhead",
           attn: str = "sdpa") -> dict | None:
    """The HF rows from a child process (`bench_hf`, run by path under `python`), before
    this process touches the accelerator. None (and a log line) when it gives no result."""
    out_file = out / "bench_hf.json"
    out_file.unlink(missing_ok=True)
    cmd = [python, str(Path(__file__).resolve().with_name("bench_hf.py")),
           "--models", ",".join(models), "--contexts", ",".join(map(str, contexts)),
           "--batch", ",".join(map(str, batches)), "--modes", ",".join(modes),
           "--warmup", str(warmup), "--steps", str(steps), "--device", device,
           "--compile-mode", compile_mode, "--attn", attn, "--out", str(out_file)]
    # the child must not grab the accelerator through JAX (importing dejavu_jax imports it)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    log("HF rows: " + " ".join(cmd))
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
    except OSError as e:
        log(f"{', '.join(modes)} skipped: cannot start {python}: {e}")
        return None
    for line in proc.stdout:
        log("[hf] " + line.rstrip())
    rc = proc.wait()
    if rc != 0 or not out_file.exists():
        log(f"{', '.join(modes)} skipped: the HF child process exited with status {rc}")
        return None
    result = json.loads(out_file.read_text())
    if result["meta"].get("skipped"):
        log(f"{', '.join(modes)} skipped: {result['meta']['skipped']}")
    for err in result.get("errors", []):
        log(f"HF row skipped: {json.dumps({k: v for k, v in err.items() if k != 'traceback'})}")
    return result


def main(argv=None) -> int:
    """Run the benchmark; writes JSON and markdown into --out."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.bench_decode")
    p.add_argument("--models", type=cli.presets, default="opt-6.7b,opt-13b,opt-30b",
                   help="comma list of presets, timed with random bf16 weights of their shapes")
    p.add_argument("--contexts", default="128,1024",
                   help="comma list of context lengths (tokens in the cache at the step)")
    p.add_argument("--modes", default="dense,sparse,fixed",
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--mlp", default="0.05,0.1,0.15",
                   help="comma list of MLP densities (fractions of neurons read)")
    p.add_argument("--heads", default="0.25,0.5,1.0",
                   help="comma list of attention head densities (fractions of query heads)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,4,16")
    p.add_argument("--rank", type=cli.positive_int, default=256, help="predictor hidden width r")
    p.add_argument("--dense-layers", type=cli.non_negative_int, default=2,
                   help="leading layers kept dense in the sparse rows")
    p.add_argument("--warmup", type=cli.non_negative_int, default=3,
                   help="untimed steps before each timing")
    p.add_argument("--steps", type=cli.positive_int, default=20, help="timed steps per row")
    p.add_argument("--prefill-reps", type=cli.positive_int, default=3,
                   help="prefills timed per row (the median is reported)")
    p.add_argument("--host-choice", action="store_true",
                   help="also ms_host: the device loop with every token chosen on the host "
                        "by a callback")
    p.add_argument("--loop-only", action="store_true",
                   help="time only the device-chained steps (skips the host-synchronised "
                        "step's compile and timing; ms and p90 are left empty): for grids")
    p.add_argument("--dense-qkv", default="fused", choices=tuple(DENSE_QKV),
                   help="the dense row's q/k/v weights: one fused GEMV (params.fuse_qkv, "
                        "what generate's dense engine runs), three separate ones, or a row "
                        "of each ('qkv-separate'; one GPU only)")
    p.add_argument("--attn-config", default="",
                   help="sparse rows' kernels.AttnConfig fields, '/'-separated variants "
                        "each measured, e.g. 'base/out_block_rows=16'")
    p.add_argument("--mlp-config", default="",
                   help="sparse rows' kernels.MLPConfig variants, e.g. 'base/num_stages=3'")
    p.add_argument("--prefill-tokens", type=cli.non_negative_int,
                   help="prefill at most this many prompt tokens and hold the rest of the "
                        "context as zeros (the step reads the same bytes): long contexts "
                        "at large batches whose prefill would not fit; 0: no prefill (no "
                        "prefill compile per row, for grids)")
    p.add_argument("--batch-policy", default="dense",
                   help="comma-separated SparseConfig.batch_policy values for the sparse "
                        "rows (dense, union, shared, kernels), or measured: the union with "
                        "a per-layer plan from timed steps (dejavu_jax.batch_plan)")
    p.add_argument("--layouts", default="unrolled",
                   help="stacked (lax.scan over stacked layers), unrolled, or both")
    p.add_argument("--layer-unroll", default="",
                   help="comma list of sparse rows' SparseConfig.layer_unroll over stacked "
                        "weights, one row each: layers per scan iteration, or 'all' (every "
                        "layer inlined, no device loop); default: the engine's")
    p.add_argument("--compile-options", default="",
                   help="'/'-separated sets of XLA compile options for the sparse rows' "
                        "step and loop, one row each, e.g. 'base/xla_gpu_enable_command_"
                        "buffer=' ('+' joins options of one set); each row also checks its "
                        "logits against a step compiled without them")
    p.add_argument("--select", default="exact",
                   help="comma list of predictor top-k methods, one row each: exact, local, "
                        "or the slower variants of dejavu_jax.sparse_variants (threshold, "
                        "radix, chunked, packed); 'local-apart': local with its launches not "
                        "riding in the MLP's")
    p.add_argument("--diagnose-kv-recompute", action="store_true",
                   help="add a fixed-index row without missing-KV recomputation (inexact)")
    p.add_argument("--hf-python", default=sys.executable,
                   help="interpreter with torch + transformers for the HF modes")
    p.add_argument("--hf-device", default="cuda", help="torch device of the HF modes")
    p.add_argument("--hf-compile-mode", default="reduce-overhead",
                   help="torch.compile mode of hf-compiled")
    p.add_argument("--hf-attn", default="sdpa", help="HF attention implementation")
    p.add_argument("--merge", help="comma-separated --out directories of earlier runs: one "
                   "table of all their rows (speedups across runs), written to --out; "
                   "runs nothing")
    p.add_argument("--out", type=cli.output_dir, default="runs/bench_decode",
                   help="folder for bench_decode.json, .md and .log (default "
                        "runs/bench_decode)")
    add_parity_argument(p)
    p.add_argument("--generate-tokens", type=cli.non_negative_int, default=0, metavar="N",
                   help="also time generation.generate_tokens end to end making N tokens, "
                        "for the dense and predictor rows, 8 steps per call and 1 (stream "
                        "ms) (default 0: off)")
    p.add_argument("--mesh", help="tensor-parallel mesh, e.g. 'tp=2' (rows from eval/bench_tp.py)")
    p.add_argument("--devices", type=cli.positive_int, help="shorthand for --mesh tp=N")
    args = p.parse_args(argv)
    split = lambda s, f: [f(v) for v in s.split(",") if v]  # noqa: E731

    def checked(flag, text, kind):
        try:
            values = split(text, kind)
        except argparse.ArgumentTypeError as e:
            p.error(f"argument {flag}: {e}")
        if not values:
            p.error(f"argument {flag}: no values given")
        return values

    models = args.models
    contexts = checked("--contexts", args.contexts, cli.positive_int)
    mlps, heads = checked("--mlp", args.mlp, cli.fraction), checked("--heads", args.heads,
                                                                    cli.fraction)
    batches, modes = checked("--batch", args.batch, cli.positive_int), split(args.modes, str)
    mesh_sizes = None
    if args.mesh or args.devices:
        from dejavu_jax import sharding
        try:
            mesh_sizes = (sharding.parse_mesh(args.mesh) if args.mesh
                          else {"data": 1, "tp": args.devices})
        except ValueError as e:
            p.error(str(e))
        if args.attn_config or args.mlp_config:
            p.error("--attn-config / --mlp-config apply to single-device rows only")
    bad_layouts = [x for x in split(args.layouts, str) if x not in ("stacked", "unrolled")]
    if bad_layouts:
        p.error(f"unknown --layouts {bad_layouts}; known: stacked, unrolled")
    missing = [d for d in split(args.merge or "", str)
               if not Path(d, "bench_decode.json").is_file()]
    if missing:
        p.error(f"--merge: no bench_decode.json in {', '.join(missing)}")
    if args.prefill_tokens == 0 and args.generate_tokens:
        p.error("--generate-tokens needs a prompt to prefill (--prefill-tokens above 0)")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    bad_select = [m for m in split(args.select, str) if not is_selector_name(m)]
    if bad_select:
        p.error(f"unknown --select methods {bad_select}; known: "
                f"{', '.join(sparse.SELECT_METHODS + TOP_K_VARIANTS)} (each optionally "
                f"-apart)")
    try:
        kernel_configs = parse_kernel_configs(args.attn_config, args.mlp_config,
                                              args.batch_policy, args.layer_unroll,
                                              args.compile_options)
    except ValueError as e:
        p.error(str(e))
    hf_modes = [m for m in modes if m in bench_hf.HF_MODES]

    def refuse_models_too_large():  # starts JAX's backend: before any HF row only without
        shards = 1 if mesh_sizes is None else mesh_sizes.get("tp", 1)
        if any(m in OURS for m in modes) and not args.merge:
            common.refuse_models_too_large(p, models, shards)

    if not hf_modes:
        refuse_models_too_large()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "bench_decode.log", "a")
    measured = []           # rows of the model in progress, so a cut-short run keeps them
    save = [lambda: None]   # set once meta exists

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()
        if msg.startswith("{"):
            measured.append(json.loads(msg))
            save[0]()

    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    log(f"python -m dejavu_jax.eval.bench_decode {argv_text}")
    if args.merge:
        return merge_runs(split(args.merge, Path), out, argv_text, log)
    hf = None
    if hf_modes:  # first: JAX has not touched (nor preallocated) the accelerator yet
        hf = run_hf(args.hf_python, models, contexts, batches, hf_modes, args.warmup,
                    args.steps, out, log, args.hf_device, args.hf_compile_mode, args.hf_attn)
        refuse_models_too_large()
    parity = require_parity(args.parity, out, log)  # after HF: it starts JAX's backend
    mesh = None
    if args.mesh or args.devices:  # tensor parallel (dejavu_jax.sharding)
        from dejavu_jax import sharding
        try:  # after the HF rows: a mesh starts JAX's backend
            mesh = sharding.make_mesh(**mesh_sizes)
        except ValueError as e:
            p.error(str(e))
    meta = dict(command="python -m dejavu_jax.eval.bench_decode " + argv_text,
                **run_meta(), kernel_parity=parity, rank=args.rank,
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                dense_layers=args.dense_layers, modes=modes, batches=batches,
                loop_only=args.loop_only, attn_config=args.attn_config,
                mlp_config=args.mlp_config, batch_policy=args.batch_policy,
                prefill_tokens=args.prefill_tokens,
                dense_qkv="separate" if mesh is not None else args.dense_qkv,
                warmup=args.warmup, steps=args.steps,
                mesh=None if mesh is None else dict(mesh.shape),
                hf=None if hf is None else hf["meta"],
                hf_errors=None if hf is None else hf.get("errors"))
    detail = {}
    meta["best_gbs"] = measure_best_bandwidth(
        4.0 if jax.default_backend() == "gpu" else 0.01, detail)
    meta["best_detail"] = detail
    meta["spec_gbs"] = spec_bandwidth(meta["device"])
    log(f"best measured bandwidth (copy or dense GEMV) {meta['best_gbs']:.0f} GB/s {detail}; "
        f"specified {meta['spec_gbs']} GB/s")
    ours = [m for m in modes if m in OURS]
    batch1_configs = len({without_policy(c) for c in kernel_configs})
    n_sparse = (len(mlps) * len(heads) * len(split(args.select, str))
                * (len(kernel_configs) * sum(b > 1 for b in batches)
                   + batch1_configs * (1 in batches)) if "sparse" in ours else 0)
    n_fixed = (len(mlps) * (0.5 in heads) * (1 + (args.diagnose_kv_recompute and mesh is None))
               * sum(c.get("batch_policy") != "shared" for c in kernel_configs)
               if "fixed" in ours else 0)
    n_rows = (len(models) * len(split(args.layouts, str))
              * (len(contexts) * (("dense" in ours) * len(batches) + n_sparse)
                 + len(batches) * n_fixed))
    bar = tqdm(total=n_rows, desc="decode benchmark")
    rows = []
    for r in (hf or {}).get("rows", []):
        config = config_lib.preset(r["model"])
        nbytes = step_bytes(config, None, r["context"], r["batch"], args.rank, False)
        rows.append(dict(r, **rates(nbytes, r["batch"], r["ms"], None)))

    def write():
        done = rows + measured
        for r in done:  # what this row's bandwidth refers to (kept through --merge)
            r.setdefault("best_gbs", meta["best_gbs"])
            r.setdefault("spec_gbs", meta["spec_gbs"])
        (out / "bench_decode.json").write_text(
            json.dumps(dict(meta=meta, rows=add_speedups(done)), indent=1))

    save[0] = write

    for name in models if ours else []:
        for layout in split(args.layouts, str):
            if mesh is not None:
                from dejavu_jax.eval.bench_tp import run_model_tp
                rows += run_model_tp(name, contexts, mlps, heads, batches, args.rank,
                                     args.dense_layers, args.warmup, args.steps, bar, log,
                                     layout, tuple(split(args.select, str)), mesh, ours,
                                     args.prefill_reps, args.loop_only)
                measured.clear()
                continue
            rows += run_model(name, contexts, mlps, heads, batches, args.rank,
                              args.dense_layers, args.warmup, args.steps, bar, log, layout,
                              tuple(split(args.select, str)), args.diagnose_kv_recompute,
                              ours, args.prefill_reps, args.loop_only, args.dense_qkv,
                              kernel_configs, args.generate_tokens, args.prefill_tokens,
                              args.host_choice)
            measured.clear()
        write()
    bar.close()
    write()
    write_table(out, meta, add_speedups(rows), print)
    log_file.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
