"""GPU timing of the parts of a sparse decode step that sit beside the weight reads.

  python -m dejavu_jax.kernels.bench_step_parts --model opt-30b --out results/

* ``attn-window``: head-sparse attention with and without the missing-KV window, for a
  few ``AttnConfig.window_block_rows`` values (the K/V rows per program of the projection
  launch once the window's inputs make it a tensor-core product).
* ``attn-config``: the same windowed attention (batch 1) at ``--context`` and 1024 for
  ``AttnConfig`` variants (``--attn-variants``), and ``mlp-config``: XLA's dense MLP, then
  the sparse MLP into fp32 residual rows (as the decode step runs it), both for ``--batch``
  rows, for ``MLPConfig`` variants (``--mlp-variants``) at ``--mlp-densities``; a variant
  is ``field=value[,field=value]``, variants are separated by ``/`` and ``base`` is the
  default config.
* ``out-proj``: the batch-1 out-projection of the selected heads into the residual, by the
  column-gather kernel the attention uses (3-D group-view loads, as the attention picks
  them) and by the row-gather kernel with split-k atomics it used before, for block, warp
  and stage variants (``--out-variants``).
* ``predictor``: the split predictor's selection launches (`kernels.predictor_select`) for
  score-product block variants (``--predictor-variants ROW_BLOCKSxBLOCK_D/...``).
* ``top-k``: the selection of k of the F MLP scores by the radix, chunked and packed
  methods of ``dejavu_jax.sparse_variants`` (the same set each) and ``lax.top_k``; ``local``
  (approximate) is timed in the step by ``eval.profile_decode``.

Timing as in :mod:`.bench`: calls chained inside one jitted loop. A top-k call is chained
through a tiny scatter of its result into the next scores; the ``scatter-only`` row times
that scatter alone, to subtract.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp

from . import bench
from .bench import HD, MODELS, _rand, _versions, attn_weights, chain_time, disjoint_sets
from .head_attention import AttnConfig, KVWindow, head_sparse_attention_pallas
from .sparse_mlp import MLPConfig
from .top_k import top_k_indices, top_k_indices_chunked


def attn_window_point(W, d, H, ctx, frac, *, window, config, seed=0):
    """µs per call of head-sparse attention at batch 1; window: tokens (0 = none)."""
    Kh = max(1, round(H * frac))
    refresh = -(-H // window) if window else 0
    pos = ctx - 1
    kk = jax.random.split(jax.random.PRNGKey(seed + 3), 4)
    x0 = _rand(kk[0], (1, d), jnp.bfloat16, 1.0)
    kc = _rand(kk[1], (1, H, ctx, HD), jnp.bfloat16, 1.0)
    vc = _rand(kk[2], (1, H, ctx, HD), jnp.bfloat16, 1.0)
    ring = _rand(kk[3], (1, max(window, 1), d), jnp.bfloat16, 1.0)
    posa = jnp.asarray(pos, jnp.int32)
    sets = disjoint_sets(H, Kh, seed=seed)
    extra = jnp.arange(refresh, dtype=jnp.int32)

    def step(c, W, hidx):
        x, kc, vc = c
        win = None
        if window:
            # the current token's input goes into its ring row, as the decode step does
            win = KVWindow(x=ring.at[:, 0].set(x), current=jnp.int32(0), extra_ids=extra,
                           need=jnp.ones((1, Kh + refresh, window), bool),
                           slots=pos - jnp.arange(window, dtype=jnp.int32))
        y, kc, vc = head_sparse_attention_pallas(
            x, W["wq"], W["bq"], W["wk"], W["bk"], W["wv"], W["bv"], W["wo"], W["bo"],
            kc, vc, posa, hidx, config=config, window=win, interpret=bench.INTERPRET)
        return y.astype(x.dtype), kc, vc

    need = (4 * Kh + 2 * refresh) * HD * d * 2 + 2 * Kh * ctx * HD * 2
    t, _ = chain_time(step, (x0, kc, vc), W, sets, est_s=need / 3e12 + 20e-6)
    return dict(part="attn-window", d=d, H=H, ctx=ctx, frac=frac, Kh=Kh, window=window,
                refresh=refresh, window_block_rows=config.window_block_rows,
                bytes=need, time_us=t * 1e6, gbps=need / t / 1e9)


def predictor_point(d, F, H, rank, k_mlp, k_heads, *, row_blocks, block_d, deferred=False,
                    select_warps=None, seed=0):
    """µs per call of the split predictor's selection (`kernels.predictor_select`) at batch
    1, chained through a tiny scatter of its neuron ids into the next call's partials."""
    from .predictor_select import predictor_select
    L = 4
    ks = jax.random.split(jax.random.PRNGKey(seed + 11), 4)
    w = dict(b1=jnp.zeros((L, 2 * rank), jnp.float32),
             w2m=_rand(ks[0], (L, rank, F), jnp.bfloat16, rank ** -0.5),
             b2m=jnp.zeros((L, F), jnp.float32),
             w2h=_rand(ks[1], (L, rank, H), jnp.bfloat16, rank ** -0.5),
             b2h=jnp.zeros((L, H), jnp.float32))
    sets = [jnp.int32(i) for i in range(L)]

    def step(h, w, layer):
        neurons, heads = predictor_select(h, w["b1"], w["w2m"], w["b2m"], w["w2h"], w["b2h"],
                                          layer, k_mlp, k_heads, row_blocks=row_blocks,
                                          block_d=block_d, deferred_sum=deferred,
                                          select_warps=select_warps)
        bump = (neurons[:1].astype(jnp.float32) + heads[:1].astype(jnp.float32)) * 1e-9
        return h.at[0, 0, :1].add(bump)

    h0 = _rand(ks[2], (2, 1, 2 * rank), jnp.float32, 1.0)
    need = rank * F * 2 + rank * H * 2
    t, _ = chain_time(step, h0, w, sets, est_s=need / 3e12 + 10e-6)
    return dict(part="predictor", F=F, H=H, rank=rank, row_blocks=row_blocks,
                block_d=block_d, deferred=bool(deferred), select_warps=select_warps,
                bytes=need, time_us=t * 1e6, gbps=need / t / 1e9)


def out_proj_point(d, H, frac, *, kernel, block_rows, block_d, row_blocks=None, num_warps=4,
                   num_stages=2, seed=0):
    """µs per call of the batch-1 out-projection of the fraction ``frac`` of H heads into an
    fp32 residual: ``rows`` (`gather_matvec_t` on the ``[H * hd, d]`` per-head rows, split-k
    with atomics) or ``cols`` (`gather_cols_matvec` on the ``[d, H * hd]`` layout, as the
    attention runs it: whole output rows per program, no atomics, group-view loads when
    the head width is a power of two within ``block_d``)."""
    from ._common import cdiv, is_pow2
    from .column_gather import gather_cols_matvec
    from .gather_matvec import gather_matvec_t
    from ._common import sm_count
    from .head_attention import merged_attention_loader
    Kh = max(1, round(H * frac))
    ks = jax.random.split(jax.random.PRNGKey(seed + 5), 3)
    shape = (H * HD, d) if kernel == "rows" else (d, H * HD)
    w = _rand(ks[0], shape, jnp.bfloat16, (H * HD) ** -0.5)
    bias = _rand(ks[1], (d,), jnp.bfloat16, 0.1)
    attn = _rand(ks[2], (1, 1, Kh * HD), jnp.float32, 1.0)
    load = functools.partial(merged_attention_loader, ns=0, B=1, Bp=1, hd=HD)
    sets = disjoint_sets(H, Kh, seed=seed)
    if kernel == "rows":
        r2 = row_blocks or max(1, min(64, cdiv(Kh * HD, block_rows) * cdiv(d, block_d)
                                      // (8 * sm_count())))

        def step(res, w, ids):
            return gather_matvec_t([attn], load, w, ids, B=1, rows_per_id=HD,
                                   block_rows=block_rows, block_d=block_d,
                                   row_blocks_per_program=r2, residual=res, bias=bias,
                                   interpret=bench.INTERPRET) * 0.5
    else:
        group_view = is_pow2(HD) and HD <= block_d

        def step(res, w, ids):
            return gather_cols_matvec([attn], load, w, ids, B=1, cols_per_id=HD,
                                      block_rows=block_rows, block_cols=block_d,
                                      residual=res, bias=bias,
                                      group_view=group_view, num_warps=num_warps,
                                      num_stages=num_stages, interpret=bench.INTERPRET) * 0.5
    need = Kh * HD * d * 2
    t, _ = chain_time(step, jnp.zeros((1, d), jnp.float32), w, sets,
                      est_s=need / 3e12 + 5e-6)
    return dict(part="out-proj", d=d, H=H, Kh=Kh, kernel=kernel, block_rows=block_rows,
                block_d=block_d, row_blocks=row_blocks, num_warps=num_warps,
                num_stages=num_stages,
                bytes=need, time_us=t * 1e6, gbps=need / t / 1e9)


def parse_out_variant(item: str) -> dict:
    """``"cols:8x512[,num_warps=8][,num_stages=3]"`` -> out_proj_point keywords."""
    head, *options = item.split(",")
    kernel, _, blocks = head.partition(":")
    block_rows, block_d = map(int, blocks.split("x"))
    out = dict(kernel=kernel, block_rows=block_rows, block_d=block_d)
    for kv in options:
        key, _, value = kv.partition("=")
        if key not in ("num_warps", "num_stages"):
            raise ValueError(f"unknown out-proj option {key!r} in {item!r}")
        if kernel != "cols":
            raise ValueError(f"out-proj options apply to the cols kernel only: {item!r}")
        out[key] = int(value)
    return out


def parse_blocks(spec: str) -> tuple[int, int, bool]:
    """A predictor variant's ``"AxB"`` or ``"AxBd"`` -> (A, B, deferred sum)."""
    a, b = map(int, spec.rstrip("d").split("x"))
    return a, b, spec.endswith("d")


def parse_variants(spec: str, cls) -> list:
    """Config variants from ``"base/field=value,field=value/..."`` (values are ints)."""
    out = []
    for item in filter(None, spec.split("/")):
        fields = {}
        if item != "base":
            for kv in item.split(","):
                key, _, value = kv.partition("=")
                if key not in {f.name for f in dataclasses.fields(cls)}:
                    raise ValueError(f"{cls.__name__} has no field {key!r}")
                fields[key] = None if value == "None" else int(value)
        out.append((item, dataclasses.replace(cls(), **fields)))
    return out


def top_k_point(n: int, k: int, method: str, seed=0):
    """µs per call of one top-k method on n fp32 scores (chained through a scatter)."""
    from dejavu_jax.topk import packed_top_k
    fns = {"radix": lambda s: top_k_indices(s, k),
           "chunked": lambda s: top_k_indices_chunked(s, k),
           "packed": lambda s: packed_top_k(s, k),
           "lax.top_k": lambda s: jax.lax.top_k(s, k)[1],
           "scatter-only": lambda s: jnp.arange(k, dtype=jnp.int32) * (n // k)}
    select = fns[method]
    sets = [jax.random.normal(jax.random.PRNGKey(seed + i), (n,), jnp.float32)
            for i in range(4)]

    def step(c, _, s):
        idx = select(c + s)
        return c.at[idx].add(1e-3)

    t, _ = chain_time(step, jnp.zeros((n,), jnp.float32), None, sets, est_s=20e-6)
    return dict(part="top-k", n=n, k=k, method=method, time_us=t * 1e6)


def main(argv=None):
    """Time the step parts for one model preset; writes JSON lines and a summary JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="opt-30b", choices=sorted(MODELS))
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--heads", type=float, default=0.5, help="head density (fraction of the heads)")
    p.add_argument("--mlp", type=float, default=0.1, help="MLP density (fraction of the neurons)")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--window-block-rows", default="16,32,64")
    p.add_argument("--parts", default="attn-window,top-k")
    p.add_argument("--attn-variants", default="base/seq_splits=1")
    p.add_argument("--mlp-variants", default="base/num_stages=3")
    p.add_argument("--mlp-densities", type=lambda v: [float(x) for x in v.split(",")],
                   default=None, help="the mlp-config part's densities (default --mlp)")
    p.add_argument("--batch", type=int, default=1, help="rows of the mlp-config part (others: 1)")
    p.add_argument("--predictor-variants", default="4x512/2x512/1x512/1x256",
                   help="split predictor score product: ROW_BLOCKSxBLOCK_D[d][wN] ('d': deferred "
                        "sum, wN: N warps in the selection launch), '/'-separated")
    p.add_argument("--rank", type=int, default=256, help="predictor rank for the predictor part")
    p.add_argument("--out-variants",
                   default="cols:8x512/cols:16x512/cols:8x1024/cols:8x512,num_warps=8",
                   help="out-proj part: KERNEL:BLOCK_ROWSxBLOCK_D[,OPTION=VALUE...] "
                        "(options num_warps, num_stages, for cols; KERNEL rows or cols), "
                        "'/'-separated")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    from dejavu_jax.eval.parity_gate import add_parity_argument, require_parity
    add_parity_argument(p)
    args = p.parse_args(argv)
    d, H = MODELS[args.model]
    rows = [dict(part="kernel_parity", **require_parity(args.parity, args.out))]

    def log(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    parts = args.parts.split(",")
    if "attn-window" in parts:
        W = attn_weights(d, H)
        log(attn_window_point(W, d, H, args.context, args.heads, window=0, config=AttnConfig()))
        for rows_per_prog in map(int, args.window_block_rows.split(",")):
            cfg = dataclasses.replace(AttnConfig(), window_block_rows=rows_per_prog)
            log(attn_window_point(W, d, H, args.context, args.heads, window=args.window,
                                  config=cfg))
        del W
    if "attn-config" in parts:
        W = attn_weights(d, H)
        for ctx in sorted({args.context, 1024}):
            for name, cfg in parse_variants(args.attn_variants, AttnConfig):
                row = attn_window_point(W, d, H, ctx, args.heads, window=args.window,
                                        config=cfg)
                log({**row, "part": "attn-config", "variant": name})
        del W
    if "mlp-config" in parts:
        W = bench.mlp_weights(d)
        log({**bench.bench_mlp_point(W, d, args.batch, 1.0, which="dense"),
             "part": "mlp-config", "variant": "xla-dense"})
        for name, cfg in parse_variants(args.mlp_variants, MLPConfig):
            for density in args.mlp_densities or [args.mlp]:
                row = bench.bench_mlp_point(W, d, args.batch, density, which="sparse",
                                            config=cfg, residual=True)
                log({**row, "part": "mlp-config", "variant": name})
        del W
    if "out-proj" in parts:
        for item in args.out_variants.split("/"):
            log(out_proj_point(d, H, args.heads, **parse_out_variant(item)))
    if "predictor" in parts:
        F = 4 * d
        for item in args.predictor_variants.split("/"):
            blocks, _, warps = item.partition("w")
            row_blocks, block_d, deferred = parse_blocks(blocks)
            log(predictor_point(d, F, H, args.rank, max(1, round(F * args.mlp)),
                                max(1, round(H * args.heads)), row_blocks=row_blocks,
                                block_d=block_d, deferred=deferred,
                                select_warps=int(warps) if warps else None))
    if "top-k" in parts:
        F = 4 * d
        k = max(1, round(F * args.mlp))
        for method in ("scatter-only", "radix", "chunked", "packed", "lax.top_k"):
            log(top_k_point(F, k, method))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_step_parts.json"), "w") as f:
        json.dump({"meta": _versions(), "args": vars(args), "rows": rows}, f, indent=1,
                  default=str)   # the --parity path


if __name__ == "__main__":
    main()
