"""Where a host-synchronised decode step loses time against steps chained on the device.

    python -m dejavu_jax.eval.dispatch_overhead --models qwen2.5-7b,opt-6.7b --out DIR

The dense engine on random bf16 weights, context 128, batch 1. Rows, ms per token:
  chained          `steps` steps in one jitted fori_loop (bench_decode's `ms_loop`)
  compiled_synced  the ahead-of-time compiled step, the host waiting for each (its `ms`)
  jit_synced       the same step through jax.jit's dispatch
  jit_queued       jax.jit, the host enqueuing every step before waiting once
  args_only        a jitted function of the same params and state that only returns the
                   state (donated) and the token plus one: the cost of handing the
                   arguments over and syncing, no model; args_weights_only, the params
                   and token alone (no state); args_stacked_cache (per-layer layouts),
                   with the K/V cache as one stacked pair of buffers instead of per layer
  sync_floor       a jitted function of the token alone, synced: one dispatch and one wait
  host_chosen      the chained loop with every token chosen on the host by a callback from
                   the loop (`host_choice`: the logits' argmax)
  callback_floor   per iteration of a jitted loop that only makes a host callback of a
                   token; callback_logits, the same with one row of logits (V float32)
Each with the per-layer buffers `generate` decodes with (`params.decode_layout`) and, with
`--stacked`, the stacked layers too: under `lax.scan` (`stacked`), and unrolled, each
layer taking static slices of the stacked arrays (`stacked-unrolled`: as few arrays to
hand over as stacked, as static a program as per-layer); with `--packed`, per layer with
the small arrays (norms, biases) packed into one stacked array per field
(`packed_params`: the large weights per layer, a few buffers in all for the rest); with
`--stacked-cache`, per-layer weights and the K/V cache as one stacked pair of buffers
(`per-layer-stacked-cache`: every row, the real step included, with 2 cache buffers
handed over instead of 2 per layer). The run opens with `eval.kernel_parity` on the GPU.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax.host_choice import host_argmax

BF16 = jnp.bfloat16


def _per_step(call, steps: int, warmup: int, synced: bool) -> float:
    """Median (synced) or mean (queued) seconds per `call()`, which returns what to wait
    for."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    if not synced:
        t = time.perf_counter()
        for _ in range(steps):
            out = call()
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / steps
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


@contextlib.contextmanager
def unrolled_layers():
    """The dense model's layer loop unrolled over static slices of stacked weights."""
    from dejavu_jax import model
    original = model.scan_layers

    def unrolled(body, carry, layers, with_index=False):
        if isinstance(layers, tuple):
            return original(body, carry, layers, with_index)
        n = jax.tree.leaves(layers)[0].shape[0]
        per_layer = tuple(jax.tree.map(lambda w: w[i], layers) for i in range(n))
        return original(body, carry, per_layer, with_index)

    model.scan_layers = unrolled
    try:
        yield
    finally:
        model.scan_layers = original


def callback_seconds(logits, steps: int) -> float:
    """Seconds per iteration of a jitted loop of `steps` host callbacks that choose a token
    from `logits` (each iteration's input depends on the last one's choice)."""
    from dejavu_jax.host_choice import host_argmax, host_chosen

    def loop(x):
        def body(_, carry):
            return carry + host_chosen(host_argmax, carry)[:, None].astype(carry.dtype)
        return jax.lax.fori_loop(0, steps, body, x)
    run = jax.jit(loop)
    jax.block_until_ready(run(logits))
    t = time.perf_counter()
    jax.block_until_ready(run(logits))
    return (time.perf_counter() - t) / steps


def measure(config, params, per_layer: bool, steps: int, warmup: int, unpack=None) -> dict:
    """The rows of the module doc for one params layout: {name: ms}. unpack: maps the
    handed-over params to the engine's, inside the jitted functions (`unpack_small`)."""
    from dejavu_jax.eval.bench_decode import time_loop
    from dejavu_jax.eval.bench_hf import cache_len
    from dejavu_jax.generation import dense_engine
    engine = dense_engine(config)
    unpack = unpack or (lambda p: p)

    def step(p, s, t):
        return engine.step(unpack(p), s, t)

    def prefill(p, ids, mask, s):
        return engine.prefill(unpack(p), ids, mask, s)
    ctx = 128
    prompt = jax.random.randint(jax.random.key(2), (1, ctx), 3, config.vocab_size)
    tokens = jnp.full((1,), 42, jnp.int32)
    state = engine.init_state(1, cache_len(ctx, warmup, 3 * (steps + warmup)), BF16,
                              per_layer=per_layer)
    _, state = jax.jit(prefill, donate_argnums=3)(params, prompt, jnp.ones_like(prompt), state)
    holder = {"state": state}

    def threaded(fn, held=holder):  # one step of fn, the state threaded through (donated)
        def call():
            out, held["state"] = fn(params, held["state"], tokens)
            return out, held["state"]
        return call

    rows = {}
    compiled = jax.jit(step, donate_argnums=1).lower(params, state, tokens).compile()
    jitted = jax.jit(step, donate_argnums=1)
    rows["compiled_synced"] = _per_step(threaded(compiled), steps, warmup, True)
    rows["jit_synced"] = _per_step(threaded(jitted), steps, warmup, True)
    rows["jit_queued"] = _per_step(threaded(jitted), steps, warmup, False)
    args_only = jax.jit(lambda p, s, t: (t + 1, s), donate_argnums=1)
    rows["args_only"] = _per_step(threaded(args_only), steps, warmup, True)
    weights_only = jax.jit(lambda p, t: t + 1)
    rows["args_weights_only"] = _per_step(lambda: weights_only(params, tokens), steps, warmup,
                                          True)
    if per_layer:  # the same cache bytes as one stacked buffer pair
        other = {"state": engine.init_state(1, state.valid.shape[1], BF16, per_layer=False)}
        rows["args_stacked_cache"] = _per_step(threaded(args_only, other), steps, warmup,
                                               True)
        del other
    floor = jax.jit(lambda t: t + 1)
    rows["sync_floor"] = _per_step(lambda: floor(tokens), steps, warmup, True)
    per, _, holder["state"] = time_loop(step, params, holder["state"], tokens, steps)
    rows["chained"] = per
    per, _, holder["state"] = time_loop(step, params, holder["state"], tokens, steps,
                                        host_argmax)
    rows["host_chosen"] = per
    rows["callback_floor"] = callback_seconds(jnp.zeros((1, 1), jnp.float32), steps)
    rows["callback_logits"] = callback_seconds(jnp.zeros((1, config.vocab_size), jnp.float32),
                                               steps)
    return {k: round(v * 1e3, 4) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the diagnostic; writes dispatch_overhead.json into --out."""
    from dejavu_jax import config as config_lib
    from dejavu_jax.eval.parity_gate import add_parity_argument, require_parity
    from dejavu_jax.eval.provenance import run_meta
    from dejavu_jax.packed_params import pack_small, unpack_small
    from dejavu_jax.params import fuse_qkv, init_params, unstack_layers
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.dispatch_overhead",
                           description=__doc__.split("\n")[0])
    p.add_argument("--models", type=cli.presets, default="qwen2.5-7b")
    p.add_argument("--steps", type=cli.positive_int, default=30)
    p.add_argument("--warmup", type=cli.non_negative_int, default=3)
    p.add_argument("--stacked", action="store_true", help="also the stacked layers")
    p.add_argument("--packed", action="store_true",
                   help="also the per-layer layout with its small arrays packed")
    p.add_argument("--stacked-cache", action="store_true",
                   help="also per-layer weights with the K/V cache stacked")
    p.add_argument("--out", type=Path, required=True)
    add_parity_argument(p)
    args = p.parse_args(argv)
    models = args.models
    args.out.mkdir(parents=True, exist_ok=True)
    parity = require_parity(args.parity, args.out)
    result = {"meta": dict(command="python -m dejavu_jax.eval.dispatch_overhead " + " ".join(
        sys.argv[1:] if argv is None else argv), **run_meta(), kernel_parity=parity),
        "rows": []}
    for name in models:
        config = config_lib.preset(name)
        stacked = fuse_qkv(init_params(config, jax.random.key(0), BF16))
        per_layer_params = unstack_layers(stacked)
        layouts = [("per-layer", per_layer_params, True, None)]
        if args.packed:
            layouts.append(("per-layer-packed", pack_small(per_layer_params), True,
                            unpack_small))
        if args.stacked_cache:
            layouts.append(("per-layer-stacked-cache", per_layer_params, False, None))
        if args.stacked:
            layouts += [("stacked", stacked, False, None),
                        ("stacked-unrolled", stacked, False, None)]
        for layout, params, per_layer, unpack in layouts:
            with unrolled_layers() if layout == "stacked-unrolled" else contextlib.nullcontext():
                timed = measure(config, params, per_layer, args.steps, args.warmup, unpack)
            row = dict(model=name, layout=layout, leaves=len(jax.tree.leaves(params)), **timed)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (args.out / "dispatch_overhead.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
