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

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dejavu_jax import config as config_lib
from dejavu_jax import sharding, tp_decode
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
    with each shard's block starting with the layer's sorted local unit ids
    (`bench_decode.layer_rows`)."""
    from dejavu_jax.eval.bench_decode import layer_rows
    rng = np.random.default_rng(seed)
    f_loc, h_loc = config.ffn // tp, config.n_heads // tp

    def sets(n, ks):
        local = [tp_decode.local_k(k, tp) for k in ks]
        return np.concatenate([layer_rows(rng, n, local, max(local)) for _ in range(tp)], 1)

    return (jnp.asarray(sets(f_loc, scfg.mlp_k), jnp.int32),
            jnp.asarray(sets(h_loc, scfg.head_k), jnp.int32))


def run_model_tp(name, contexts, mlp_densities, head_densities, batches, rank, dense_layers,
                 warmup, steps, bar, log, layout, select_methods, mesh,
                 modes=("dense", "sparse"), prefill_reps=3, loop_only=False):
    """All rows for one preset on `mesh` (see `bench_decode.run_model` and
    `bench_decode.measure_engine` for the columns; GB/s per device and the all-reduce share
    come from ms_loop)."""
    from dejavu_jax.eval.bench_decode import measure_rows, random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
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
    preds = tp_decode.shard_predictors(
        decode_predictors(random_predictors(config, rank, jax.random.key(1))), mesh)
    allreduce = {}
    for batch in batches:
        allreduce[batch] = measure_allreduce(mesh, batch, config.hidden)
        log(f"all-reduce [{batch}, {config.hidden}] fp32 over tp={tp}: "
            f"{allreduce[batch] * 1e6:.1f} us")
    def make_row(r):
        ar = allreduce[r["batch"]]
        return dict(model=name, layout=layout, tp=tp, **r, gbs_per_device=r["gbs"] / tp,
                    allreduce_us=ar * 1e6, allreduce_ms_per_layer=2 * ar * 1e3,
                    allreduce_share=2 * config.n_layers * ar / (r["ms_loop"] / 1e3))

    rows = measure_rows(
        config, params, preds, contexts, mlp_densities, head_densities, batches, rank,
        dense_layers, warmup, steps, bar, log, select_methods, modes, prefill_reps,
        init_kwargs=dict(per_layer=True) if layout == "unrolled" else {},
        label=f"{name} tp={tp}", dense=tp_decode.tp_dense_engine(config, mesh),
        sparse_engine=lambda scfg, select: tp_decode.tp_sparse_engine(config, scfg, select,
                                                                      mesh),
        fixed_sets=lambda scfg, batch: random_local_sets(config, scfg, tp), make_row=make_row,
        loop_only=loop_only, dense_qkv="separate")  # sharded by head: q/k/v stay apart
    del params
    return rows


def markdown_tp(rows, meta: dict) -> str:
    """The markdown table of tensor-parallel rows (per-device bandwidth, all-reduce share;
    both from ms_loop). Speedups against HF compare with HF on one GPU."""
    from dejavu_jax.eval.bench_decode import _f, bandwidth_cells, speedup_cells, table
    cols = ("model", "layers", "tp", "mode", "ctx", "batch", "mlp", "heads", "indices",
            "ms (synced)", "ms_loop", "p90", "tokens/s", "GB read (all devices)",
            "GB/s per device", "% spec", "% best measured", "prefill ms", "compile s", "peak GB per device",
            "all-reduce µs", "all-reduce share", "vs dense (synced / loop)", "vs hf-eager",
            "vs hf-compiled")

    def cells(r):
        peak = r.get("peak_bytes")
        return (r["model"], r["layout"], r["tp"], r["mode"], r["context"], r["batch"],
                f"{r['mlp']:.2f}", f"{r['heads']:.2f}", r["indices"], _f(r.get("ms"), ".3f"),
                f"{r['ms_loop']:.3f}", _f(r.get("p90_ms"), ".3f"), f"{r['tokens_per_s']:.0f}",
                f"{r['bytes'] / 1e9:.2f}", f"{r['gbs_per_device']:.0f}",
                *bandwidth_cells(r["gbs_per_device"], r, meta),
                f"{r['prefill_ms']:.1f}", f"{r['compile_s']:.1f}", _f(peak and peak / 1e9, ".1f"),
                f"{r['allreduce_us']:.1f}", f"{100 * r['allreduce_share']:.0f}%",
                *speedup_cells(r))

    return table(cols, rows, cells)
