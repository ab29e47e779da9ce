"""The split predictor: its kernels against numpy, and the decode step that runs it."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import sparse
from dejavu_jax.kernels.predictor_select import predictor_select
from dejavu_jax.kernels.sparse_mlp import Riders
from dejavu_jax.sparse_variants import APART, variant_selector

F32 = jnp.float32


def _bf16_keys(scores):
    """Scores truncated to their upper 16 bits (what the kernels rank by)."""
    return (np.asarray(scores, np.float32).view(np.int32) & np.int32(-65536)).view(np.float32)


def _numpy_sets(h_parts, b1, w2m, b2m, w2h, b2h, layer, k_mlp, k_heads, act, chunk):
    f = lambda a: np.asarray(a, np.float64)
    h = f(h_parts).sum(0)[0, :b1.shape[1]] + f(b1)[layer]
    h = np.maximum(h, 0) if act == "relu" else h
    r_mlp = w2m.shape[1]
    # the hidden units are rounded to each second layer's dtype first
    hm = np.asarray(jnp.asarray(h[:r_mlp], F32).astype(w2m.dtype).astype(F32), np.float64)
    hh = np.asarray(jnp.asarray(h[r_mlp:], F32).astype(w2h.dtype).astype(F32), np.float64)
    mlp = (hm @ f(w2m)[layer] + f(b2m)[layer]).astype(np.float32)
    heads = (hh @ f(w2h)[layer] + f(b2h)[layer]).astype(np.float32)
    F = mlp.shape[0]
    P = -(-F // chunk)
    c = -(-F // P)
    kc = max(1, min(round(k_mlp / P), F - (P - 1) * c))
    keys = _bf16_keys(mlp)
    if k_mlp == F:  # every neuron, whatever the chunks' quotas
        return np.arange(F), np.sort(np.argsort(-_bf16_keys(heads), kind="stable")[:k_heads])
    neurons = []
    for p in range(P):
        part = keys[p * c:(p + 1) * c]
        neurons += sorted((p * c + np.argsort(-part, kind="stable")[:kc]).tolist())
    top_heads = np.sort(np.argsort(-_bf16_keys(heads), kind="stable")[:k_heads])
    return np.asarray(neurons), top_heads


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("F,H,r_mlp,r_heads,k_mlp,k_heads,act,chunk",
                         [(5000, 40, 24, 20, 500, 7, "none", 2048),
                          (300, 12, 16, 8, 31, 3, "relu", 128),
                          (64, 5, 8, 4, 64, 5, "none", 2048),
                          (301, 6, 8, 4, 301, 2, "relu", 128)])   # k = F, a short last chunk
def test_predictor_select_equals_numpy(rng, impl, F, H, r_mlp, r_heads, k_mlp, k_heads, act,
                                       chunk):
    L, P = 3, 2
    width = r_mlp + r_heads + 5  # partials wider than the hidden units, as the launch pads
    args = (rng.standard_normal((P, 1, width)), rng.standard_normal((L, r_mlp + r_heads)),
            rng.standard_normal((L, r_mlp, F)), rng.standard_normal((L, F)),
            rng.standard_normal((L, r_heads, H)), rng.standard_normal((L, H)))
    args = tuple(jnp.asarray(a, F32) for a in args)
    if F == 300:  # bf16 second layers, as the benchmark's predictors
        args = args[:2] + (args[2].astype(jnp.bfloat16), args[3],
                           args[4].astype(jnp.bfloat16), args[5])
    select = predictor_select  # the kernel path is one jitted program already
    if impl == "reference":  # one program too, not the jnp reference op by op
        select = jax.jit(select, static_argnames=("k_mlp", "k_heads", "activation", "chunk",
                                                  "impl", "row_blocks", "block_d"))
    for layer in (0, L - 1):
        blocks = dict(row_blocks=1, block_d=128) if F == 5000 else {}  # non-default blocks
        neurons, heads = select(*args, jnp.int32(layer), k_mlp=k_mlp, k_heads=k_heads,
                                activation=act, chunk=chunk, impl=impl, **blocks)
        want_n, want_h = _numpy_sets(*args, layer, k_mlp, k_heads, act, chunk)
        np.testing.assert_array_equal(np.asarray(neurons), want_n)
        np.testing.assert_array_equal(np.asarray(heads), want_h)


def test_selection_parts_offset_ids_into_the_flattened_layers(rng):
    """The riding selection's parts with offset_ids write layer * F + neuron and
    layer * H + head: the numpy sets, offset."""
    from dejavu_jax.kernels.launch import launch
    from dejavu_jax.kernels.predictor_select import selection_parts
    L, P, F, H, r_mlp, r_heads, k_mlp, k_heads = 3, 2, 300, 12, 16, 8, 31, 3
    args = tuple(jnp.asarray(a, F32) for a in (
        rng.standard_normal((P, 1, r_mlp + r_heads + 5)),
        rng.standard_normal((L, r_mlp + r_heads)), rng.standard_normal((L, r_mlp, F)),
        rng.standard_normal((L, F)), rng.standard_normal((L, r_heads, H)),
        rng.standard_normal((L, H))))
    for layer in (1, L - 1):
        score, select_of = selection_parts(*args, jnp.int32(layer), k_mlp, k_heads,
                                           activation="relu", chunk=128, offset_ids=True)
        (parts,), = launch([score], interpret=True)
        (neurons, heads), = launch([select_of(parts)], interpret=True)
        want_n, want_h = _numpy_sets(*args, layer, k_mlp, k_heads, "relu", 128)
        np.testing.assert_array_equal(np.asarray(neurons), want_n + layer * F)
        np.testing.assert_array_equal(np.asarray(heads), want_h + layer * H)


def test_predictor_select_rejects_bad_inputs():
    L, r, F, H = 2, 4, 32, 6
    good = dict(h_parts=jnp.zeros((1, 1, 2 * r)), b1=jnp.zeros((L, 2 * r)),
                w2_mlp=jnp.zeros((L, r, F)), b2_mlp=jnp.zeros((L, F)),
                w2_heads=jnp.zeros((L, r, H)), b2_heads=jnp.zeros((L, H)))
    with pytest.raises(ValueError, match="one token"):
        predictor_select(**{**good, "h_parts": jnp.zeros((1, 2, 2 * r))}, layer=0, k_mlp=3,
                         k_heads=2)
    with pytest.raises(ValueError, match="k_mlp"):
        predictor_select(**good, layer=0, k_mlp=F + 1, k_heads=2)
    with pytest.raises(ValueError, match="activation"):
        predictor_select(**good, layer=0, k_mlp=3, k_heads=2, activation="tanh")
    with pytest.raises(ValueError, match="b1"):
        predictor_select(**{**good, "b1": jnp.zeros((L, r))}, layer=0, k_mlp=3, k_heads=2)


def _split_setup(impl, dtype, preset):
    """(config, params, predictors, sparse config) of the split-step test."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    config = dj.preset(preset).replace(n_layers=3)
    if config.family == "llama":  # one query head per KV head (the split needs it), gated MLP
        config = config.replace(n_kv_heads=config.n_heads)
    params = dj.init_params(config, jax.random.key(3), F32, std=0.1)
    preds = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.bfloat16 else a,
                         decode_predictors(random_predictors(config, 8, jax.random.key(4))))
    scfg = sparse.sparse_config(config, 0.25, 0.5, dense_layers=1, impl=impl)
    return config, params, preds, scfg


_IDS, _TOKENS = [[5, 9, 14, 3]], (42, 7, 19)


def _decode_logits(eng, params, preds):
    """The logits [steps, 1, V] of prefilling _IDS and decoding _TOKENS."""
    from conftest import step_logits
    return step_logits(eng, (params, preds), _IDS, [[tok] for tok in _TOKENS])


@functools.cache
def _called_selector_run(impl, dtype, preset):
    """(logits, the sets of every call (layer, neurons, heads)) of the decode step calling
    the predictor selector, never split. Calling it runs the same program whether its
    split form rides in the MLP launches or selects apart (`PredictorSelector.__call__`
    does not read `ride_mlp_launches`), so the two split variants share this run."""
    config, params, preds, scfg = _split_setup(impl, dtype, preset)
    select = variant_selector(config.group_size, "local", impl=impl)
    calls = []

    def called(p, layer, x, k_mlp, k_heads):  # the same selector, never split
        sets = select(p, layer, x, k_mlp, k_heads)
        jax.debug.callback(lambda l, n, g: calls.append((int(l), np.asarray(n), np.asarray(g))),
                           layer, *sets)
        return sets

    logits = _decode_logits(sparse.sparse_engine(config, scfg, called), params, preds)
    jax.effects_barrier()
    return logits, calls


@pytest.mark.parametrize("impl,dtype,ride,preset", [
    ("interpret", F32, True, "opt-tiny"), ("interpret", F32, False, "opt-tiny"),
    ("reference", jnp.bfloat16, True, "opt-tiny"), ("interpret", F32, True, "llama-tiny")])
def test_split_predictor_step_equals_the_called_selector(impl, dtype, ride, preset,
                                                         monkeypatch):
    """The decode step that splits the predictor across the layer (first product in the
    projection launch, selection after attention: in launches of its own, or riding in
    the MLP's launches) picks the sets that calling the selector on the layer's input
    picks, and gives the same logits."""
    config, params, preds, scfg = _split_setup(impl, dtype, preset)
    split = variant_selector(config.group_size, "local" if ride else "local" + APART,
                             impl=impl)
    assert split.splits(preds, 1) and not split.splits(preds, 2)

    finished = []
    orig_finish = split.finish
    F, H = config.ffn, config.n_heads

    def record(l, n, g):
        # over stacked weights the split sets come offset into the flattened weights
        n, g, l = np.asarray(n), np.asarray(g), int(l)
        assert n.min() >= l * F and n.max() < (l + 1) * F and g.min() >= l * H
        finished.append((l, n - l * F, g - l * H))

    ridden = []  # layers whose selection rides in the MLP launches, in trace order

    def recording_finish(p, layer, parts, *args):
        sets = orig_finish(p, layer, parts, *args)
        if isinstance(sets, Riders):  # recorded where the fc2 launch returns them
            ridden.append(layer)
            return sets
        jax.debug.callback(record, layer, *sets)
        return sets

    split.finish = recording_finish
    orig_mlp = sparse._sparse_mlp

    def recording_mlp(*args, riders=None, **kw):
        out = orig_mlp(*args, riders=riders, **kw)
        if riders is not None:  # the sets the fc2 launch selected, for layer ridden[-1]
            jax.debug.callback(record, ridden[-1], *out[1][0])
        return out

    monkeypatch.setattr(sparse, "_sparse_mlp", recording_mlp)
    logits = {"split": _decode_logits(sparse.sparse_engine(config, scfg, split), params,
                                      preds)}
    jax.effects_barrier()
    monkeypatch.undo()
    logits["called"], calls = _called_selector_run(impl, dtype, preset)
    assert finished, "the split path did not run"
    assert bool(ridden) == (ride and impl != "reference")
    assert_finite_close(logits["split"], logits["called"], atol=1e-5, rtol=1e-5)
    # per layer, the split path's sets (one per step) are among the called selector's,
    # counted with multiplicity (the called path also selects the first sparse layer)
    def counted(records):
        return collections.Counter((layer, n.tobytes(), g.tobytes()) for layer, n, g in records)
    split_sets, called_sets = counted(finished), counted(calls)
    assert sum(split_sets.values()) == len(finished) >= 3
    for key, count in split_sets.items():
        assert called_sets[key] >= count, f"layer {key[0]}: a split set the selector never chose"
