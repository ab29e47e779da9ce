"""Tensor-parallel rows of the decode benchmark (`bench_decode --mesh tp=N`).

Same rows and timings as `bench_decode.run_model` (`measure_engine`: synchronised ms,
ms_loop, prefill, compile, peak memory; every batch of `--batch`), on a ("data", "tp")
mesh: weights initialised straight into their shards, the dense engine under GSPMD, the
sparse engine under shard_map (per-shard top-k). Every row also reports the measured time
of one all-reduce of the [B, d] fp32 block output over "tp", the two all-reduces per layer,
and their share of the device-loop step (a decode step does 2 per layer; at batch 1 they
are latency-bound).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dejavu_jax import config as config_lib
from dejavu_jax import sharding, sparse, tp_decode
from dejavu_jax.params import param_bytes, unstack_layers

BF16 = jnp.bfloat16


def measure_allreduce(mesh, batch: int, width: int, reps: int = 200) -> float:
    """Seconds per psum over "tp" of a [batch, width] fp32 array (chained inside one jit)."""
    tp = sharding.tp_size(mesh)

    def chain(x):
        return jax.lax.fori_loop(0, reps, lambda i, y: jax.lax.psum(y, "tp") * (1.0 / tp), x)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    x = jnp.ones((batch, width), jnp.float32)
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / reps


def random_local_sets(config, scfg, tp: int, seed: int = 0):
    """Random per-shard index sets for `sparse.fixed_selector` under tp: [L, tp * k_local]
    with each shard's block holding sorted local unit ids."""
    rng = np.random.default_rng(seed)
    km = tp_decode.local_k(max(scfg.mlp_k), tp)
    kh = tp_decode.local_k(max(scfg.head_k), tp)
    f_loc, h_loc = config.ffn // tp, config.n_kv_heads // tp

    def sets(n, k):
        return np.stack([np.concatenate([np.sort(rng.choice(n, k, replace=False))
                                         for _ in range(tp)]) for _ in range(config.n_layers)])

    return jnp.asarray(sets(f_loc, km), jnp.int32), jnp.asarray(sets(h_loc, kh), jnp.int32)


def run_model_tp(name, contexts, mlp_densities, head_densities, batches, rank, dense_layers,
                 warmup, steps, bar, log, layout, select_methods, mesh,
                 modes=("dense", "sparse"), prefill_reps=3):
    """All rows for one preset on `mesh` (see `bench_decode.run_model` and
    `bench_decode.measure_engine` for the columns; GB/s per device and the all-reduce share
    come from ms_loop)."""
    from dejavu_jax.eval.bench_decode import (measure_engine, random_predictors, rates,
                                              sparse_variants, step_bytes)
    from dejavu_jax.eval.bench_hf import cache_len
    config = config_lib.preset(name)
    tp = sharding.tp_size(mesh)
    if isinstance(batches, int):
        batches = [batches]
    t0 = time.perf_counter()
    params = sharding.init_params_sharded(config, jax.random.key(0), BF16, mesh)
    if layout == "unrolled":
        params = sharding.shard_params(unstack_layers(params, free_stacked=True), mesh)
    jax.block_until_ready(params)
    log(f"{name} tp={tp}: {param_bytes(params) / 1e9:.1f} GB weights "
        f"({param_bytes(params) / tp / 1e9:.1f} GB per device), "
        f"init {time.perf_counter() - t0:.1f}s")
    preds = tp_decode.shard_predictors(random_predictors(config, rank, jax.random.key(1)), mesh)
    allreduce = {}
    for batch in batches:
        allreduce[batch] = measure_allreduce(mesh, batch, config.hidden)
        log(f"all-reduce [{batch}, {config.hidden}] fp32 over tp={tp}: "
            f"{allreduce[batch] * 1e6:.1f} us")
    init_kwargs = dict(per_layer=True) if layout == "unrolled" else {}
    rows = []

    def row(mode, ctx, batch, md, hdn, kind, res, nbytes, max_len):
        ar = allreduce[batch]
        r = dict(model=name, layout=layout, mode=mode, context=ctx, batch=batch,
                 cache_len=max_len, mlp=md, heads=hdn, indices=kind, tp=tp, **res,
                 **rates(nbytes, batch, res["ms"], res["ms_loop"]))
        r.update(gbs_per_device=r["gbs"] / tp, allreduce_us=ar * 1e6,
                 allreduce_ms_per_layer=2 * ar * 1e3,
                 allreduce_share=2 * config.n_layers * ar / (res["ms_loop"] / 1e3))
        rows.append(r)
        log(json.dumps(r))

    for ctx in contexts:
        max_len = cache_len(ctx, warmup, steps)
        for batch in batches:
            prompt = jax.random.randint(jax.random.key(2), (batch, ctx), 3, config.vocab_size)
            mask = jnp.ones_like(prompt)
            tokens = jnp.full((batch,), 42, jnp.int32)

            def measure(what, engine, engine_params):
                try:
                    return measure_engine(engine, engine_params, prompt, mask, tokens, max_len,
                                          warmup, steps, init_kwargs, prefill_reps)
                except Exception as e:  # report and go on with the other rows
                    log(f"FAILED {name} tp={tp} ctx={ctx} batch={batch} {what}: "
                        f"{type(e).__name__}: {str(e)[:400]}")
                    return None

            if "dense" in modes:
                res = measure("dense", tp_decode.tp_dense_engine(config, mesh), params)
                bar.update()
                if res is not None:
                    row("dense", ctx, batch, 1.0, 1.0, "-", res,
                        step_bytes(config, None, ctx, batch, rank, False), max_len)
            if "sparse" not in modes:
                continue
            for md in mlp_densities:
                for hdn in head_densities:
                    scfg = sparse.sparse_config(config, md, hdn, dense_layers=dense_layers)
                    fixed = (random_local_sets(config, scfg, tp)
                             if hdn == 0.5 and ctx == contexts[0] else None)
                    variants = sparse_variants(config, preds, select_methods, fixed)
                    for kind, select, sel_params in variants:
                        res = measure(f"mlp={md} heads={hdn} {kind}",
                                      tp_decode.tp_sparse_engine(config, scfg, select, mesh),
                                      (params, sel_params))
                        bar.update()
                        if res is not None:
                            row("sparse", ctx, batch, md, hdn, kind, res,
                                step_bytes(config, scfg, ctx, batch, rank,
                                           kind.startswith("predictor")), max_len)
    del params
    return rows


def markdown_tp(rows, roofline) -> str:
    """The markdown table of tensor-parallel rows (per-device bandwidth, all-reduce share;
    both from ms_loop). Speedups against HF compare with HF on one GPU."""
    from dejavu_jax.eval.bench_decode import _f
    cols = ("model", "layers", "tp", "mode", "ctx", "batch", "mlp", "heads", "indices",
            "ms (synced)", "ms_loop", "p90", "tokens/s", "GB read (all devices)",
            "GB/s per device", "% roofline", "prefill ms", "compile s", "peak GB per device",
            "all-reduce µs", "all-reduce share", "vs dense (synced / loop)", "vs hf-eager",
            "vs hf-compiled")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        peak = r.get("peak_bytes")
        vs_dense = ("–" if r.get("speedup") is None else
                    f"{r['speedup']:.2f}x / {_f(r.get('speedup_loop'), '.2f', 'x')}")
        cells = (r["model"], r["layout"], r["tp"], r["mode"], r["context"], r["batch"],
                 f"{r['mlp']:.2f}", f"{r['heads']:.2f}", r["indices"], f"{r['ms']:.3f}",
                 f"{r['ms_loop']:.3f}", f"{r['p90_ms']:.3f}", f"{r['tokens_per_s']:.0f}",
                 f"{r['bytes'] / 1e9:.2f}", f"{r['gbs_per_device']:.0f}",
                 f"{100 * r['gbs_per_device'] / (r.get('roofline_gbs') or roofline):.0f}%",
                 f"{r['prefill_ms']:.1f}",
                 f"{r['compile_s']:.1f}", _f(peak and peak / 1e9, ".1f"),
                 f"{r['allreduce_us']:.1f}", f"{100 * r['allreduce_share']:.0f}%", vs_dense,
                 _f(r.get("speedup_vs_hf_eager"), ".2f", "x"),
                 _f(r.get("speedup_vs_hf_compiled"), ".2f", "x"))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
