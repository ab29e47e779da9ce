"""Tensor-parallel rows of the decode benchmark (`bench_decode --mesh tp=N`).

Same rows as `bench_decode.run_model`, on a ("data", "tp") mesh: weights initialised
straight into their shards, the dense engine under GSPMD, the sparse engine under
shard_map (per-shard top-k). Every row also reports the measured time of one all-reduce
of the [B, d] fp32 block output over "tp", the two all-reduces per layer, and their share
of the step (a decode step does 2 per layer; at batch 1 they are latency-bound).
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


def run_model_tp(name, contexts, mlp_densities, head_densities, batch, rank, dense_layers,
                 warmup, steps, bar, log, layout, select_methods, mesh):
    """All rows for one preset on `mesh` (see `bench_decode.run_model` for the columns)."""
    from dejavu_jax.eval.bench_decode import (random_predictors, sparse_variants, step_bytes,
                                              time_decode)
    config = config_lib.preset(name)
    tp = sharding.tp_size(mesh)
    t0 = time.perf_counter()
    params = sharding.init_params_sharded(config, jax.random.key(0), BF16, mesh)
    if layout == "unrolled":
        params = sharding.shard_params(unstack_layers(params, free_stacked=True), mesh)
    jax.block_until_ready(params)
    log(f"{name} tp={tp}: {param_bytes(params) / 1e9:.1f} GB weights "
        f"({param_bytes(params) / tp / 1e9:.1f} GB per device), "
        f"init {time.perf_counter() - t0:.1f}s")
    preds = tp_decode.shard_predictors(random_predictors(config, rank, jax.random.key(1)), mesh)
    allreduce = measure_allreduce(mesh, batch, config.hidden)
    log(f"all-reduce [{batch}, {config.hidden}] fp32 over tp={tp}: {allreduce * 1e6:.1f} us")
    tokens = jnp.ones((batch,), jnp.int32) * 42
    per_layer = dict(per_layer=True) if layout == "unrolled" else {}
    rows = []

    def row(mode, ctx, md, hdn, kind, med, p90, nbytes, dense_ms, wall):
        rows.append(dict(model=name, layout=layout, mode=mode, context=ctx, batch=batch,
                         mlp=md, heads=hdn, indices=kind, ms=med * 1e3, p90_ms=p90 * 1e3,
                         bytes=nbytes, gbs=nbytes / med / 1e9, tp=tp,
                         gbs_per_device=nbytes / tp / med / 1e9,
                         speedup=(dense_ms or med * 1e3) / (med * 1e3), wall_s=wall,
                         allreduce_us=allreduce * 1e6,
                         allreduce_ms_per_layer=2 * allreduce * 1e3,
                         allreduce_share=2 * config.n_layers * allreduce / med))
        log(json.dumps(rows[-1]))
        bar.update()

    def run(engine, engine_params, ctx, prompt, mask, max_len):
        st = engine.init_state(batch, max_len, BF16, **per_layer)
        st = jax.jit(engine.prefill, donate_argnums=3)(engine_params, prompt, mask, st)[1]
        med, p90, st = time_decode(jax.jit(engine.step, donate_argnums=1), engine_params, st,
                                   tokens, warmup, steps)
        del st
        return med, p90

    for ctx in contexts:
        max_len = ctx + warmup + steps + 64
        prompt = jax.random.randint(jax.random.key(2), (batch, ctx), 3, config.vocab_size)
        mask = jnp.ones_like(prompt)
        t = time.perf_counter()
        med, p90 = run(tp_decode.tp_dense_engine(config, mesh), params, ctx, prompt, mask,
                       max_len)
        dense_ms = med * 1e3
        row("dense", ctx, 1.0, 1.0, "-", med, p90,
            step_bytes(config, None, ctx, batch, rank, False), None, time.perf_counter() - t)
        for md in mlp_densities:
            for hdn in head_densities:
                scfg = sparse.sparse_config(config, md, hdn, dense_layers=dense_layers)
                fixed = (random_local_sets(config, scfg, tp)
                         if hdn == 0.5 and ctx == contexts[0] else None)
                variants = sparse_variants(config, preds, select_methods, fixed)
                for kind, select, sel_params in variants:
                    t = time.perf_counter()
                    try:
                        med, p90 = run(tp_decode.tp_sparse_engine(config, scfg, select, mesh),
                                       (params, sel_params), ctx, prompt, mask, max_len)
                    except Exception as e:  # report and go on with the other rows
                        log(f"FAILED {name} tp={tp} ctx={ctx} mlp={md} heads={hdn} {kind}: "
                            f"{type(e).__name__}: {str(e)[:400]}")
                        continue
                    row("sparse", ctx, md, hdn, kind, med, p90,
                        step_bytes(config, scfg, ctx, batch, rank, kind.startswith("predictor")),
                        dense_ms, time.perf_counter() - t)
    del params
    return rows


def markdown_tp(rows, roofline) -> str:
    """The markdown table of tensor-parallel rows (per-device bandwidth, all-reduce share)."""
    head = ("| model | layers | tp | mode | ctx | batch | mlp | heads | indices | ms/token | p90 | "
            "GB read (all devices) | GB/s per device | % roofline | all-reduce µs | "
            "all-reduce share | speedup vs dense |\n|" + "---|" * 17)
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['tp']} | {r['mode']} | {r['context']} | "
            f"{r['batch']} | {r['mlp']:.2f} | {r['heads']:.2f} | {r['indices']} | "
            f"{r['ms']:.3f} | {r['p90_ms']:.3f} | {r['bytes'] / 1e9:.2f} | "
            f"{r['gbs_per_device']:.0f} | {100 * r['gbs_per_device'] / roofline:.0f}% | "
            f"{r['allreduce_us']:.1f} | {100 * r['allreduce_share']:.0f}% | "
            f"{r['speedup']:.2f}x |")
    return "\n".join(lines)
