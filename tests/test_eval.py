"""Quality evaluation: the parallel sparse scorer against token-by-token sparse decode,
perplexity against numpy, multiple-choice scoring, task loaders on the real files."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import sparse
from dejavu_jax.eval import sparse_scoring as ss
from dejavu_jax.train import predict as predict_mod
from dejavu_jax.train.predictor_model import PredictorParams, init_predictor


def _random_predictors(config, seed, r=8):
    """Random lookahead predictors whose scores depend on the input (flat base rate)."""
    L, d = config.n_layers, config.hidden
    k1, k2 = jax.random.split(jax.random.key(seed))
    stats = (np.zeros((L, d), np.float32), np.ones((L, d), np.float32))

    def make(key, n):
        p = init_predictor(key, L, d, r, n, *stats, np.full((L, n), 0.3))
        return p.replace(w2=p.w2 * 10.0)  # input-driven scores, not bias-driven

    return PredictorParams(mlp=make(k1, config.ffn), heads=make(k2, config.n_heads))


def _model(preset, seed):
    config = dj.preset(preset)
    return config, dj.init_params(config, jax.random.key(seed), jnp.float32, std=0.15)


def _decode_teacher_forced(config, scfg, selector, model_params, pred_params, ids, prefix):
    """Logits [T - prefix + 1, V] of prefill + one step per remaining token, B = 1,
    and the index sets the engine used at each step: {(step, layer): (neurons, groups)}."""
    eng = sparse.sparse_engine(config, scfg, selector)
    state = eng.init_state(1, len(ids) + 1, jnp.float32)
    prompt = jnp.asarray([ids[:prefix]], jnp.int32)
    logits, state = eng.prefill((model_params, pred_params), prompt, jnp.ones_like(prompt),
                                state)
    out = [np.asarray(logits[0])]
    step = jax.jit(eng.step)
    for i, tok in enumerate(ids[prefix:]):
        _RECORD["step"] = i
        logits, state = step((model_params, pred_params), state, jnp.asarray([tok], jnp.int32))
        jax.effects_barrier()
        out.append(np.asarray(logits[0]))
    return np.stack(out)


_RECORD = {"step": 0, "sets": {}, "calls": []}


def _recording_predictor_selector(config, scfg):
    """The predictor selector, recording the sets the engine uses. The engine also makes
    calls whose result it drops: a segment's last layer looks ahead with its own k
    (dropped when the next segment's k differ) and the last layer looks ahead to itself.
    So only calls with the layer's own k count, and the first such call per step."""
    base = sparse.predictor_selector(config.group_size)

    def select(pred_params, layer, x, k_mlp, k_heads):
        neurons, groups = base(pred_params, layer, x, k_mlp, k_heads)

        def record(layer, neurons, groups):
            if (len(neurons), len(groups)) == (scfg.mlp_k[layer], scfg.head_k[layer]):
                _RECORD["sets"].setdefault((_RECORD["step"], int(layer)),
                                           (set(neurons.tolist()), set(groups.tolist())))

        jax.debug.callback(record, layer, neurons, groups, ordered=True)
        return neurons, groups

    return select


def _sets_from_masks(masks, layer, t):
    neuron_mask, group_mask = (np.asarray(m) for m in masks)
    return (set(np.flatnonzero(neuron_mask[layer, 0, t]).tolist()),
            set(np.flatnonzero(group_mask[layer, 0, t]).tolist()))


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_parallel_scorer_equals_sparse_decode_with_predictors(preset):
    config, params = _model(preset, 11)
    pred = _random_predictors(config, 12)
    # two sparse segments (layer 1 alone, then layers 2-3): lookahead crosses a boundary
    scfg = sparse.sparse_config(config, [1.0, 0.5, 0.3, 0.3], 0.5, dense_layers=1,
                                kv_window=4)
    _RECORD["sets"].clear()
    for seed in range(2):  # sampled sequences
        rng = np.random.default_rng(seed)
        T, prefix = 13, int(rng.integers(1, 4))
        ids = rng.integers(3, 1000, T).tolist()
        _RECORD["sets"].clear()
        want = _decode_teacher_forced(config, scfg, _recording_predictor_selector(config, scfg),
                                      params, pred, ids, prefix)
        arr = jnp.asarray([ids], jnp.int32)
        got, masks = ss.window_logits(config, scfg, params, pred, arr, jnp.ones_like(arr),
                                      jnp.asarray([prefix]))
        got = np.asarray(got[0, prefix - 1:])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        for i in range(T - prefix):
            for layer in range(1, config.n_layers):
                assert _sets_from_masks(masks, layer, prefix + i) == \
                    _RECORD["sets"][(i, layer)], f"step {i} layer {layer}"
        dense = np.asarray(dj.logits(config, params, arr)[0, prefix - 1:])
        assert np.abs(dense - want).max() > 1e-3, "sparsity had no effect: weak test"


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_parallel_scorer_equals_sparse_decode_oracle(preset, monkeypatch):
    config, params = _model(preset, 21)
    scfg = sparse.sparse_config(config, 0.25, 0.5, dense_layers=1, oracle=True,
                                kv_window=4)
    original = predict_mod.select_top_k
    calls = _RECORD["calls"]

    def recording_top_k(scores, k, capacity=None):
        idx = original(scores, k, capacity)
        jax.debug.callback(lambda i: calls.append((_RECORD["step"], i.tolist())), idx,
                           ordered=True)
        return idx

    monkeypatch.setattr(predict_mod, "select_top_k", recording_top_k)
    rng = np.random.default_rng(3)
    T, prefix = 12, 2
    ids = rng.integers(3, 1000, T).tolist()
    calls.clear()
    want = _decode_teacher_forced(config, scfg, sparse.no_selector, params, None, ids, prefix)
    arr = jnp.asarray([ids], jnp.int32)
    got, masks = ss.window_logits(config, scfg, params, None, arr, jnp.ones_like(arr),
                                  jnp.asarray([prefix]))
    np.testing.assert_allclose(np.asarray(got[0, prefix - 1:]), want, atol=1e-4, rtol=0)
    # the engine selects heads then neurons, layer by layer, in every step
    sparse_layers = range(scfg.dense_layers, config.n_layers)
    assert len(calls) == (T - prefix) * 2 * len(sparse_layers)
    it = iter(calls)
    for i in range(T - prefix):
        for layer in sparse_layers:
            (s1, groups), (s2, neurons) = next(it), next(it)
            assert s1 == s2 == i
            assert _sets_from_masks(masks, layer, prefix + i) == (set(neurons), set(groups))
