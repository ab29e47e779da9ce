"""Compiled kernels against the jnp references, on whatever device runs this.

  python -m dejavu_jax.eval.kernel_parity --out results/      # on the GPU: impl pallas

1. Sparse decode, teacher-forced for --steps tokens on tiny OPT (ReLU, and the exact GELU
   of some OPT checkpoints), Llama and Gemma 3 models (fp32 weights; `DECODE_CASES`),
   unrolled layers (the GPU layout: per-layer caches and input rings) and stacked, at MLP
   0.3 / heads 0.5 with index sets that change every layer (and OPT at density 1.0),
   missing-KV window 4: the largest |logit| and |K cache| difference between `--impl`
   kernels and the jnp references.
2. Top-k selection: the radix, chunked and local kernels return exactly their references'
   sets on random scores of MLP sizes.
3. Head-sparse attention with a missing-KV window whose needed entries are random (so
   selected heads attend to rewritten entries and refresh heads only write), MHA and GQA
   with rotary tables, rows rotated as in a ring: output and caches. In the batch case
   one head misses no earlier entry (its programs take the current-rows-only path). The
   GQA case with a [Kh, G] `head_mask` selects query heads: one selected group keeps some
   of its query heads, another none (skipped, though a refresh group: it still writes its
   entries). The last two cases give each batch row its own heads ([B, Kh, G] masks,
   MHA and GQA, longer caches with several sequence splits), and with them the attention
   core of dense projections (`row_head_attention`); check 1's "rows" layout decodes
   with per-row head sets (whose union is every head: that core).
4. The fused LayerNorm / RMSNorm (`kernels.layer_norm`, which every decode path uses on
   GPU, the reference runs of check 1 included), with and without its RMS-scaled second
   output, against its reference at model widths.
5. The split predictor's selection (`kernels.predictor_select`) and a batch's selection
   (`kernels.batch_predictor_select`: the union of 4 and 16 rows' neurons, each row's
   heads) return their references' sets at OPT-13B / 30B predictor sizes.
6. ("split") Batch-1 sparse decode on tiny OPT with the split predictor (local top-k),
   its selection riding in the MLP launches (unrolled layers) and in launches of its own
   (stacked): every set it chose is a top-k of the reference scores of its layer's input
   (up to bfloat16 key ties), and the reference step replaying those sets gives its
   logits and K cache.
   ("batch-select") A 3-row decode on tiny OPT with the union policy and the local
   method, its selection riding in the step's launches (the first product in the MLP
   norm's or the q/k/v projection's, the rest in the MLP's; the heads' program in fc2's
   launch, and in fc1's as the benchmark variant `-heads-in-fc1` runs it): the reference
   step replaying the sets it chose gives its logits and K cache.

7. ("threshold") Activation-sparse decode (`kernels.threshold_matvec` on input-major
   weights, thresholds dropping about 40% of every site) on tiny Llama (the up projection
   by the gate's neuron rows), OPT, Gemma 3 (post-norms) and, two rows, Gemma 2 (capped
   attention logits), per-layer buffers, and tiny Llama, OPT and Qwen2 (q/k/v biases,
   grouped queries) over stacked weights (each layer's rows read in place under
   `lax.scan`), each with the default `ThresholdConfig` and with every switch on (the
   attention in the decode-attention kernel, a gated MLP's units in
   `kernels.gated_hidden`, the gate site's up rows and units in `kernels.gated_rows`, one
   sum of a program's rows): logits and K cache against the jnp computation on the usual
   weights; and the kernels alone (the input-sparse and row-masked GEMVs, the unit
   finishes over a stacked layer's bias, gate weights, up rows and thresholds), one row
   and three, against their references.
8. ("switches") The load switches of the input-sparse GEMV (column blocks first, the
   evict-first hint, the residual from partials, one sum of a program's rows), of the
   sparse MLP pair and of head-sparse attention (the evict-first hint) against their
   references.

Writes kernel_parity.json and exits 1 when a difference exceeds --tol or a set differs
(beyond key ties, for the split predictor). On a GPU host the checks' parts run in up to 8
processes at once (`--jobs`): their time is compiles, which run on the host's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import time
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax import config as config_lib
from dejavu_jax import sparse
from dejavu_jax.eval.bench_decode import random_sets
from dejavu_jax.kernels import ThresholdConfig
from dejavu_jax.params import init_params, unstack_layers
from dejavu_jax.sparse_variants import APART, HEADS_IN_FC1, variant_selector


@functools.cache
def _prefill(config):
    """The jitted dense prefill every sparse engine of `config` runs, taking the model
    params alone: one compile per cache layout for all the checks' configurations."""
    def prefill(model_params, ids, mask, state):
        return sparse.sparse_prefill_fn(config, (model_params, None), ids, mask, state)
    return jax.jit(prefill)


@functools.cache
def _compiled(config, scfg, select, per_layer: bool, batch: int):
    """(engine, jitted step), built once per configuration: the checks decode the same
    configurations several times, and compiles are most of their time."""
    eng = sparse.sparse_engine(config, scfg, select)
    return eng, jax.jit(eng.step)


def _decode(config, scfg, params, sets, steps: int, per_layer: bool,
            select=sparse.fixed_selector, batch: int = 2, per_step_params: bool = False,
            log: list | None = None, ordered: bool = True):
    """(logits [steps, B, V], K cache) of a teacher-forced decode; `sets` are the selector
    params, or one per step with per_step_params. With `log`, each layer's input and sets
    are appended to it (`_recording_layer_sets`; compiled afresh)."""
    if log is None:
        eng, step = _compiled(config, scfg, select, per_layer, batch)
        return _run_decode(config, eng, step, params, sets, steps, per_layer, batch,
                           per_step_params)
    with _recording_layer_sets(log, ordered):  # traced, and so recording, in here
        eng = sparse.sparse_engine(config, scfg, select)
        return _run_decode(config, eng, jax.jit(eng.step), params, sets, steps, per_layer,
                           batch, per_step_params)


def _run_decode(config, eng, step, params, sets, steps, per_layer, batch, per_step_params):
    """The decode loop of `_decode`."""
    ids = jnp.asarray([[5, 9, 14, 3, 7], [8, 2, 4, 11, 6], [1, 30, 6, 8, 12]])[:batch]
    state = eng.init_state(batch, 64, jnp.float32, per_layer=per_layer)
    logits, state = _prefill(config)(params, ids, jnp.ones_like(ids), state)
    tokens = np.random.default_rng(1).integers(3, config.vocab_size, (steps, batch))
    out = []
    for t in range(steps):
        logits, state = step((params, sets[t] if per_step_params else sets), state,
                             jnp.asarray(tokens[t], jnp.int32))
        out.append(np.asarray(logits))
    k = state.dense.k
    k = np.stack(k, axis=1) if isinstance(k, tuple) else np.asarray(k)
    return np.stack(out), k


def decode_rows(impl: str, steps: int, cases=None) -> list[dict]:
    """Largest logit / K-cache differences, `impl` kernels against the references, for
    `cases` (default all of `DECODE_CASES`).

    XLA's own products (dense layers, LM head) run at full fp32 precision here: on the GPU
    they default to TF32, whose 10-bit rounding turns the kernels' 1e-6 differences into
    either nothing or ~1e-4 on a logit."""
    with jax.default_matmul_precision("highest"):
        return _decode_rows(impl, steps, DECODE_CASES if cases is None else cases)


def gemma3_tiny():
    """A tiny Gemma 3 config (q/k norms, pre- and post-norms, a sliding window of 4 on
    layers 0, 1 and 3, two KV groups) of the real model's other settings."""
    return dataclasses.replace(
        config_lib.preset("gemma3-270m"), name="gemma3-tiny", vocab_size=512, hidden=64,
        embed_dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
        sliding_window=4, sliding_layers=(True, True, False, True), embed_scale=8.0,
        query_scale=0.25)


def tiny_config(name: str):
    """The config a parity case names: a preset, or one of the tiny variants
    `gemma3-tiny`, `gemma2-tiny` (no q/k norms, attention logits soft-capped at 0.5, small
    enough to bend them), `opt-tiny-gelu` (the exact gelu's erf) and `qwen2-tiny` (tiny
    Llama with q/k/v biases)."""
    if name == "gemma3-tiny":
        return gemma3_tiny()
    if name == "gemma2-tiny":
        return gemma3_tiny().replace(name=name, qk_norm=False, attn_logit_softcap=0.5,
                                     sliding_layers=(True, False, True, False))
    if name == "opt-tiny-gelu":
        return config_lib.preset("opt-tiny").replace(activation="gelu", name=name)
    if name == "qwen2-tiny":
        return config_lib.preset("llama-tiny").replace(attention_bias=True, name=name)
    return config_lib.preset(name)


# (config, (MLP density, head density) pairs, layouts); density 1 runs the dense branches;
# layout "rows": stacked, each batch row with its own heads
DECODE_CASES = (("opt-tiny", ((1.0, 1.0), (0.3, 0.5)), ("unrolled", "stacked", "rows")),
                ("llama-tiny", ((0.3, 0.5),), ("unrolled", "stacked", "rows")),
                ("gemma3-tiny", ((0.3, 0.5),), ("unrolled",)),
                ("gemma2-tiny", ((0.3, 0.5),), ("unrolled", "rows")),
                ("opt-tiny-gelu", ((0.3, 0.5),), ("unrolled",)))


def _decode_rows(impl: str, steps: int, cases) -> list[dict]:
    rows = []
    for preset, densities, layouts in cases:
        config = tiny_config(preset)
        params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
        for mlp, heads in densities:
            # batch_policy "kernels": batch 2 would otherwise run XLA's dense layers
            scfg = dataclasses.replace(sparse.sparse_config(
                config, mlp, heads, dense_layers=1, kv_window=4), batch_policy="kernels")
            sets = random_sets(config, scfg, seed=3)
            # one reference (stacked layers) for both layouts: the same function
            ref = _decode(config, dataclasses.replace(scfg, impl="reference"), params, sets,
                          steps, False)
            for layout in layouts:
                if layout == "rows" and heads == 1.0:
                    continue
                p = unstack_layers(params) if layout == "unrolled" else params
                layout_sets, want = sets, ref
                if layout == "rows":
                    layout_sets = random_sets(config, scfg, seed=3, row_heads=2)
                    want = _decode(config, dataclasses.replace(scfg, impl="reference"),
                                   params, layout_sets, steps, False)
                got = _decode(config, dataclasses.replace(scfg, impl=impl), p, layout_sets,
                              steps, layout == "unrolled")
                rows.append(dict(check="decode", preset=preset, mlp=mlp, heads=heads,
                                 layout=layout, steps=steps,
                                 logits=float(np.abs(got[0] - want[0]).max()),
                                 k_cache=float(np.abs(got[1] - want[1]).max())))
    return rows


def _selection_slack(scores: np.ndarray, ids: np.ndarray, chunks: int) -> float:
    """How far `ids` is from a top-k of `scores` [n], per chunk (the local method's chunks;
    1 for an exact top-k): the largest unselected score minus the smallest selected one,
    over the chunks, relative to the largest |score|. <= 0: an exact top-k. Selections
    compare bfloat16-precision keys (ties to the lower id), so a valid one may exceed 0
    by about 2**-7 (one key step, plus fp32 rounding between implementations)."""
    n = scores.shape[0]
    c = -(-n // chunks)
    chosen = np.zeros(n, bool)
    chosen[ids] = True
    slack = -np.inf
    for lo in range(0, n, c):
        s, m = scores[lo:lo + c], chosen[lo:lo + c]
        if m.any() and (~m).any():
            slack = max(slack, float(s[~m].max() - s[m].min()))
    return slack / max(float(np.abs(scores).max()), 1e-30)


TIE_SLACK = 2.0 ** -6  # two bfloat16 key steps


@contextlib.contextmanager
def _recording_layer_sets(log: list, ordered: bool = True):
    """Record, for every layer the decode step traces while inside, (layer, its input
    row, neuron ids, KV-group ids); dense layers, and layers that select every unit (how
    dense layers run over stacked weights), record no ids. One host callback per
    layer and token (unordered ones may come in any order within a step)."""
    real_sparse, real_dense = sparse._fused_sparse_layer, sparse._dense_layer

    def record(layer, x, *sets):
        jax.debug.callback(lambda *a: log.append(tuple(np.asarray(v) for v in a)),
                           jnp.asarray(layer), x[0], *sets, ordered=ordered)

    def fused(config, scfg, view, io, layer, x, neurons, groups, *args, **kw):
        every_unit = neurons.shape[-1] == config.ffn and groups.shape[-1] == config.n_heads
        sets = (neurons, groups)
        if view.offset_ids:   # recorded as the layer's own ids
            sets = (neurons - layer * config.ffn, groups - layer * config.n_heads)
        record(layer, x, *(() if every_unit else sets))  # a dense layer in place
        return real_sparse(config, scfg, view, io, layer, x, neurons, groups, *args, **kw)

    def dense(config, view, io, layer, x, *args, **kw):
        record(layer, x)
        return real_dense(config, view, io, layer, x, *args, **kw)

    sparse._fused_sparse_layer, sparse._dense_layer = fused, dense
    try:
        yield
    finally:
        sparse._fused_sparse_layer, sparse._dense_layer = real_sparse, real_dense


def _replay_selector(sets, layer, x, k_mlp, k_heads):
    """A Selector replaying one token's recorded sets: ([L, Km], [L, Kh]) arrays."""
    return sets[0][layer], sets[1][layer]


def _per_step_sets(log: list, n_layers: int):
    """The recorded layers as, per step, (([L, Km], [L, Kh]) int32 sets, [L, d] inputs);
    dense layers' set rows are zeros."""
    out = []
    for t in range(len(log) // n_layers):
        rows = log[t * n_layers:(t + 1) * n_layers]
        km, kh = next(r[2].shape[-1] for r in rows if len(r) > 2), next(
            r[3].shape[-1] for r in rows if len(r) > 2)
        neurons = np.zeros((n_layers, km), np.int32)
        groups = np.zeros((n_layers, kh), np.int32)
        inputs = np.zeros((n_layers, rows[0][1].shape[-1]), np.float32)
        for row in rows:
            inputs[int(row[0])] = row[1]
            if len(row) > 2:
                neurons[int(row[0])], groups[int(row[0])] = row[2], row[3]
        out.append(((neurons, groups), inputs))
    return out


# the selection riding in the MLP launches over per-layer weights and over stacked ones
# (where it writes the ids offset into the flattened layers), and the stacked scan with
# launches of its own (a layout does not change which sets are chosen)
SPLIT_VARIANTS = ((True, "unrolled"), (True, "stacked"), (False, "stacked"))


def split_rows(impl: str, steps: int, variants=None) -> list[dict]:
    """The decode step with the split predictor (batch 1, local top-k; its selection riding
    in the MLP launches or in launches of its own) against the reference step, for each
    (ride_mlp_launches, layout) of `variants` (default `SPLIT_VARIANTS`).

    Sets chosen from scores that two implementations round differently can differ where
    two scores share or straddle a bfloat16 key (the predictors' hidden units are rounded
    to bfloat16 before their second product, so one fp32 rounding step there moves a score
    by a bfloat16 step). So the check has two parts: (1) each set the kernel path chose is
    a top-k of the reference scores of its layer input (fp32, highest precision) up to
    `TIE_SLACK`; (2) the reference step replaying the kernel path's sets gives its logits
    and K cache. Also reported, not checked: how many sets equal the reference path's
    (`sets_equal`) and the logits' difference from that path (`logits_vs_reference_path`),
    which is large once a set differs."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.kernels.top_k import local_top_k_shape
    from dejavu_jax.train.predict import predictor_scores
    from dejavu_jax.train.predictor_model import decode_predictors
    rows = []
    config = config_lib.preset("opt-tiny")
    params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
    raw = random_predictors(config, 16, jax.random.key(1))
    preds = decode_predictors(raw)
    scfg = sparse.sparse_config(config, 0.3, 0.5, dense_layers=1, kv_window=4)
    ref_scfg = dataclasses.replace(scfg, impl="reference")
    with jax.default_matmul_precision("highest"):
        ref_log: list = []
        ref = _decode(config, ref_scfg, params, preds, steps, False,
                      sparse.predictor_selector(1, method="local", impl="reference"),
                      batch=1, log=ref_log)
        ref_sets = _per_step_sets(ref_log, config.n_layers)
        for ride, layout in variants or SPLIT_VARIANTS:
            p = unstack_layers(params) if layout == "unrolled" else params
            select = variant_selector(1, "local" if ride else "local" + APART, impl=impl)
            log: list = []
            got = _decode(config, dataclasses.replace(scfg, impl=impl), p, preds, steps,
                          layout == "unrolled", select, batch=1, log=log)
            got_sets = _per_step_sets(log, config.n_layers)
            replay = _decode(config, ref_scfg, params, [s for s, _ in got_sets], steps,
                             False, _replay_selector, batch=1, per_step_params=True)
            slack, equal = -np.inf, 0
            for ((neurons, groups), inputs), ((ref_n, ref_g), _) in zip(got_sets, ref_sets):
                for layer in range(scfg.dense_layers, config.n_layers):
                    equal += int(np.array_equal(neurons[layer], ref_n[layer])
                                 and np.array_equal(groups[layer], ref_g[layer]))
                    # a layer's sets are predicted from the previous layer's input
                    mlp, heads = (np.asarray(a[0]) for a in predictor_scores(
                        raw, layer, jnp.asarray(inputs[layer - 1:layer])))
                    chunks = local_top_k_shape(config.ffn, scfg.mlp_k[layer], 2048)[0]
                    slack = max(slack, _selection_slack(mlp, neurons[layer], chunks),
                                _selection_slack(heads, groups[layer], 1))
            rows.append(dict(check="split", preset="opt-tiny", ride=ride, layout=layout,
                             steps=steps, logits=float(np.abs(got[0] - replay[0]).max()),
                             k_cache=float(np.abs(got[1] - replay[1]).max()),
                             selection_slack=slack,
                             sets_equal=f"{equal}/{steps * (config.n_layers - scfg.dense_layers)}",
                             logits_vs_reference_path=float(np.abs(got[0] - ref[0]).max())))
    return rows


def _batch_step_sets(log: list, n_layers: int):
    """The recorded layers of a batch's steps as, per step, ([L, Km] union neuron ids,
    [L, B, Kh] each row's heads) int32 sets; dense layers' rows are zeros."""
    out = []
    for t in range(len(log) // n_layers):
        rows = log[t * n_layers:(t + 1) * n_layers]
        first = next(r for r in rows if len(r) > 2)
        neurons = np.zeros((n_layers,) + first[2].shape, np.int32)
        heads = np.zeros((n_layers,) + first[3].shape, np.int32)
        for row in rows:
            if len(row) > 2:
                neurons[int(row[0])], heads[int(row[0])] = row[2], row[3]
        out.append((neurons, heads))
    return out


# rows' heads whose union is every head (the first product of the selection rides in the
# MLP norm's launch) and fewer (in the q/k/v projection's launch)
BATCH_SELECT_HEADS = (0.5, 0.25)
# the selection as the step runs it, and the benchmark variant with the heads in fc1's launch
BATCH_SELECT_METHODS = ("local", "local" + HEADS_IN_FC1)


def batch_select_rows(impl: str, steps: int) -> list[dict]:
    """("batch-select") A 3-row sparse decode on tiny OPT (unrolled layers) with decode-form
    predictors, the union policy and the local method, the selection riding in the
    step's other launches (`sparse.PredictorSelector.batch_riders`; `BATCH_SELECT_METHODS`:
    the heads' program in the fc2 launch, and in the fc1 launch): the reference step
    replaying the sets the kernel path chose gives its logits and K cache. The sets
    themselves are checked against their reference by check 5 ("predictor"); reported,
    not checked: how many equal the reference path's and the logits' difference from it.
    """
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    config = config_lib.preset("opt-tiny")
    params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
    preds = decode_predictors(random_predictors(config, 16, jax.random.key(1)))
    rows = []
    with jax.default_matmul_precision("highest"):
        for heads, name in itertools.product(BATCH_SELECT_HEADS, BATCH_SELECT_METHODS):
            scfg = dataclasses.replace(sparse.sparse_config(config, 0.1, heads, dense_layers=1,
                                                            kv_window=4), batch_policy="union")
            ref_scfg = dataclasses.replace(scfg, impl="reference")
            select = variant_selector(1, name, impl=impl)
            rides = select.rides_batch(preds, 3, scfg.mlp_k[-1], impl)
            log: list = []
            got = _decode(config, dataclasses.replace(scfg, impl=impl), unstack_layers(params),
                          preds, steps, True, select, batch=3, log=log, ordered=False)
            got_sets = _batch_step_sets(log, config.n_layers)
            replay = _decode(config, ref_scfg, params, got_sets, steps, False,
                             _replay_selector, batch=3, per_step_params=True)
            ref_log: list = []
            ref = _decode(config, ref_scfg, params, preds, steps, False,
                          variant_selector(1, "local", impl="reference"), batch=3, log=ref_log,
                          ordered=False)
            equal = sum(int(np.array_equal(a, b)) for a, b in zip(
                (x for pair in got_sets for x in pair),
                (x for pair in _batch_step_sets(ref_log, config.n_layers) for x in pair)))
            rows.append(dict(check="batch-select", preset="opt-tiny", batch=3, heads=heads,
                             select=name, rides=bool(rides), steps=steps,
                             logits=float(np.abs(got[0] - replay[0]).max()),
                             k_cache=float(np.abs(got[1] - replay[1]).max()),
                             sets_equal=f"{equal}/{2 * steps}",
                             logits_vs_reference_path=float(np.abs(got[0] - ref[0]).max())))
    return rows


def top_k_rows(impl: str) -> list[dict]:
    """Whether each top-k kernel returns its reference's set."""
    from dejavu_jax.kernels.top_k import (top_k_indices, top_k_indices_chunked,
                                          top_k_indices_local)
    rows = []
    rng = np.random.default_rng(5)
    for n, k in ((28672, 2867), (1536, 154), (56, 28)):
        s = jnp.asarray(rng.standard_normal(n), jnp.float32)
        for name, fn in (("radix", top_k_indices), ("chunked", top_k_indices_chunked),
                         ("local", top_k_indices_local)):
            got, ref = (jax.jit(functools.partial(fn, k=k, impl=i))(s)
                        for i in (impl, "reference"))
            same = bool(np.array_equal(np.asarray(got), np.asarray(ref)))
            rows.append(dict(check="top-k", method=name, n=n, k=k, equal=same))
    return rows


def window_rows(impl: str) -> list[dict]:
    """Largest output / cache difference of windowed head-sparse attention."""
    from dejavu_jax.kernels import KVWindow, head_sparse_attention, row_head_attention
    rows = []
    rng = np.random.default_rng(7)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for B, d, H, n_kv, hd, S, W, pos, rope, qh in (
            (1, 512, 8, 8, 64, 64, 16, 40, False, False),
            (2, 512, 8, 4, 64, 64, 16, 21, True, False),
            (1, 256, 4, 4, 64, 32, 16, 5, False, False),
            (1, 512, 16, 4, 64, 64, 16, 21, True, True),
            (3, 512, 8, 8, 64, 256, 16, 200, False, "rows"),
            (4, 512, 16, 4, 64, 256, 16, 150, True, "rows")):
        hidx = jnp.asarray(rng.permutation(n_kv)[: n_kv // 2], jnp.int32)
        extra = jnp.asarray([int(np.setdiff1d(np.arange(n_kv), hidx)[0])], jnp.int32)
        head_mask = None
        if qh == "rows":   # each row its own query heads; some row-idle groups
            head_mask = jnp.asarray(rng.random((B, len(hidx), H // n_kv)) > 0.6)
        elif qh:   # query heads: group hidx[0] keeps none (and is refreshed), the others
            G = H // n_kv  # some
            head_mask = jnp.asarray(rng.random((len(hidx), G)) > 0.5).at[0].set(False)
            head_mask = head_mask.at[1:, 0].set(True)
            extra = hidx[:1]
        raw = (pos - (pos - np.arange(W)) % W).astype(np.int32)      # ring order
        need = rng.random((B, len(hidx) + 1, W)) > 0.5
        need[:, :, raw == pos] = True
        need[:, :, raw < 0] = False
        if B > 1:   # head slot 0 misses nothing earlier: a batch multiplies its current rows
            need[:, 0, raw != pos] = False
        x = f(B, d)
        ring = f(B, W, d).at[:, pos % W].set(x)
        cos = sin = rope_now = None
        if rope:
            ang = f(B, W, hd // 2)
            cos = jnp.cos(jnp.concatenate([ang, ang], -1))
            sin = jnp.sin(jnp.concatenate([ang, ang], -1))
            rope_now = (cos[:, pos % W], sin[:, pos % W])
        window = KVWindow(x=ring, current=jnp.int32(pos % W), extra_ids=extra,
                          need=jnp.asarray(need), slots=jnp.asarray(np.maximum(raw, 0)),
                          cos=cos, sin=sin)
        w = [f(H, hd, d) * d ** -0.5, f(H, hd), f(n_kv, hd, d) * d ** -0.5, f(n_kv, hd),
             f(n_kv, hd, d) * d ** -0.5, f(n_kv, hd), f(d, H, hd) * (H * hd) ** -0.5, f(d)]
        caches = (f(B, n_kv, S, hd), f(B, n_kv, S, hd))
        got, ref = (jax.jit(functools.partial(head_sparse_attention, impl=i))(
            x, *w, *caches, jnp.int32(pos), hidx, rope=rope_now, window=window,
            head_mask=head_mask)
            for i in (impl, "reference"))
        rows.append(dict(check="window", B=B, H=H, n_kv=n_kv, pos=pos, rope=rope,
                         query_heads=qh,
                         out=float(jnp.abs(got[0] - ref[0]).max()),
                         k_cache=float(jnp.abs(got[1] - ref[1]).max()),
                         v_cache=float(jnp.abs(got[2] - ref[2]).max())))
        if qh == "rows":   # the attention core alone, every group per row (dense projections)
            mask = jnp.asarray(rng.random((B, n_kv, H // n_kv)) > 0.5)
            q = f(B, H, hd) * hd ** -0.5
            valid = jnp.asarray(rng.random((B, S)) > 0.2)
            got, ref = (jax.jit(functools.partial(row_head_attention, impl=i))(
                q, *caches, jnp.int32(pos), mask, kv_mask=valid)
                for i in (impl, "reference"))
            rows.append(dict(check="window", B=B, H=H, n_kv=n_kv, pos=pos, rope=False,
                             query_heads="rows, attention core",
                             out=float(jnp.abs(got[0] - ref[0]).max()),
                             k_cache=float(jnp.abs(got[1] - ref[1]).max()),
                             v_cache=float(jnp.abs(got[2] - ref[2]).max())))
    return rows


def norm_rows(impl: str) -> list[dict]:
    """Largest difference of the fused norm from its reference (fp32 output)."""
    from dejavu_jax.kernels.layer_norm import layer_norm
    rows = []
    rng = np.random.default_rng(6)
    for B, d, rms in ((1, 7168, False), (16, 5120, False), (1, 576, True), (3, 4096, True)):
        x = jnp.asarray(rng.standard_normal((B, d)) * 4 + 1, jnp.float32)
        scale = jnp.asarray(rng.standard_normal(d), jnp.float32)
        bias = None if rms else jnp.asarray(rng.standard_normal(d), jnp.float32)
        got, ref = (jax.jit(functools.partial(layer_norm, eps=1e-5, impl=i))(x, scale, bias)
                    for i in (impl, "reference"))
        rows.append(dict(check="norm", rows=B, d=d, rms=rms,
                         max_diff=float(jnp.abs(got - ref).max())))
        got, ref = (jax.jit(functools.partial(layer_norm, eps=1e-5, rms_dtype=jnp.float32,
                                              impl=i))(x, scale, bias)
                    for i in (impl, "reference"))
        rows.append(dict(check="norm", kernel="layer_norm+rms", rows=B, d=d, rms=rms,
                         max_diff=max(float(jnp.abs(a - b).max()) for a, b in zip(got, ref))))
    return rows


def predictor_rows(impl: str) -> list[dict]:
    """Whether the split predictor's selection returns its reference's sets."""
    from dejavu_jax.kernels.batch_predictor_select import batch_predictor_select
    from dejavu_jax.kernels.predictor_select import predictor_select
    rows = []
    rng = np.random.default_rng(8)
    for F, H, r, k_mlp, k_heads in ((28672, 56, 256, 2867, 28), (20480, 40, 256, 2048, 20)):
        L = 3
        args = (rng.standard_normal((2, 1, 2 * r)), rng.standard_normal((L, 2 * r)),
                rng.standard_normal((L, r, F)) * r ** -0.5, rng.standard_normal((L, F)),
                rng.standard_normal((L, r, H)) * r ** -0.5, rng.standard_normal((L, H)))
        args = tuple(jnp.asarray(a, jnp.float32) for a in args[:2]) + tuple(
            jnp.asarray(a, jnp.bfloat16 if i % 2 == 0 else jnp.float32)
            for i, a in enumerate(args[2:]))
        got, ref = (predictor_select(*args, jnp.int32(1), k_mlp, k_heads, impl=i)
                    for i in (impl, "reference"))
        rows.append(dict(check="predictor", F=F, H=H, rank=r,
                         equal=bool(np.array_equal(np.asarray(got[0]), np.asarray(ref[0]))
                                    and np.array_equal(np.asarray(got[1]), np.asarray(ref[1])))))
    for B, d, F, H, r, k_mlp, k_heads in ((4, 5120, 20480, 40, 256, 2048, 20),
                                          (16, 7168, 28672, 56, 256, 2867, 28)):
        L = 3
        args = (rng.standard_normal((B, d)), rng.standard_normal((L, 2 * r, d)) * d ** -0.5,
                rng.standard_normal((L, 2 * r)), rng.standard_normal((L, r, F)) * r ** -0.5,
                rng.standard_normal((L, F)), rng.standard_normal((L, r, H)) * r ** -0.5,
                rng.standard_normal((L, H)))
        args = tuple(jnp.asarray(a, jnp.bfloat16 if i in (0, 1, 3, 5) else jnp.float32)
                     for i, a in enumerate(args))
        got, ref = (batch_predictor_select(*args, jnp.int32(1), k_mlp, k_heads, impl=i)
                    for i in (impl, "reference"))
        rows.append(dict(check="predictor", batch=B, F=F, H=H, rank=r,
                         equal=bool(np.array_equal(np.asarray(got[0]), np.asarray(ref[0]))
                                    and np.array_equal(np.asarray(got[1]), np.asarray(ref[1])))))
    return rows


# (model, whether the up projection keeps its neuron rows: the gate site reads them; a
# gated model without them runs TEAL's sites, its gate and up in one launch; batch; weight
# layout: per-layer buffers, or stacked, each layer's rows read in place under lax.scan)
THRESHOLD_CASES = (("llama-tiny", True, 1, "unrolled"), ("llama-tiny", False, 1, "unrolled"),
                   ("opt-tiny", False, 1, "unrolled"), ("gemma3-tiny", True, 1, "unrolled"),
                   ("gemma2-tiny", False, 2, "unrolled"), ("llama-tiny", True, 1, "stacked"),
                   ("llama-tiny", False, 2, "stacked"), ("opt-tiny", False, 1, "stacked"),
                   ("qwen2-tiny", False, 1, "stacked"))


# the activation-sparse layer with its attention, a gated MLP's units and the gate site's
# up rows in kernels of their own, q/k/v summed into one row and the attention's splits
# merged by the out-projection, and one sum of a program's rows, checked beside the
# defaults
KERNELS_ON = dataclasses.replace(
    ThresholdConfig(), attention_kernel=True, gated_kernel=True, gate_rows_kernel=True,
    o_merges_splits=True, qkv_atomics=True,
    **{site: dataclasses.replace(getattr(ThresholdConfig(), site), deferred_sum=True)
       for site in ("qkv", "o", "gate_up", "down")})


def threshold_rows(impl: str, steps: int, cases=None, kernels: bool = True) -> list[dict]:
    """Check 7: threshold decoding of `cases` (default all of `THRESHOLD_CASES`) and, with
    `kernels`, the activation-sparse kernels alone."""
    with jax.default_matmul_precision("highest"):
        return (_threshold_decode_rows(impl, steps, THRESHOLD_CASES if cases is None
                                       else cases)
                + (_threshold_kernel_rows(impl) if kernels else []))


def _threshold_decode_rows(impl: str, steps: int, cases) -> list[dict]:
    from dejavu_jax.params import input_major, with_gate_weights
    from dejavu_jax.train.thresholds import calibration_stats, thresholds_at
    rows = []
    for name, up_rows, batch, layout in cases:
        config = tiny_config(name)
        params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
        if up_rows:  # the gate site ranks neurons by |act(gate)| times gate weights
            weights = jax.random.uniform(jax.random.key(4), (config.n_layers, config.ffn),
                                         jnp.float32, 0.2, 3.0)
            params = with_gate_weights(params, weights)
        ids = jax.random.randint(jax.random.key(3), (1, 32), 3, config.vocab_size)
        q = calibration_stats(config, params, ids, jnp.ones_like(ids), ())["quantiles"]
        levels = np.full((config.n_layers, 5), 0.4)
        if not up_rows:
            levels[:, 3] = 0.0  # the gate site (none on OPT)
        thresholds = jnp.asarray(thresholds_at(np.asarray(q), levels))
        sites = tuple(s for i, s in enumerate(("qkv", "o", "gate_up", "gate", "down"))
                      if levels[0, i] > 0)
        # batch_policy "kernels": a batch would otherwise decode dense
        scfg = dataclasses.replace(sparse.threshold_config(config, sites),
                                   batch_policy="kernels")
        ref = _decode(config, dataclasses.replace(scfg, impl="reference"), params, thresholds,
                      steps, False, sparse.no_selector, batch=batch)
        moved = input_major(params, up_rows=up_rows)
        unrolled = layout == "unrolled"
        for blocks in (None, KERNELS_ON):  # the defaults, then every kernel switch on
            got = _decode(config, dataclasses.replace(scfg, impl=impl, threshold_blocks=blocks),
                          unstack_layers(moved) if unrolled else moved, thresholds, steps,
                          unrolled, sparse.no_selector, batch=batch)
            rows.append(dict(check="threshold", model=name, batch=batch, layout=layout,
                             sites=list(sites), gate_weights=up_rows,
                             kernels="defaults" if blocks is None else "all",
                             logits=float(np.abs(got[0] - ref[0]).max()),
                             k_cache=float(np.abs(got[1] - ref[1]).max())))
    return rows


def _threshold_kernel_rows(impl: str) -> list[dict]:
    from dejavu_jax.kernels.gated_hidden import gated_hidden
    from dejavu_jax.kernels.gated_rows import gated_rows
    from dejavu_jax.kernels.threshold_matvec import (row_masked_matvec, threshold_matvec,
                                                     threshold_matvecs)
    rng = np.random.default_rng(9)
    rows = []
    for B, K, N in ((1, 1536, 8960), (3, 8960, 1536), (1, 2048, 2560)):
        x = jnp.asarray(rng.standard_normal((B, K)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((K, N)) * K ** -0.5, jnp.float32)
        t = float(np.quantile(np.abs(np.asarray(x)), 0.5))
        res = jnp.asarray(rng.standard_normal((B, N)), jnp.float32)
        # both paths also as the down projection's default may run them: up to 8 blocks a
        # program in a loop Triton pipelines 4 deep (`ThresholdConfig`)
        for residual, looped in ((None, False), (res, False), (None, True), (res, True)):
            blocks = dict(row_blocks=8, num_stages=4) if looped else {}
            got, ref = (jax.jit(functools.partial(threshold_matvec, impl=i, **blocks))(
                x, w, t, residual=residual) for i in (impl, "reference"))
            rows.append(dict(check="threshold", kernel="threshold_matvec", B=B, K=K, N=N,
                             residual=residual is not None, looped=looped,
                             logits=float(jnp.abs(got - ref).max()), k_cache=0.0))
        # the out-projection's input merged from attention splits as it is loaded
        S, H = 5, K // 128
        o = jnp.asarray(rng.standard_normal((S, B, K)), jnp.float32)
        m = jnp.asarray(rng.standard_normal((S, B, H)) * 3, jnp.float32)
        ell = jnp.asarray(rng.uniform(0.5, 4.0, (S, B, H)), jnp.float32)
        got, ref = (jax.jit(functools.partial(threshold_matvec, impl=i))(
            o, w, t, residual=res, splits=(m, ell)) for i in (impl, "reference"))
        rows.append(dict(check="threshold", kernel="threshold_matvec", B=B, K=K, N=N,
                         residual=True, splits=S, logits=float(jnp.abs(got - ref).max()),
                         k_cache=0.0))
        keep = jnp.asarray(rng.random(K) < 0.5)
        xr = jnp.asarray(rng.standard_normal((B, N)), jnp.float32)
        got, ref = (jax.jit(functools.partial(row_masked_matvec, impl=i))(xr, w, keep)
                    for i in (impl, "reference"))
        rows.append(dict(check="threshold", kernel="row_masked_matvec", B=B, F=K, d=N,
                         logits=float(jnp.abs(got - ref).max()), k_cache=0.0))
        w2 = jnp.asarray(rng.standard_normal((K, 2 * N)) * K ** -0.5, jnp.float32)
        got, ref = (jax.jit(functools.partial(threshold_matvecs, impl=i))(x, [w, w2], t)
                    for i in (impl, "reference"))
        rows.append(dict(check="threshold", kernel="threshold_matvecs", B=B, K=K, N=N,
                         logits=max(float(jnp.abs(g - r).max()) for g, r in zip(got, ref)),
                         k_cache=0.0))
        # a gated MLP's units from the gate's and up's partials of one launch (stacked: the
        # layer's bias, gate weights and threshold read in place)
        table = jnp.asarray([[0.0, 0.0, 0.0, 0.05, 0.0], [0.0, 0.0, 0.0, 0.1, 0.0]])
        bias, gw = (jnp.asarray(rng.uniform(lo, 2, (2, N)), jnp.float32) for lo in (-2, 0.2))
        parts = threshold_matvecs(x, [w, w], t, impl=impl, partials=True)
        parts = (parts[0], parts[1] * 0.5 + 0.1)
        got, ref = (jax.jit(functools.partial(gated_hidden, activation="silu", impl=i,
                                              threshold_index=3))(
            *parts, table, b_in=bias, gate_weight=gw, layer=jnp.int32(1))
            for i in (impl, "reference"))
        rows.append(dict(check="threshold", kernel="gated_hidden", B=B, K=K, N=N,
                         kept=float((ref != 0).mean()),
                         logits=float(jnp.abs(got - ref).max()), k_cache=0.0))
        # the gate site's units: the gate's partials and the kept neurons' up rows over the
        # thresholded input (stacked: the layer's rows and both thresholds read in place)
        w_in = jnp.asarray(rng.standard_normal((2 * N, K)) * K ** -0.5, jnp.float32)
        got, ref = (jax.jit(functools.partial(gated_rows, activation="silu", impl=i,
                                              input_index=1, gate_index=3))(
            parts[0], x, w_in, table.at[:, 1].set(t), b_in=bias, gate_weight=gw,
            layer=jnp.int32(1)) for i in (impl, "reference"))
        rows.append(dict(check="threshold", kernel="gated_rows", B=B, K=K, N=N,
                         kept=float((ref != 0).mean()),
                         logits=float(jnp.abs(got - ref).max()), k_cache=0.0))
    return rows


def switch_rows(impl: str) -> list[dict]:
    """Check 8: the kernels' load switches against their references: the input-sparse
    GEMV with its column blocks first and the evict-first hint (`ThresholdBlocks`), the
    residual added in the launch or from partials by XLA; the sparse MLP pair with the
    evict-first hint (`MLPConfig.evict_first`), gated and not, one row and three."""
    from dejavu_jax.kernels import MLPConfig, sparse_mlp
    from dejavu_jax.kernels.threshold_matvec import threshold_matvec
    rng = np.random.default_rng(10)
    rows = []
    with jax.default_matmul_precision("highest"):
        for B, K, N in ((1, 1536, 8960), (3, 8960, 1536)):
            x = jnp.asarray(rng.standard_normal((B, K)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((K, N)) * K ** -0.5, jnp.float32)
            t = float(np.quantile(np.abs(np.asarray(x)), 0.5))
            res = jnp.asarray(rng.standard_normal((B, N)), jnp.float32)
            for atomics in (True, False):
                switches = dict(columns_first=True, evict_first=True,
                                residual_atomics=atomics, deferred_sum=True)
                got, ref = (jax.jit(functools.partial(threshold_matvec, impl=i, **switches))(
                    x, w, t, residual=res) for i in (impl, "reference"))
                rows.append(dict(check="switches", kernel="threshold_matvec", B=B, K=K,
                                 N=N, **switches, logits=float(jnp.abs(got - ref).max()),
                                 k_cache=0.0))
        d, F, k = 512, 2048, 300
        for B, gated in ((1, False), (3, True)):
            x = jnp.asarray(rng.standard_normal((B, d)), jnp.float32)
            w1, w2t, wg = (jnp.asarray(rng.standard_normal((F, d)) * d ** -0.5, jnp.float32)
                           for _ in range(3))
            b1, b2 = (jnp.asarray(rng.standard_normal(n), jnp.float32) for n in (F, d))
            idx = jnp.asarray(rng.choice(F, k, replace=False), jnp.int32)
            got, ref = (sparse_mlp(x, w1, b1, w2t, b2, idx, activation="silu" if gated
                                   else "relu", w_gate=wg if gated else None, impl=i,
                                   config=MLPConfig(evict_first=True))
                        for i in (impl, "reference"))
            rows.append(dict(check="switches", kernel="sparse_mlp", B=B, gated=gated,
                             evict_first=True, logits=float(jnp.abs(got - ref).max()),
                             k_cache=0.0))
        rows += attention_switch_rows(impl, rng)
    return rows


def attention_switch_rows(impl: str, rng) -> list[dict]:
    """Head-sparse attention with the evict-first hint on its q/k/v and out-projection
    loads (`AttnConfig.evict_first`), against its reference: MHA at one row, GQA with a
    query-head mask at three, the residual added by the out-projection."""
    from dejavu_jax.kernels import AttnConfig, head_sparse_attention
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    rows = []
    for B, H, n_kv, query_heads in ((1, 8, 8, False), (3, 16, 4, True)):
        d, hd, S, pos = 512, 64, 64, 37
        hidx = jnp.asarray(rng.permutation(n_kv)[: n_kv // 2], jnp.int32)
        head_mask = None
        if query_heads:
            head_mask = jnp.asarray(rng.random((len(hidx), H // n_kv)) > 0.5).at[:, 0].set(True)
        w = [f(H, hd, d) * d ** -0.5, f(H, hd), f(n_kv, hd, d) * d ** -0.5, f(n_kv, hd),
             f(n_kv, hd, d) * d ** -0.5, f(n_kv, hd), f(d, H, hd) * (H * hd) ** -0.5, f(d)]
        x, res = f(B, d), f(B, d)
        caches = (f(B, n_kv, S, hd), f(B, n_kv, S, hd))
        got = jax.jit(functools.partial(head_sparse_attention, impl=impl,
                                        config=AttnConfig(evict_first=True)))(
            x, *w, *caches, jnp.int32(pos), hidx, head_mask=head_mask, residual=res)
        ref = jax.jit(functools.partial(head_sparse_attention, impl="reference"))(
            x, *w, *caches, jnp.int32(pos), hidx, head_mask=head_mask)
        rows.append(dict(check="switches", kernel="head_sparse_attention", B=B, H=H,
                         n_kv=n_kv, evict_first=True,
                         logits=float(jnp.abs(got[0] - (ref[0] + res)).max()),
                         k_cache=max(float(jnp.abs(g - r).max())
                                     for g, r in zip(got[1:3], ref[1:3]))))
    return rows


def row_passes(r: dict, tol: float) -> bool:
    """Whether one check's row passes at tolerance `tol`."""
    if r["check"] in ("top-k", "predictor"):
        return r["equal"]
    if r["check"] == "norm":
        return r["max_diff"] <= tol
    if r["check"] == "window":
        return max(r["out"], r["k_cache"], r["v_cache"]) <= tol
    if r["check"] == "split":
        return max(r["logits"], r["k_cache"]) <= tol and r["selection_slack"] <= TIE_SLACK
    if r["check"] == "batch-select":
        return max(r["logits"], r["k_cache"]) <= tol and r["rides"]
    return max(r["logits"], r["k_cache"]) <= tol


CHECKS = ("norm", "window", "decode", "split", "batch-select", "top-k", "predictor",
          "threshold", "switches")


def check_parts(impl: str, steps: int) -> list[tuple[str, object]]:
    """Every check as independent parts, (check name, function returning its rows): the
    parts run one after another, or in processes of their own with --jobs."""
    return [*[("decode", functools.partial(decode_rows, impl, steps, (case,)))
              for case in DECODE_CASES],  # the longest parts first
            ("window", functools.partial(window_rows, impl)),
            ("split", functools.partial(split_rows, impl, steps)),
            ("batch-select", functools.partial(batch_select_rows, impl, steps)),
            ("top-k", functools.partial(top_k_rows, impl)),
            ("predictor", functools.partial(predictor_rows, impl)),
            ("norm", functools.partial(norm_rows, impl)),
            *[("threshold", functools.partial(threshold_rows, impl, steps, (case,), False))
              for case in THRESHOLD_CASES],
            ("threshold", functools.partial(threshold_rows, impl, steps, (), True)),
            ("switches", functools.partial(switch_rows, impl))]


def _run_parts_in_processes(args, parts: list[int], jobs: int):
    """Yield (part index, rows, seconds) as each part finishes in a process of its own
    (`jobs` at a time): compiles dominate the checks and run on the host's cores."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor, as_completed
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")

    def run(i):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "dejavu_jax.eval.kernel_parity", "--impl", args.impl,
             "--steps", str(args.steps), "--part", str(i)],
            env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"kernel_parity part {i} failed:\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in proc.stdout.splitlines()
                if line.startswith("{")]
        return i, rows, time.perf_counter() - t0

    with ThreadPoolExecutor(jobs) as pool:
        for future in as_completed([pool.submit(run, i) for i in parts]):
            yield future.result()


def main(argv=None) -> int:
    """Run the checks; print one JSON line per check; exit 1 on a failure."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.kernel_parity",
                           description=__doc__.strip().split("\n")[0])
    p.add_argument("--impl", default="pallas", choices=("pallas", "interpret"),
                   help="pallas: the kernels compiled for the GPU (default); interpret: the "
                        "Pallas interpreter, on any host")
    p.add_argument("--steps", type=cli.positive_int, default=6,
                   help="decoded tokens per decode check")
    p.add_argument("--tol", type=cli.positive_float, default=1e-4,
                   help="largest absolute difference a check passes with")
    p.add_argument("--checks", default=",".join(CHECKS),
                   help=f"comma list of {', '.join(CHECKS)}")
    p.add_argument("--jobs", type=cli.non_negative_int, default=0,
                   help="checks run in this many processes at once (default: 1 with "
                        "--impl interpret or on a host of fewer than 8 cores, else up to 8)")
    p.add_argument("--part", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=cli.output_dir, default="runs/kernel_parity",
                   help="folder for kernel_parity.json (default runs/kernel_parity)")
    args = p.parse_args(argv)
    if args.impl == "pallas" and jax.default_backend() != "gpu":
        p.error(f"--impl pallas compiles the kernels for a GPU and this host has none "
                f"({jax.default_backend()}); --impl interpret runs them in the interpreter")
    parts = check_parts(args.impl, args.steps)
    if args.part is not None:  # one part, in a worker process: its rows on stdout
        for r in parts[args.part][1]():
            print(json.dumps(r), flush=True)
        return 0
    names = args.checks.split(",")
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    chosen = [i for i, (name, _) in enumerate(parts) if name in names]
    import os
    jobs = args.jobs or (1 if args.impl == "interpret" or (os.cpu_count() or 1) < 8
                         else min(8, len(chosen)))

    rows, ok, seconds = [], True, {}
    start = time.perf_counter()

    def finished():
        if jobs == 1:  # in this process, in order
            for i in chosen:
                t0 = time.perf_counter()
                got = parts[i][1]()
                yield i, got, time.perf_counter() - t0
        else:
            yield from _run_parts_in_processes(args, chosen, jobs)

    for i, got, took in finished():  # each part's rows print as it finishes
        name = parts[i][0]
        for r in got:
            r["ok"] = row_passes(r, args.tol)
            ok &= r["ok"]
            rows.append(r)
            print(json.dumps(r), flush=True)
        seconds[name] = round(seconds.get(name, 0.0) + took, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from dejavu_jax.eval.provenance import run_meta
    meta = dict(command="python -m dejavu_jax.eval.kernel_parity " + " ".join(
                    sys.argv[1:] if argv is None else argv), **run_meta(), impl=args.impl,
                tol=args.tol, steps=args.steps, jobs=jobs, passed=bool(ok), checks=len(rows),
                failed=sum(not r["ok"] for r in rows), seconds=seconds,
                total_seconds=round(time.perf_counter() - start, 1))
    (out / "kernel_parity.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed in {meta['total_seconds']} s "
          f"with {jobs} process(es) (summed per check: "
          f"{', '.join(f'{k} {v} s' for k, v in seconds.items())})", flush=True)
    print("all checks passed" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
