"""Decode latency benchmark: dense against DejaVu sparse, per token, batch 1 and up.

  python -m dejavu_jax.eval.bench_decode --models opt-6.7b,opt-13b --contexts 128,1024 \
      --mlp 0.05,0.1,0.15 --heads 0.25,0.5,1.0 --out results/

Random weights (bf16) and random predictors of rank `--rank`. Every row reports the median
ms/token over timed steps, the bytes a step must read (weights of the selected units,
their KV, predictors) and the achieved GB/s; `roofline_gbs` is a large dense GEMV
measured in the same run. Rows marked `indices=fixed` use precomputed index sets (no
predictor), which isolates the predictor's cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dejavu_jax import config as config_lib
from dejavu_jax import model, sparse
from dejavu_jax.params import init_params, param_bytes, unstack_layers
from dejavu_jax.train.predictor_model import Predictor, PredictorParams

BF16 = jnp.bfloat16


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


def random_sets(config, scfg, seed: int = 0):
    """Sorted random index sets per layer: (neurons [L, Kmax], groups [L, Khmax])."""
    rng = np.random.default_rng(seed)
    km, kh = max(scfg.mlp_k), max(scfg.head_k)
    neurons = np.stack([np.sort(rng.choice(config.ffn, km, replace=False))
                        for _ in range(config.n_layers)])
    groups = np.stack([np.sort(rng.choice(config.n_kv_heads, kh, replace=False))
                       for _ in range(config.n_layers)])
    return jnp.asarray(neurons, jnp.int32), jnp.asarray(groups, jnp.int32)


def sparse_variants(config, preds, select_methods, fixed_sets=None,
                    diagnose_kv_recompute=False):
    """(row label, selector, selector params) for the sparse rows of one setting.

    One predictor row per top-k method; with fixed_sets, a row with precomputed indices
    (and optionally the same without missing-KV recomputation, a diagnostic).
    """
    variants = [(f"predictor-{m}", sparse.predictor_selector(config.group_size, method=m), preds)
                for m in select_methods]
    if fixed_sets is not None:
        variants.append(("fixed", sparse.fixed_selector, fixed_sets))
        if diagnose_kv_recompute:
            variants.append(("fixed/no-kv-recompute", sparse.fixed_selector, fixed_sets))
    return variants


def step_bytes(config, scfg, context: int, batch: int, rank: int, predictors: bool) -> int:
    """Bytes a decode step must read: selected weights, their KV, predictors, embeddings."""
    d, hd, G, b = config.hidden, config.head_dim, config.group_size, 2
    mlp_rows = 3 if config.gated_mlp else 2
    total = config.vocab_size * config.embed_dim * b + batch * d * b  # LM head, embedding rows
    for layer in range(config.n_layers):
        km = config.ffn if scfg is None else scfg.mlp_k[layer]
        kh = config.n_kv_heads if scfg is None else scfg.head_k[layer]
        total += km * mlp_rows * d * b
        total += kh * (2 * G + 2) * hd * d * b
        total += batch * kh * 2 * context * hd * b
        if predictors and scfg is not None and layer >= scfg.dense_layers:
            total += (d * rank + rank * (config.ffn + config.n_heads)) * b
    return total


def measure_roofline(gb: float = 4.0) -> float:
    """GB/s of XLA's dense GEMV on a matrix of `gb` GB (bf16), median of 20 calls."""
    n = int((gb * 1e9 / 2) ** 0.5) // 128 * 128
    w = jax.random.normal(jax.random.key(0), (n, n), BF16)
    x = jax.random.normal(jax.random.key(1), (n,), BF16)
    f = jax.jit(lambda w, x: w @ x)
    f(w, x).block_until_ready()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        f(w, x).block_until_ready()
        times.append(time.perf_counter() - t)
    return n * n * 2 / float(np.median(times)) / 1e9


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


def run_model(name, contexts, mlp_densities, head_densities, batch, rank, dense_layers,
              warmup, steps, bar, log, layout="unrolled", select_methods=("exact",),
              kv_recompute_off=False):
    """All rows for one model preset, with the layers stacked (scan) or unrolled."""
    config = config_lib.preset(name)
    t0 = time.perf_counter()
    params = init_params(config, jax.random.key(0), BF16)
    if layout == "unrolled":
        params = unstack_layers(params, free_stacked=True)
    jax.block_until_ready(params)
    log(f"{name}: {param_bytes(params) / 1e9:.1f} GB weights, init {time.perf_counter() - t0:.1f}s")
    preds = random_predictors(config, rank, jax.random.key(1))
    tokens = jnp.ones((batch,), jnp.int32) * 42
    rows = []
    for ctx in contexts:
        max_len = ctx + warmup + steps + 64
        prompt = jax.random.randint(jax.random.key(2), (batch, ctx), 3, config.vocab_size)
        mask = jnp.ones_like(prompt)

        def fresh_dense():
            st = model.init_state(config, batch, max_len, BF16, per_layer=layout == "unrolled")
            return model.prefill(config, params, prompt, mask, st)[1]

        step = jax.jit(lambda p, s, t: model.decode_step_fn(config, p, s, t), donate_argnums=1)
        t = time.perf_counter()
        state = fresh_dense()
        med, p90, state = time_decode(step, params, state, tokens, warmup, steps)
        compile_s = time.perf_counter() - t
        dense_ms = med * 1e3
        nbytes = step_bytes(config, None, ctx, batch, rank, False)
        rows.append(dict(model=name, layout=layout, mode="dense", context=ctx, batch=batch, mlp=1.0, heads=1.0,
                         indices="-", ms=dense_ms, p90_ms=p90 * 1e3, bytes=nbytes,
                         gbs=nbytes / med / 1e9, speedup=1.0, wall_s=compile_s))
        log(json.dumps(rows[-1]))
        bar.update()
        del state
        for md in mlp_densities:
            for hdn in head_densities:
                scfg = sparse.sparse_config(config, md, hdn, dense_layers=dense_layers)
                fixed = (random_sets(config, scfg) if hdn == 0.5 and ctx == contexts[0]
                         else None)
                variants = sparse_variants(config, preds, select_methods, fixed,
                                           kv_recompute_off)
                for kind, select, sel_params in variants:
                    run_cfg = (dataclasses.replace(scfg, kv_recompute=False)
                               if kind.endswith("no-kv-recompute") else scfg)
                    eng = sparse.sparse_engine(config, run_cfg, select)
                    t = time.perf_counter()
                    st = eng.init_state(batch, max_len, BF16, per_layer=layout == "unrolled")
                    st = jax.jit(eng.prefill, donate_argnums=3)((params, sel_params), prompt,
                                                               mask, st)[1]
                    sstep = jax.jit(eng.step, donate_argnums=1)
                    try:
                        med, p90, st = time_decode(sstep, (params, sel_params), st, tokens,
                                                   warmup, steps)
                    except Exception as e:  # report and go on with the other rows
                        log(f"FAILED {name} ctx={ctx} mlp={md} heads={hdn} {kind}: "
                            f"{type(e).__name__}: {str(e)[:400]}")
                        continue
                    nbytes = step_bytes(config, scfg, ctx, batch, rank, kind.startswith("predictor"))
                    rows.append(dict(model=name, layout=layout, mode="sparse", context=ctx, batch=batch,
                                     mlp=md, heads=hdn, indices=kind, ms=med * 1e3,
                                     p90_ms=p90 * 1e3, bytes=nbytes, gbs=nbytes / med / 1e9,
                                     speedup=dense_ms / (med * 1e3),
                                     wall_s=time.perf_counter() - t))
                    log(json.dumps(rows[-1]))
                    bar.update()
                    del st
    return rows


def markdown(rows, roofline) -> str:
    """A markdown table of the rows."""
    head = ("| model | layers | mode | ctx | batch | mlp | heads | indices | ms/token | p90 | "
            "GB read | GB/s | % roofline | speedup vs dense |\n|" + "---|" * 14)
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r.get('layout', 'stacked')} | {r['mode']} | {r['context']} | {r['batch']} | {r['mlp']:.2f} | "
            f"{r['heads']:.2f} | {r['indices']} | {r['ms']:.3f} | {r['p90_ms']:.3f} | "
            f"{r['bytes'] / 1e9:.2f} | {r['gbs']:.0f} | {100 * r['gbs'] / roofline:.0f}% | "
            f"{r['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; writes JSON and markdown into --out."""
    p = argparse.ArgumentParser(prog="python -m dejavu_jax.eval.bench_decode")
    p.add_argument("--models", default="opt-6.7b,opt-13b,opt-30b")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--mlp", default="0.05,0.1,0.15")
    p.add_argument("--heads", default="0.25,0.5,1.0")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=256, help="predictor hidden width r")
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layouts", default="unrolled",
                   help="stacked (lax.scan over stacked layers), unrolled, or both")
    p.add_argument("--select", default="exact", help="predictor top-k: exact, threshold or both")
    p.add_argument("--diagnose-kv-recompute", action="store_true",
                   help="add a fixed-index row without missing-KV recomputation (inexact)")
    p.add_argument("--out", default="eval/results")
    p.add_argument("--mesh", help="tensor-parallel mesh, e.g. 'tp=2' (rows from eval/bench_tp.py)")
    p.add_argument("--devices", type=int, help="shorthand for --mesh tp=N")
    args = p.parse_args(argv)
    mesh = None
    if args.mesh or args.devices:  # tensor parallel (dejavu_jax.sharding)
        from dejavu_jax import sharding
        sizes = sharding.parse_mesh(args.mesh) if args.mesh else {"data": 1, "tp": args.devices}
        mesh = sharding.make_mesh(**sizes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    split = lambda s, f: [f(v) for v in s.split(",") if v]  # noqa: E731
    models, contexts = split(args.models, str), split(args.contexts, int)
    mlps, heads = split(args.mlp, float), split(args.heads, float)
    import sys
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(command="python -m dejavu_jax.eval.bench_decode " + argv_text,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(jax, "lib") else "",
                python=platform.python_version(), rank=args.rank,
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                dense_layers=args.dense_layers,
                mesh=None if mesh is None else dict(mesh.shape))
    log_file = open(out / "bench_decode.log", "a")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    meta["roofline_gbs"] = measure_roofline(4.0 if jax.default_backend() == "gpu" else 0.05)
    log(f"roofline (dense GEMV) {meta['roofline_gbs']:.0f} GB/s")
    n_rows = len(models) * len(contexts) * (1 + len(mlps) * len(heads)) + len(models) * len(mlps)
    bar = tqdm(total=n_rows, desc="decode benchmark")
    rows = []
    for name in models:
        for layout in split(args.layouts, str):
            if mesh is not None:
                from dejavu_jax.eval.bench_tp import run_model_tp
                rows += run_model_tp(name, contexts, mlps, heads, args.batch, args.rank,
                                     args.dense_layers, args.warmup, args.steps, bar, log,
                                     layout, tuple(split(args.select, str)), mesh)
                continue
            rows += run_model(name, contexts, mlps, heads, args.batch, args.rank,
                              args.dense_layers, args.warmup, args.steps, bar, log, layout,
                              tuple(split(args.select, str)), args.diagnose_kv_recompute)
        (out / "bench_decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    table = markdown(rows, meta["roofline_gbs"])
    if mesh is not None:
        from dejavu_jax.eval.bench_tp import markdown_tp
        table = markdown_tp(rows, meta["roofline_gbs"])
    (out / "bench_decode.md").write_text(
        f"# Decode benchmark\n\n{json.dumps(meta, indent=1)}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
