"""Decode speed of activation sparsity (threshold profiles) against dense and Hugging Face.

  python -m dejavu_jax.eval.bench_thresholds --models qwen2.5-1.5b,qwen2.5-7b,llama3-8b \
      --levels uniform:0.4,uniform:0.5,eval/results/cpu/.../profile.json --out DIR

Random bf16 weights of each preset's shapes. A level spec gives each layer's fraction of
channels dropped at each threshold site (`activation_sparsity.SITES`):
  uniform:S[:METHOD]  every layer at S on the method's sites (default teal: q/k/v, o,
                      gate/up, down)
  FILE.json           a profile's per-layer levels (`sparsity_profile`), mapped over depth
                      to the preset's layer count
Thresholds come from the magnitude quantiles of the model's own activations on a random
prompt (`train.thresholds`), so each site drops its fraction of channels. Rows: dense
(ours, `generation.dense_engine`), each level spec through the activation-sparse kernels
on input-major weights (`kernels.threshold_matvec`), and with --hf the Hugging Face
modes (`eval.bench_hf`). ms per token with the host synchronising each step (`ms`) and
with the steps chained on the device (`ms_loop`); the decoder bytes each step skips are
measured by the scorer on a random window at the same thresholds. `--layouts` picks the
threshold rows' weight layout: per-layer buffers (`unrolled`, as `generate` decodes) and/or
`stacked` (a `lax.scan` over stacked weights, whose host-synchronised step hands over a few
arrays instead of several per layer); the dense row always runs per-layer buffers.
`--kernels` adds the kernels alone at MLP shapes against XLA's dense ones (`time_kernels`).
The run opens with `eval.kernel_parity` on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax import config as config_lib
from dejavu_jax.eval import common
from dejavu_jax.activation_sparsity import SITES, layer_elements
from dejavu_jax.kernels import ThresholdBlocks, ThresholdConfig

BF16 = jnp.bfloat16


def spec_levels(config, spec: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """(levels [L, len(SITES)], sites) of a level spec (see the module doc)."""
    from dejavu_jax.sparsity_profile import load_profile, method_sites
    if spec.startswith("uniform:"):
        parts = spec.split(":")
        level, method = float(parts[1]), parts[2] if len(parts) > 2 else "teal"
        sites = method_sites(config, method)
        row = np.asarray([level if s in sites else 0.0 for s in SITES])
        return np.tile(row, (config.n_layers, 1)), sites
    profile = load_profile(spec)
    src = np.asarray(profile.levels, np.float64)
    depth = np.linspace(0, 1, len(src))
    at = np.linspace(0, 1, config.n_layers)
    levels = np.stack([np.interp(at, depth, src[:, s]) for s in range(len(SITES))], 1)
    return levels, profile.sites


def thresholds_for(config, params, levels: np.ndarray, tokens: int = 256) -> jax.Array:
    """Thresholds [L, len(SITES)] dropping `levels` of each site's channels on a random
    prompt's activations."""
    from dejavu_jax.train.thresholds import calibration_stats, thresholds_at
    ids = jax.random.randint(jax.random.key(7), (1, tokens), 3, config.vocab_size)
    stats = calibration_stats(config, params, ids, jnp.ones_like(ids), ())
    return jnp.asarray(thresholds_at(np.asarray(stats["quantiles"]), levels))


def measured_skip(config, params, scfg, thresholds, tokens: int = 64) -> float:
    """The fraction of decoder matmul bytes the thresholds skip, per the scorer, over a
    random window (its first position dense)."""
    from dejavu_jax.eval.sparse_scoring import read_fraction, scored_hidden
    ids = jax.random.randint(jax.random.key(8), (1, tokens), 3, config.vocab_size)
    _, sets = jax.jit(lambda p, t: scored_hidden(config, scfg, p, t, ids, jnp.ones_like(ids),
                                                 jnp.ones((1,), jnp.int32), True))(
        params, thresholds)
    return 1.0 - float(np.asarray(read_fraction(config, scfg, sets))[0, 1:].mean())


MLP_SHAPES = ((3584, 18944), (4096, 14336), (1536, 8960))  # (d, F): qwen2.5-7b, llama3-8b, 1.5b
KERNEL_GROUPS = ("gemv", "gemv-variants", "projections")


def chain_timer(reps: int = 50):
    """``timed(fn, *args)``: µs per call of ``fn`` chained `reps` times in one jit, the
    median of five chains (one chain is about a millisecond)."""
    def timed(fn, *args):
        def chain(*a):
            def body(_, acc):
                return acc + fn(*a)[0, :8].sum()
            return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
        run = jax.jit(chain)
        jax.block_until_ready(run(*args))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(run(*args))
            times.append(time.perf_counter() - t)
        return float(np.median(times)) / reps * 1e6
    return timed


def time_kernels(log, groups=KERNEL_GROUPS, shapes=MLP_SHAPES) -> list[dict]:
    """The kernels alone at MLP shapes (d, F), by group: ``gemv`` (the input-sparse and
    row-masked GEMVs against XLA's dense GEMV of the same matrix), ``gemv-variants`` (the
    input-sparse GEMV's block sizes), ``projections`` (the attention projections of
    small and large models by blocks per program)."""
    timed = chain_timer()
    rows = []
    if "gemv" in groups:
        rows += time_gemvs(log, timed, shapes)
    if "gemv-variants" in groups:
        rows += time_threshold_variants(log, timed, shapes)
    if "projections" in groups:
        rows += time_projections(log, timed)
    return rows


def time_gemvs(log, timed, shapes, sparsities=(0.0, 0.4, 0.5, 0.6)) -> list[dict]:
    """µs and GB/s of the input-sparse GEMV and the row-masked GEMV against XLA's dense
    GEMV of the same matrix."""
    from dejavu_jax.kernels.threshold_matvec import row_masked_matvec, threshold_matvec
    rows = []
    for d, F in shapes:
        key = jax.random.key(d)
        x = jax.random.normal(key, (1, F), BF16)
        w_t = jax.random.normal(key, (F, d), BF16) * 0.02
        w = jax.random.normal(key, (F, d), BF16) * 0.02
        y = jax.random.normal(key, (1, d), BF16)
        dense_us = timed(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32),
                         x, w_t)
        nbytes = F * d * 2
        rows.append(dict(kernel="xla-dense-gemv", d=d, F=F, sparsity=0.0, us=dense_us,
                         gbs=nbytes / dense_us / 1e3))
        down = ThresholdConfig().down.kwargs()  # the step's settings for this shape
        for s in sparsities:
            t = float(np.quantile(np.abs(np.asarray(x, np.float32)), s)) if s else 0.0
            us = timed(lambda a, b: threshold_matvec(a, b, t, impl="pallas", **down), x, w_t)
            read = nbytes * (1 - s)
            rows.append(dict(kernel="threshold_matvec", d=d, F=F, sparsity=s, us=us,
                             gbs=read / us / 1e3, vs_dense=dense_us / us))
            keep = jax.random.uniform(key, (F,)) >= s
            us = timed(lambda a, b, k: row_masked_matvec(a, b, k, impl="pallas"), y, w, keep)
            rows.append(dict(kernel="row_masked_matvec", d=d, F=F, sparsity=s, us=us,
                             gbs=read / us / 1e3, vs_dense=dense_us / us))
            log(json.dumps(rows[-2]))
            log(json.dumps(rows[-1]))
    return rows


# (K, N, into the residual) of q/k/v and the out-projection: qwen2.5-1.5b, qwen2.5-0.5b,
# smollm2-135m, llama3-8b
PROJECTIONS = ((1536, 2048, False), (1536, 1536, True), (896, 1152, False), (896, 896, True),
               (576, 960, False), (576, 576, True), (4096, 6144, False), (4096, 4096, True))


def time_projections(log, timed, sparsities=(0.0, 0.5), row_blocks=(None, 1, 2, 4)) -> list[dict]:
    """µs of the input-sparse GEMV at attention projections' shapes, batch 1, by blocks
    per program (None: the kernel's own choice), against XLA's dense GEMV (into the
    residual, like the out-projection, or as partials summed after, like q/k/v)."""
    from dejavu_jax.kernels.threshold_matvec import auto_row_blocks, threshold_matvec
    rows = []
    for K, N, residual in PROJECTIONS:
        key = jax.random.key(K + N)
        x = jax.random.normal(key, (1, K), BF16)
        w_t = jax.random.normal(key, (K, N), BF16) * 0.02
        r = jnp.zeros((1, N), jnp.float32)
        dense_us = timed(lambda a, b, res: res + jnp.dot(a, b, preferred_element_type=jnp.float32),
                         x, w_t, r)
        rows.append(dict(kernel="xla-dense-gemv", K=K, N=N, residual=residual, sparsity=0.0,
                         us=dense_us, gbs=K * N * 2 / dense_us / 1e3))
        log(json.dumps(rows[-1]))
        for s in sparsities:
            t = float(np.quantile(np.abs(np.asarray(x, np.float32)), s)) if s else 0.0
            for rb in row_blocks:
                fn = functools.partial(threshold_matvec, row_blocks=rb, impl="pallas")
                if residual:
                    def call(a, b, res, fn=fn, t=t):
                        return fn(a, b, t, residual=res)
                else:
                    def call(a, b, res, fn=fn, t=t):
                        return res + fn(a, b, t)
                us = timed(call, x, w_t, r)
                rows.append(dict(kernel="threshold_matvec", K=K, N=N, residual=residual,
                                 sparsity=s, row_blocks=rb or auto_row_blocks(K, N, 16, 512),
                                 auto=rb is None, us=us, gbs=K * N * 2 * (1 - s) / us / 1e3,
                                 vs_dense=dense_us / us))
                log(json.dumps(rows[-1]))
    return rows


# (block_rows, row_blocks, block_n, num_warps, num_stages) of the input-sparse GEMV
THRESHOLD_VARIANTS = ((16, 4, 512, 4, 2), (16, 8, 512, 4, 4), (16, 8, 512, 4, 5),
                      (32, 8, 256, 4, 4), (32, 8, 256, 4, 3), (16, 8, 256, 4, 4),
                      (16, 4, 512, 4, 4), (16, 8, 512, 8, 4))


def time_threshold_variants(log, timed, shapes, sparsities=(0.0, 0.5)) -> list[dict]:
    """µs of the input-sparse GEMV's block-size variants, batch 1, on both of an MLP's
    shapes: into the residual (the down projection, K = F; atomic adds, and as partials
    summed after for comparison) and as partials (the up projection, K = d)."""
    from dejavu_jax.kernels.threshold_matvec import threshold_matvec
    rows = []
    for d, F in shapes:
        for K, N, mode in ((F, d, "residual"), (F, d, "partials"), (d, F, "partials")):
            key = jax.random.key(K)
            x = jax.random.normal(key, (1, K), BF16)
            w_t = jax.random.normal(key, (K, N), BF16) * 0.02
            r = jnp.zeros((1, N), jnp.float32)
            for s in sparsities:
                t = float(np.quantile(np.abs(np.asarray(x, np.float32)), s)) if s else 0.0
                for bk, kb, bn, warps, stages in THRESHOLD_VARIANTS:
                    fn = functools.partial(threshold_matvec, block_rows=bk, row_blocks=kb,
                                           block_n=min(bn, N), num_warps=warps,
                                           num_stages=stages, impl="pallas")
                    if mode == "residual":
                        def call(a, b, res, fn=fn, t=t):
                            return fn(a, b, t, residual=res)
                    else:
                        def call(a, b, res, fn=fn, t=t):
                            return res + fn(a, b, t)
                    try:
                        us = timed(call, x, w_t, r)
                    except Exception as e:  # a variant Triton rejects: report, go on
                        log(f"variant {bk},{kb},{bn},{warps},{stages} failed: "
                            f"{type(e).__name__}: {str(e)[:200]}")
                        continue
                    rows.append(dict(kernel="threshold_matvec-variant", K=K, N=N,
                                     residual=mode == "residual", mode=mode, sparsity=s,
                                     block_rows=bk, row_blocks=kb, block_n=bn,
                                     num_warps=warps, num_stages=stages, us=us,
                                     gbs=K * N * 2 * (1 - s) / us / 1e3))
                    log(json.dumps(rows[-1]))
    return rows


def with_settings(config: ThresholdConfig, spec: str) -> ThresholdConfig:
    """`config` with ``SITE.FIELD=VALUE`` settings (comma-separated) replaced, e.g.
    ``"down.row_blocks=8,down.num_stages=4,o.evict_first=1"``; integers (0 or 1 for the
    switches), or ``None`` for row_blocks; and the layer-wide switches as ``FIELD=0|1``
    (``attention_kernel=0``)."""
    sites = tuple(f.name for f in dataclasses.fields(ThresholdConfig)
                  if isinstance(f.default, ThresholdBlocks))
    layer_switches = tuple(f.name for f in dataclasses.fields(ThresholdConfig)
                           if isinstance(f.default, bool))
    fields = {f.name for f in dataclasses.fields(ThresholdBlocks)}
    switches = {f.name for f in dataclasses.fields(ThresholdBlocks)
                if isinstance(f.default, bool)}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = (part.strip() for part in item.partition("="))
        if sep and name in layer_switches:
            if value not in ("0", "1"):
                raise ValueError(f"{item!r}: {name} is 0 or 1, not {value!r}")
            config = dataclasses.replace(config, **{name: value == "1"})
            continue
        site, dot, field = name.partition(".")
        if not sep or not dot or site not in sites or field not in fields:
            raise ValueError(f"{item!r} is not SITE.FIELD=VALUE (SITE one of {sites}, FIELD "
                             f"one of {sorted(fields)}) or SWITCH=0|1 (one of "
                             f"{layer_switches})")
        if value == "None" and field == "row_blocks":
            number = None
        elif field in switches:
            if value not in ("0", "1"):
                raise ValueError(f"{item!r}: {field} is 0 or 1, not {value!r}")
            number = value == "1"
        else:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"{item!r}: {value!r} is not an integer") from None
        blocks = dataclasses.replace(getattr(config, site), **{field: number})
        config = dataclasses.replace(config, **{site: blocks})
    return config


def block_variants(spec: str) -> list[tuple[str, ThresholdConfig]]:
    """[(name, ThresholdConfig)] of a --block-variants spec: the defaults ("default") and
    then each ``NAME:SITE.FIELD=VALUE,...`` of the ``;``-separated list."""
    out = [("default", ThresholdConfig())]
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, settings = item.partition(":")
        if not sep or not name.strip() or name.strip() in dict(out):
            raise ValueError(f"block variant {item!r} is not NAME:SETTINGS with a new NAME")
        out.append((name.strip(), with_settings(ThresholdConfig(), settings)))
    return out


LAYOUTS = ("unrolled", "stacked")


def run_model(name, specs, contexts, warmup, steps, log, variants=None,
              layouts=("unrolled",)) -> list[dict]:
    """Dense and threshold rows of one preset (each level spec under each of `variants`,
    `block_variants`; None: the default blocks) in each weight layout of `layouts`."""
    from dejavu_jax import sparse
    from dejavu_jax.eval.bench_decode import measure_engine, rates, step_bytes
    from dejavu_jax.eval.bench_hf import cache_len
    from dejavu_jax.generation import dense_engine
    from dejavu_jax.params import fuse_qkv, init_params, input_major, unstack_layers
    config = config_lib.preset(name)
    params = init_params(config, jax.random.key(0), BF16)
    layer_bytes = 2 * layer_elements(config) * config.n_layers
    from dejavu_jax.sparsity_profile import ProfileError
    prepared = []
    for spec in specs:
        try:
            prepared.append((spec, *spec_levels(config, spec)))
        except ProfileError as e:
            log(f"{name}: {spec} skipped: {e}")
    thresholds = {spec: thresholds_for(config, params, lv) for spec, lv, _ in prepared}
    skips = {spec: measured_skip(config, params, sparse.threshold_config(config, sites),
                                 thresholds[spec]) for spec, _, sites in prepared}
    rows = []
    dense_params = unstack_layers(fuse_qkv(params))
    for ctx in contexts:
        max_len = cache_len(ctx, warmup, steps)
        prompt = jax.random.randint(jax.random.key(2), (1, ctx), 3, config.vocab_size)
        mask, tokens = jnp.ones_like(prompt), jnp.full((1,), 42, jnp.int32)
        dense_bytes = step_bytes(config, None, ctx, 1, 0, False)
        res = measure_engine(dense_engine(config), dense_params, prompt, mask, tokens,
                             max_len, warmup, steps, dict(per_layer=True))
        rows.append(dict(model=name, mode="dense", levels="-", context=ctx, skipped=0.0, **res,
                         **rates(dense_bytes, 1, res["ms"], res["ms_loop"])))
        log(json.dumps(rows[-1]))
    del dense_params
    moved, moved_for = None, None
    for layout, (spec, _, sites), (blocks_name, blocks) in itertools.product(
            layouts, prepared, variants or block_variants("")):
        if moved_for != (layout, "gate" in sites):
            moved = None  # one input-major copy at a time
            moved_for = (layout, "gate" in sites)
            moved = input_major(params, up_rows="gate" in sites)
            if layout == "unrolled":
                moved = unstack_layers(moved)
        scfg = dataclasses.replace(sparse.threshold_config(config, sites),
                                   threshold_blocks=blocks)
        engine = sparse.sparse_engine(config, scfg, sparse.no_selector)
        for ctx in contexts:
            max_len = cache_len(ctx, warmup, steps)
            prompt = jax.random.randint(jax.random.key(2), (1, ctx), 3, config.vocab_size)
            mask, tokens = jnp.ones_like(prompt), jnp.full((1,), 42, jnp.int32)
            nbytes = step_bytes(config, None, ctx, 1, 0, False) - skips[spec] * layer_bytes
            try:
                res = measure_engine(engine, (moved, thresholds[spec]), prompt, mask, tokens,
                                     max_len, warmup, steps,
                                     dict(per_layer=layout == "unrolled"))
            except Exception as e:  # report (OOM, lowering) and go on
                log(f"FAILED {name} {spec} {blocks_name} {layout} ctx={ctx}: "
                    f"{type(e).__name__}: {str(e)[:400]}")
                continue
            rows.append(dict(model=name, mode="threshold", levels=spec, sites=list(sites),
                             layout=layout, blocks=blocks_name,
                             block_settings=dataclasses.asdict(blocks),
                             context=ctx, skipped=skips[spec], **res,
                             **rates(int(nbytes), 1, res["ms"], res["ms_loop"])))
            log(json.dumps(rows[-1]))
    return rows


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each row's ms_loop and ms against the same run's dense row (and HF rows) of its
    model and context."""
    for r in rows:
        for base in ("dense", "hf-compiled", "hf-eager"):
            ref = next((b for b in rows if b["mode"] == base and b["model"] == r["model"]
                        and b["context"] == r["context"]), None)
            if ref is None or r is ref:
                continue
            if base == "dense":
                r["x_dense_loop"] = ref["ms_loop"] / r["ms_loop"] if r.get("ms_loop") else None
                r["x_dense_synced"] = ref["ms"] / r["ms"] if r.get("ms") else None
            else:
                r[f"x_{base}"] = ref["ms"] / (r.get("ms_loop") or r["ms"])
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; writes bench_thresholds.json into --out."""
    from dejavu_jax.eval.bench_decode import measure_best_bandwidth, run_hf, spec_bandwidth
    from dejavu_jax.eval.parity_gate import add_parity_argument, require_parity
    from dejavu_jax.eval.provenance import run_meta
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.bench_thresholds",
                           description=__doc__.split("\n")[0])
    p.add_argument("--models", type=cli.presets, default="qwen2.5-1.5b,qwen2.5-7b,llama3-8b",
                   help="comma list of presets, timed with random bf16 weights of their shapes")
    p.add_argument("--levels", default="uniform:0.25,uniform:0.4,uniform:0.5",
                   help="comma list of level specs: uniform:S[:METHOD] or a profile file")
    p.add_argument("--contexts", default="128", help="comma list of context lengths")
    p.add_argument("--warmup", type=cli.non_negative_int, default=3,
                   help="untimed steps before each timing")
    p.add_argument("--steps", type=cli.positive_int, default=20, help="timed steps per row")
    p.add_argument("--hf", default="", help="HF modes to time too: hf-eager,hf-compiled")
    p.add_argument("--hf-python", default=sys.executable,
                   help="interpreter with torch + transformers for the HF modes")
    p.add_argument("--kernels", type=cli.choice_list(KERNEL_GROUPS), default=(),
                   help=f"also time the kernels alone: a comma list of {', '.join(KERNEL_GROUPS)}")
    p.add_argument("--no-models", action="store_true", help="the kernels only")
    p.add_argument("--block-variants", default="",
                   help="kernel block settings to time each level under, besides the "
                        "defaults: NAME:SITE.FIELD=VALUE,...;NAME:... (SITE qkv, o, gate_up, "
                        "down; FIELD of kernels.ThresholdBlocks), or NAME:attention_kernel=0")
    p.add_argument("--layouts", type=cli.choice_list(LAYOUTS), default=("unrolled",),
                   help="the threshold rows' weight layouts, a comma list of unrolled "
                        "(per-layer buffers) and stacked (lax.scan over stacked weights)")
    p.add_argument("--out", type=cli.output_dir, required=True,
                   help="folder for bench_thresholds.json and .log")
    add_parity_argument(p)
    args = p.parse_args(argv)
    models = args.models
    specs = [s for s in args.levels.split(",") if s]
    for spec in specs:
        if not spec.startswith("uniform:") and not Path(spec).is_file():
            p.error(f"--levels: {spec} is neither uniform:S[:METHOD] nor a profile file")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    try:
        variants = block_variants(args.block_variants)
    except ValueError as e:
        p.error(f"--block-variants: {e}")
    if args.no_models and not args.kernels:
        p.error("--no-models leaves nothing to time without --kernels")
    hf_modes = [m for m in args.hf.split(",") if m] if not args.no_models else []

    def check_device():  # starts JAX's backend, which preallocates the accelerator
        if args.kernels and jax.default_backend() != "gpu":
            p.error(f"--kernels times the compiled kernels, which need a GPU (this host: "
                    f"{jax.default_backend()})")
        if not args.no_models:
            common.refuse_models_too_large(p, models)

    if not hf_modes:
        check_device()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "bench_thresholds.log", "a")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    hf = None
    if hf_modes:  # before JAX touches the accelerator
        hf = run_hf(args.hf_python, models, contexts, [1], hf_modes, args.warmup, args.steps,
                    args.out, log)
        check_device()
    parity = require_parity(args.parity, args.out, log)
    meta = dict(command="python -m dejavu_jax.eval.bench_thresholds " + " ".join(
        sys.argv[1:] if argv is None else argv), **run_meta(), kernel_parity=parity)
    detail = {}
    meta["best_gbs"] = measure_best_bandwidth(4.0 if jax.default_backend() == "gpu" else 0.01,
                                              detail)
    meta["best_detail"], meta["spec_gbs"] = detail, spec_bandwidth(meta["device"])
    result = dict(meta=meta, rows=[], kernels=[])

    def save():
        (args.out / "bench_thresholds.json").write_text(json.dumps(result, indent=1))

    if args.kernels:
        result["kernels"] = time_kernels(log, args.kernels)
        save()
    rows = [dict(r, mode=r["mode"], levels="-", skipped=0.0) for r in (hf or {}).get("rows", [])]
    for name in [] if args.no_models else models:
        rows += run_model(name, specs, contexts, args.warmup, args.steps, log, variants,
                          args.layouts)
        result["rows"] = with_speedups(rows)
        save()
    log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
