"""A batch's predictor selection in three launches against numpy, and the step that runs it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.kernels.batch_predictor_select import (batch_predictor_select,
                                                       batch_union_shape)
from test_predictor_select import _bf16_keys
from test_union_select import _numpy_union

F32 = jnp.float32


def _numpy_sets(x, w1t, b1, w2m, b2m, w2h, b2h, layer, k_mlp, k_heads, act, chunk):
    """float64 numpy: every row's scores, the union of the rows' local top-k per chunk
    padded with the chunk's lowest non-members, and each row's top-k heads."""
    f = lambda a: np.asarray(jnp.asarray(a, F32), np.float64)
    x = np.asarray(jnp.asarray(x).astype(w1t.dtype).astype(F32), np.float64)  # as the kernel
    h = x @ f(w1t)[layer].T + f(b1)[layer]
    h = {"relu": lambda v: np.maximum(v, 0),
         "gelu": lambda v: np.asarray(jax.nn.gelu(jnp.asarray(v, F32)), np.float64)}.get(
             act, lambda v: v)(h)
    r_mlp = w2m.shape[1]
    round_to = lambda a, w: np.asarray(jnp.asarray(a, F32).astype(w.dtype).astype(F32),
                                       np.float64)
    mlp = (round_to(h[:, :r_mlp], w2m) @ f(w2m)[layer] + f(b2m)[layer]).astype(np.float32)
    heads = (round_to(h[:, r_mlp:], w2h) @ f(w2h)[layer] + f(b2h)[layer]).astype(np.float32)
    neurons = _numpy_union(_bf16_keys(mlp), k_mlp, chunk)
    top_heads = np.sort(np.argsort(-_bf16_keys(heads), axis=1, kind="stable")[:, :k_heads], 1)
    return np.asarray(neurons), top_heads


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("B,d,F,H,r_mlp,r_heads,k_mlp,k_heads,act,chunk",
                         [(4, 64, 5000, 40, 24, 20, 500, 7, "none", 2048),
                          (3, 48, 300, 12, 16, 8, 31, 3, "relu", 128),
                          (16, 32, 700, 5, 8, 4, 20, 5, "none", 256),
                          (5, 600, 1001, 9, 40, 8, 300, 9, "gelu", 256)])
def test_batch_select_equals_numpy(rng, impl, B, d, F, H, r_mlp, r_heads, k_mlp, k_heads,
                                   act, chunk):
    L = 3
    R = r_mlp + r_heads
    args = [rng.standard_normal((B, d)), rng.standard_normal((L, R, d)) / np.sqrt(d),
            rng.standard_normal((L, R)), rng.standard_normal((L, r_mlp, F)),
            rng.standard_normal((L, F)), rng.standard_normal((L, r_heads, H)),
            rng.standard_normal((L, H))]
    args = [jnp.asarray(a, F32) for a in args]
    if F == 300:  # bf16 weights and inputs, as the benchmark's predictors
        for i in (0, 1, 3, 5):
            args[i] = args[i].astype(jnp.bfloat16)
    if F == 1001:  # bf16 weights, fp32 inputs (rounded to bf16 by the first product)
        for i in (1, 3, 5):
            args[i] = args[i].astype(jnp.bfloat16)
    select = batch_predictor_select  # the kernel path is one jitted program already
    if impl == "reference":  # one program too, not the jnp reference op by op
        select = jax.jit(select, static_argnames=("k_mlp", "k_heads", "activation", "chunk",
                                                  "impl"))
    for layer in (0, L - 1):
        neurons, heads = select(*args, jnp.int32(layer), k_mlp=k_mlp, k_heads=k_heads,
                                activation=act, chunk=chunk, impl=impl)
        want_n, want_h = _numpy_sets(*args, layer, k_mlp, k_heads, act, chunk)
        assert neurons.shape == (batch_union_shape(B, F, k_mlp, chunk),)
        np.testing.assert_array_equal(np.asarray(neurons), want_n)
        np.testing.assert_array_equal(np.asarray(heads), want_h)


def test_batch_select_rejects_bad_inputs():
    L, R, d, F, H = 2, 8, 16, 32, 6
    good = dict(x_rms=jnp.zeros((2, d)), w1t=jnp.zeros((L, R, d)), b1=jnp.zeros((L, R)),
                w2_mlp=jnp.zeros((L, 4, F)), b2_mlp=jnp.zeros((L, F)),
                w2_heads=jnp.zeros((L, 4, H)), b2_heads=jnp.zeros((L, H)))
    with pytest.raises(ValueError, match="2..64 rows"):
        batch_predictor_select(**{**good, "x_rms": jnp.zeros((1, d))}, layer=0, k_mlp=3,
                               k_heads=2)
    with pytest.raises(ValueError, match="k_mlp"):
        batch_predictor_select(**good, layer=0, k_mlp=F + 1, k_heads=2)
    with pytest.raises(ValueError, match="activation"):
        batch_predictor_select(**good, layer=0, k_mlp=3, k_heads=2, activation="tanh")
    with pytest.raises(ValueError, match="w2_heads"):
        batch_predictor_select(**{**good, "w2_heads": jnp.zeros((L, 5, H))}, layer=0,
                               k_mlp=3, k_heads=2)


def _batch_step_setup(mlp, heads):
    """(config, params, decode-form predictors, union sparse config on the interpreted
    kernels) of the batch step test."""
    import dataclasses

    import dejavu_jax as dj
    from dejavu_jax import sparse
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    config = dj.preset("opt-tiny").replace(n_layers=3)
    params = dj.init_params(config, jax.random.key(3), F32, std=0.1)
    preds = decode_predictors(random_predictors(config, 8, jax.random.key(4)))
    scfg = dataclasses.replace(
        sparse.sparse_config(config, mlp, heads, dense_layers=1, impl="interpret"),
        batch_policy="union")
    return config, params, preds, scfg


_BATCH_IDS = [[5, 9, 14, 3], [7, 7, 2, 11], [1, 30, 6, 8]]
_BATCH_TOKENS = ([42, 3, 8], [7, 7, 50])


def _batch_step_logits(select, config, params, preds, scfg):
    """The logits [steps, 3, V] of 3 rows prefilled with _BATCH_IDS and decoding
    _BATCH_TOKENS, selecting with `select`."""
    from dejavu_jax import sparse
    from conftest import step_logits
    return step_logits(sparse.sparse_engine(config, scfg, select), (params, preds),
                       _BATCH_IDS, _BATCH_TOKENS)


@functools.cache
def _reference_batch_step(mlp, heads):
    """(logits, the batch selection calls traced) of the step selecting through the jnp
    reference (`impl="reference"`). That selector neither rides nor reads its launch
    options (`ride_mlp_launches` and `batch_heads_in_fc1` act only in the kernels' launches,
    `PredictorSelector.rides_batch`): one run per (mlp, heads) serves every variant."""
    from dejavu_jax.sparse_variants import variant_selector
    config, params, preds, scfg = _batch_step_setup(mlp, heads)
    select = variant_selector(config.group_size, "local", impl="reference")
    seen = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        _record_batch_selection(monkeypatch, seen)
        logits = _batch_step_logits(select, config, params, preds, scfg)
    return logits, tuple(seen)


def _record_batch_selection(monkeypatch, seen):
    """Append (what ran, its impl) to `seen` for each batch selection kernel call traced,
    and for the first product riding in the MLP norm's launch."""
    from dejavu_jax import sparse
    from dejavu_jax.kernels import batch_predictor_select as module
    for name in ("batch_predictor_select", "batch_selection_parts_after", "heads_part"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **kw:
                            seen.append((_n, kw.get("impl", "interpret"))) or _r(*a, **kw))
    real_part = sparse.first_product_part
    monkeypatch.setattr(sparse, "first_product_part", lambda *a, **kw:
                        seen.append(("in the norm launch", "interpret")) or real_part(*a, **kw))


@pytest.mark.parametrize("ride,mlp,heads,heads_first", [
    (True, 0.1, 0.5, False), (True, 0.1, 0.25, False), (False, 0.1, 0.5, False),
    (True, 0.2, 0.5, False), (True, 0.1, 0.5, True), (True, 0.1, 0.25, True)])
def test_a_batch_step_selects_in_the_kernels(ride, mlp, heads, heads_first, monkeypatch):
    """A batch decode step with decode-form predictors and the "local" method selects
    through the batch kernels, riding in other launches (the first product in the q/k/v
    projection's, or where the rows' heads project densely, 3 rows at heads 0.5, in the
    MLP norm's; the rest in the sparse MLP's) or in launches of their own (always where
    the union runs the masked dense MLP: 3 rows at 0.2 fill 0.6 of it), the heads' program
    in the fc2 launch or (heads_first, a benchmark variant) in the fc1 launch; the
    interpreted kernels give the logits of the jnp reference's sets."""
    from dejavu_jax.sparse_variants import APART, HEADS_IN_FC1, variant_selector
    from conftest import assert_finite_close
    config, params, preds, scfg = _batch_step_setup(mlp, heads)
    k_mlp = scfg.mlp_k[-1]
    name = "local" + ("" if ride else APART) + (HEADS_IN_FC1 if heads_first else "")
    for impl in ("interpret", "reference"):
        select = variant_selector(config.group_size, name, impl=impl)
        assert select.selects_batch_in_kernels(preds, 3, k_mlp)
        assert not select.selects_batch_in_kernels(preds, 1, k_mlp)
        assert select.rides_batch(preds, 3, k_mlp, scfg.impl) == (ride and impl == "interpret")
    reference, seen = _reference_batch_step(mlp, heads)
    logits, seen = {"reference": reference}, list(seen)
    _record_batch_selection(monkeypatch, seen)
    logits["interpret"] = _batch_step_logits(
        variant_selector(config.group_size, name, impl="interpret"), config, params, preds,
        scfg)
    assert ("batch_predictor_select", "reference") in seen
    riding = ride and mlp < 0.2
    kernel_path = "batch_selection_parts_after" if riding else "batch_predictor_select"
    assert (kernel_path, "interpret") in seen
    assert (("heads_part", "interpret") in seen) == (riding and heads_first)
    in_norm = riding and 3 * scfg.head_k[-1] >= config.n_heads
    assert (("in the norm launch", "interpret") in seen) == in_norm
    assert_finite_close(logits["interpret"], logits["reference"], atol=1e-5, rtol=1e-5)


def test_a_selector_on_the_kernels_does_not_ride_a_reference_step():
    """A selector on the Pallas paths with a step on the jnp references selects in
    launches of its own (the references' MLP has no launches to ride in)."""
    import dejavu_jax as dj
    from dejavu_jax import sparse
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    config = dj.preset("opt-tiny").replace(n_layers=3)
    preds = decode_predictors(random_predictors(config, 8, jax.random.key(4)))
    select = sparse.predictor_selector(config.group_size, method="local", impl="interpret")
    assert not select.rides_batch(preds, 3, 4, "reference")
    assert select.rides_batch(preds, 3, 4, "interpret")
