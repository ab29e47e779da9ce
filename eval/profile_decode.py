"""Profile one decode step on the accelerator: where the time of a token goes.

  python -m dejavu_jax.eval.profile_decode --model opt-13b --modes dense,sparse-fixed \
      --out runs/profile

For every mode it reports
- ms/token with the host synchronising after every step (what `bench_decode` measures),
- ms/token with N steps chained inside one jitted `lax.fori_loop` (no host round trip
  between tokens), whose difference from the first is host launch and sync overhead,
- a device trace of a few steps (`jax.profiler`), summarised per kernel name: launches per
  token, device µs per token, and the fraction of the step's wall time the device is busy;
  for sparse modes also one middle layer's launches in order (`layer_sequence`).

Random bf16 weights of a preset's shapes, unrolled layers with per-layer cache buffers
unless `--layout stacked`. Modes: dense, DejaVu's sparse step (`sparse-fixed`,
`sparse-predictor[-METHOD]`) and activation sparsity (`threshold:SPEC`, SPEC as in
`eval.bench_thresholds`: `uniform:0.5`, a profile file).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax import config as config_lib
from dejavu_jax import model, sparse
from dejavu_jax.eval.bench_decode import time_loop
from dejavu_jax.params import fuse_qkv, init_params, unstack_layers

BF16 = jnp.bfloat16


def trace_kernels(trace_dir: str) -> dict:
    """Per-kernel device time from the newest perfetto trace under `trace_dir`.

    Returns {"kernels": {name: [count, total_us]}, "span_us": first start to last end,
    "busy_us": summed kernel time, "processes": device process names seen, "host": {name:
    [count, total_us]} of the host's traced spans (the runtime's own: dispatch, thunks,
    command buffer launches and updates; nested spans each count)}.
    """
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n or "TPU" in n}
    kernels = collections.defaultdict(lambda: [0, 0.0])
    host = collections.defaultdict(lambda: [0, 0.0])
    starts, ends, ordered = [], [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("pid") not in device_pids:
            h = host[e.get("name", "?")]
            h[0] += 1
            h[1] += float(e.get("dur", 0.0))
            continue
        k = kernels[e.get("name", "?")]
        k[0] += 1
        k[1] += float(e.get("dur", 0.0))
        starts.append(float(e["ts"]))
        ends.append(float(e["ts"]) + float(e.get("dur", 0.0)))
        ordered.append((float(e["ts"]), e.get("name", "?"), float(e.get("dur", 0.0))))
    return {"kernels": dict(kernels), "span_us": (max(ends) - min(starts)) if starts else 0.0,
            "busy_us": sum(v[1] for v in kernels.values()),
            "processes": sorted(names[p] for p in device_pids),
            "ordered": [(n, d) for _, n, d in sorted(ordered)], "host": dict(host)}


def layer_sequence(ordered: list, anchor: str) -> list:
    """The kernels of one typical layer, as (name, µs): the launches from an occurrence of
    the kernel named `anchor` (exactly) up to the next one. Of the spans between
    consecutive occurrences, the middle one of those with the most common launch count
    (spans across a step boundary, with the dense layers and the logits, are longer)."""
    hits = [i for i, (name, _) in enumerate(ordered) if name == anchor]
    if len(hits) < 2:
        return []
    spans = [b - a for a, b in zip(hits, hits[1:])]
    common = collections.Counter(spans).most_common(1)[0][0]
    typical = [j for j, n in enumerate(spans) if n == common]
    j = typical[len(typical) // 2]
    return [(name[:80], round(us, 2)) for name, us in ordered[hits[j]: hits[j + 1]]]


def once_per_layer(per_token, n_layers: int, preferred: str) -> str:
    """`preferred` if it runs in the step, else the first kernel (by device time) launched
    once per layer: the anchor of `layer_sequence`."""
    names = [name for name, _, _ in per_token]
    if preferred in names:
        return preferred
    return next((name for name, c, _ in per_token if round(c) == n_layers), preferred)


def category(name: str) -> str:
    """A coarse kernel class from its name (for the per-token breakdown)."""
    n = name.lower()
    for key, label in (("gemv", "gemv"), ("gemm", "gemm"), ("cublas", "gemm"),
                       ("sm90", "gemm"), ("cutlass", "gemm"), ("triton", "triton/fusion"),
                       ("gather_matvec", "pallas"), ("gather_cols", "pallas"),
                       ("predictor", "pallas"), ("layer_norm", "pallas"),
                       ("top_k_local", "pallas"), ("sparse", "pallas"), ("sort", "sort/topk"), ("topk", "sort/topk"),
                       ("cub", "sort/topk"), ("memcpy", "memcpy"), ("memset", "memset"),
                       ("fusion", "fusion"), ("scatter", "scatter"), ("gather", "gather")):
        if key in n:
            return label
    return "other"


def time_steps(step, params, state, tokens, steps: int):
    """(median seconds per step with a host sync after each, state)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        _, state = step(params, state, tokens)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), state


def mode_engine(config, mode: str, mlp: float, heads: float, dense_layers: int, rank: int,
                per_layer: bool = False, batch: int = 1, batch_policy: str = "dense"):
    """(engine, selector params) for a mode, None for dense (per_layer: the unrolled
    layout's per-layer index sets; batch > 1: fixed sets' heads per row, and the sparse
    engine's `SparseConfig.batch_policy`)."""
    import dataclasses
    from dejavu_jax.eval.bench_decode import random_predictors, random_sets, select_method
    from dejavu_jax.sparse_variants import without_kv_recompute
    from dejavu_jax.train.predictor_model import decode_predictors
    if mode == "dense":
        return None
    scfg = dataclasses.replace(sparse.sparse_config(config, mlp, heads,
                                                    dense_layers=dense_layers),
                               batch_policy=batch_policy)
    if mode.endswith("no-kv-recompute"):
        scfg = without_kv_recompute(scfg)
    if mode.startswith("sparse-fixed"):
        return (sparse.sparse_engine(config, scfg, sparse.fixed_selector),
                random_sets(config, scfg, per_layer=per_layer,
                            row_heads=batch if batch > 1 else None))
    if mode.startswith("sparse-predictor"):
        method = mode.removeprefix("sparse-predictor").lstrip("-") or "exact"
        sel = select_method(config, method)
        return sparse.sparse_engine(config, scfg, sel), decode_predictors(
            random_predictors(config, rank, jax.random.key(1)))
    raise ValueError(f"unknown mode {mode!r}")


def threshold_run(config, params, spec: str, unrolled: bool):
    """(engine, its params) of threshold decoding at a level spec (`eval.bench_thresholds`:
    ``uniform:S[:METHOD]`` or a profile file), thresholds calibrated on the stacked
    `params`' own activations, weights moved input-major."""
    from dejavu_jax.eval.bench_thresholds import spec_levels, thresholds_for
    from dejavu_jax.params import input_major
    levels, sites = spec_levels(config, spec)
    thresholds = thresholds_for(config, params, levels)
    moved = input_major(params, up_rows="gate" in sites)
    engine = sparse.sparse_engine(config, sparse.threshold_config(config, sites),
                                  sparse.no_selector)
    return engine, (unstack_layers(moved) if unrolled else moved, thresholds)


def modes_list(text: str) -> list[str]:
    """An argparse type: a comma list of the modes `mode_engine` knows and
    ``threshold:SPEC`` (`threshold_run`)."""
    from dejavu_jax.sparse_variants import is_selector_name
    modes = [m for m in text.split(",") if m]
    for m in modes:
        if m.startswith("threshold:"):
            spec = m.removeprefix("threshold:")
            if not (spec.startswith("uniform:") or Path(spec).is_file()):
                raise argparse.ArgumentTypeError(f"{m}: {spec} is neither uniform:S[:METHOD] "
                                                 "nor a profile file")
            continue
        method = m.removeprefix("sparse-predictor").lstrip("-") or "exact"
        known = (m in ("dense", "sparse-fixed", "sparse-fixed-no-kv-recompute")
                 or (m.startswith("sparse-predictor") and is_selector_name(method)))
        if not known:
            raise argparse.ArgumentTypeError(f"unknown mode {m!r}")
    if not modes:
        raise argparse.ArgumentTypeError("no modes given")
    return modes


def profile_mode(config, params, mode, args, out: Path, log, prepared=None) -> dict:
    """Timings and kernel summary of one mode (prepared: its (engine, params), for the
    threshold modes)."""
    B, ctx = args.batch, args.context
    max_len = ctx + 4 * args.steps + 64
    unrolled = args.layout == "unrolled"
    prompt = jax.random.randint(jax.random.key(2), (B, ctx), 3, config.vocab_size)
    mask = jnp.ones_like(prompt)
    tokens = jnp.full((B,), 42, jnp.int32)
    eng = prepared or mode_engine(config, mode, args.mlp, args.heads, args.dense_layers,
                                  args.rank, per_layer=unrolled, batch=B,
                                  batch_policy=args.batch_policy)
    if eng is None:
        step_fn = lambda p, s, t: model.decode_step_fn(config, p, s, t)  # noqa: E731
        run_params = params if args.dense_qkv == "separate" else fuse_qkv(params)

        def fresh():
            st = model.init_state(config, B, max_len, BF16, per_layer=unrolled)
            # the jitted prefill itself: an OPT context past the learned positions times
            # the shapes (`model.prefill` would refuse it)
            return jax.jit(model.prefill_fn, static_argnums=0, donate_argnums=4)(
                config, params, prompt, mask, st)[1]
    else:
        eng, extra = eng
        step_fn, run_params = eng.step, extra if prepared else (params, extra)

        def fresh():
            st = eng.init_state(B, max_len, BF16, per_layer=unrolled)
            return jax.jit(eng.prefill, donate_argnums=3)(run_params, prompt, mask, st)[1]

    step = jax.jit(step_fn, donate_argnums=1)
    state = fresh()
    t = time.perf_counter()
    _, state = step(run_params, state, tokens)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t
    safe_mode = mode.replace("/", "_").replace(":", "_")
    if args.hlo:  # the optimised HLO names the fusions the trace lists
        with gzip.open(out / f"hlo_{safe_mode}.txt.gz", "wt") as f:
            f.write(step.lower(run_params, state, tokens).compile().as_text())
    _, state = time_steps(step, run_params, state, tokens, 3)
    synced, state = time_steps(step, run_params, state, tokens, args.steps)
    trace_dir = out / f"trace_{safe_mode}"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        _, state = time_steps(step, run_params, state, tokens, args.trace_steps)
    del state
    looped, _, state = time_loop(step_fn, run_params, fresh(), tokens, args.steps)
    del state
    summary = trace_kernels(str(trace_dir))
    n = args.trace_steps
    per_token = sorted(((name, c / n, us / n) for name, (c, us) in summary["kernels"].items()),
                       key=lambda r: -r[2])
    cats = collections.defaultdict(lambda: [0.0, 0.0])
    for name, c, us in per_token:
        cats[category(name)][0] += c
        cats[category(name)][1] += us
    row = dict(mode=mode, model=args.model, layout=args.layout, context=ctx, batch=B,
               mlp=args.mlp, heads=args.heads, compile_s=compile_s,
               ms_synced=synced * 1e3, ms_device_loop=looped * 1e3,
               launches_per_token=sum(c for _, c, _ in per_token),
               device_busy_ms_per_token=summary["busy_us"] / n / 1e3,
               categories={k: dict(launches=v[0], us=v[1]) for k, v in cats.items()},
               top_kernels=[dict(name=nm[:120], launches=c, us=us) for nm, c, us in per_token[:60]],
               device_idle_ms_per_token=(summary["span_us"] - summary["busy_us"]) / n / 1e3,
               host_spans=[dict(name=nm[:120], count=c / n, us=us / n) for nm, (c, us) in
                           sorted(summary["host"].items(), key=lambda kv: -kv[1][1])[:40]],
               processes=summary["processes"],
               # sparse layers only: their attention launch happens once per layer
               layer_sequence=(layer_sequence(summary["ordered"], once_per_layer(
                                   per_token, config.n_layers, "head_sparse_decode_attention"))
                               if mode != "dense" else []))
    log(json.dumps(row))
    return row


def main(argv=None) -> int:
    """Profile the requested modes; writes profile.json into --out."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.profile_decode")
    p.add_argument("--model", default="opt-13b", choices=config_lib.PRESETS, metavar="NAME",
                   help=f"a shape preset, random weights: {', '.join(config_lib.PRESETS)}")
    p.add_argument("--dense-qkv", default="fused", choices=("fused", "separate"),
                   help="the dense mode's q/k/v weights: one GEMV (params.fuse_qkv) or three")
    p.add_argument("--modes", type=modes_list,
                   default="dense,sparse-fixed,sparse-fixed-no-kv-recompute,"
                           "sparse-predictor-exact,sparse-predictor-radix",
                   help="dense, sparse-fixed[-no-kv-recompute], sparse-predictor[-METHOD] "
                        "(METHOD: exact or local, or a benchmark variant of "
                        "dejavu_jax.sparse_variants: threshold, radix, chunked, packed; "
                        "local-apart: local, its launches not riding in the MLP's)")
    p.add_argument("--layout", default="unrolled", choices=("unrolled", "stacked"),
                   help="weights as per-layer buffers or stacked under lax.scan")
    p.add_argument("--context", type=cli.positive_int, default=128,
                   help="tokens in the cache at the traced steps")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="rows decoded together")
    p.add_argument("--batch-policy", default="union", choices=sparse.BATCH_POLICIES,
                   help="the sparse modes' SparseConfig.batch_policy at batch > 1")
    p.add_argument("--mlp", type=cli.fraction, default=0.1,
                   help="MLP density of the sparse modes (fraction of neurons read)")
    p.add_argument("--heads", type=cli.fraction, default=0.5,
                   help="query-head density of the sparse modes")
    p.add_argument("--dense-layers", type=cli.non_negative_int, default=2,
                   help="leading layers kept dense in the sparse modes")
    p.add_argument("--rank", type=cli.positive_int, default=256,
                   help="predictor hidden width r")
    p.add_argument("--steps", type=cli.positive_int, default=20,
                   help="steps timed before the trace")
    p.add_argument("--trace-steps", type=cli.positive_int, default=3,
                   help="steps traced per mode (device time per kernel summed over them)")
    p.add_argument("--hlo", action="store_true",
                   help="also write each mode's optimised HLO (hlo_MODE.txt.gz)")
    p.add_argument("--out", type=cli.output_dir, default="runs/profile",
                   help="folder for profile.json and the traces (default runs/profile)")
    from dejavu_jax.eval.parity_gate import add_parity_argument, require_parity
    add_parity_argument(p)
    args = p.parse_args(argv)
    config = config_lib.preset(args.model)
    if args.dense_layers > config.n_layers:
        p.error(f"--dense-layers {args.dense_layers}: {args.model} has {config.n_layers} layers")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if jax.default_backend() != "gpu":
        print(f"note: no GPU ({jax.default_backend()}): the trace holds no device kernels, so "
              "the per-kernel sums and launch counts are empty", file=sys.stderr)
    parity = require_parity(args.parity, out)
    params = init_params(config, jax.random.key(0), BF16)
    unrolled = args.layout == "unrolled"
    prepared = {m: threshold_run(config, params, m.removeprefix("threshold:"), unrolled)
                for m in args.modes if m.startswith("threshold:")}
    if unrolled:
        params = unstack_layers(params, free_stacked=not prepared)
    rows = []

    def log(msg):
        print(msg, flush=True)

    for mode in args.modes:
        try:
            rows.append(profile_mode(config, params, mode, args, out, log,
                                     prepared.get(mode)))
        except Exception as e:  # report and go on with the other modes
            log(f"FAILED {mode}: {type(e).__name__}: {str(e)[:600]}")
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""), kernel_parity=parity)
    (out / "profile.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
