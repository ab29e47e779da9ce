"""The weight-informed change of variables (`channel_weighting`): the dense model is
unchanged, and thresholding the new activations is thresholding |x_i| · ||W[:, i]||
(numpy, on the original model's activations)."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import ops
from dejavu_jax.channel_weighting import apply_weighting, channel_norms, weight_informed
from dejavu_jax.model import logits

HF = Path(__file__).parent / "fixtures" / "hf"


@functools.cache
def _model(name):
    return dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "gemma3", "opt-preln",
                                  "opt-postln-proj"])
def test_dense_logits_unchanged(name, rng):
    config, params = _model(name)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (2, 9)), jnp.int32)
    mask = jnp.ones_like(ids)
    want = np.asarray(logits(config, params, ids, mask))
    got = np.asarray(logits(config, weight_informed(config, params), ids, mask))
    assert_finite_close(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    assert apply_weighting(config, params, "none") is params
    with pytest.raises(ValueError, match="unknown channel weighting"):
        apply_weighting(config, params, "wina")


def _np(a):
    return np.asarray(a, np.float64)


def test_sites_rank_by_weight_norms(rng):
    """Layer 1 of the GQA Llama: each site's new activation is the old one times the norm
    of the weights its channel reads (numpy), up to one positive factor per site."""
    config, params = _model("llama-gqa")
    new = weight_informed(config, params)
    lp, lq = (jax.tree.map(lambda w: w[1], p.layers) for p in (params, new))
    x = rng.standard_normal((3, config.hidden)).astype(np.float32)
    eps = config.norm_eps

    def ratio_is_norm(new_act, old_act, norms):
        r = _np(new_act) / _np(old_act)
        r = r / r.mean()
        n = norms / norms.mean()
        np.testing.assert_allclose(r, np.broadcast_to(n, r.shape), rtol=1e-4)

    # qkv: the attention norm's output, against the q/k/v columns' norms
    y_old = ops.norm(x, lp.attn_norm_scale, None, eps)
    y_new = ops.norm(x, lq.attn_norm_scale, None, eps)
    cols = np.concatenate([_np(w).reshape(-1, config.hidden) for w in (lp.wq, lp.wk, lp.wv)])
    ratio_is_norm(y_new, y_old, np.linalg.norm(cols, axis=0))
    # gate_up: the MLP norm's output, against the gate and up columns' norms
    ym_old = ops.norm(x, lp.mlp_norm_scale, None, eps)
    ym_new = ops.norm(x, lq.mlp_norm_scale, None, eps)
    cols = np.concatenate([_np(lp.w_gate), _np(lp.w_in)])
    ratio_is_norm(ym_new, ym_old, np.linalg.norm(cols, axis=0))
    # down: the neuron activations, against the down rows' norms
    h_old = ops.mlp_hidden(config, lp, ym_old)
    h_new = ops.mlp_hidden(config, lq, ym_new)
    ratio_is_norm(h_new, h_old, np.linalg.norm(_np(lp.w_out_t), axis=1))
    # o: a KV group's value channel, against the RMS over its query heads of the
    # out-projection columns' norms
    G = config.n_heads // config.n_kv_heads
    wo = _np(lp.wo)  # [d, H, hd]
    per_head = np.sum(wo ** 2, axis=0).reshape(config.n_kv_heads, G, -1)
    want = np.sqrt(per_head.mean(axis=1))
    v_old = np.einsum("d,gkd->gk", _np(y_old[0]), _np(lp.wv))
    v_new = np.einsum("d,gkd->gk", _np(y_new[0]), _np(lq.wv))
    ratio_is_norm(v_new, v_old, want)
    n = channel_norms(config, params)
    assert all(np.isfinite(np.asarray(v)).all() for v in n.values() if v is not None)


def test_post_norm_opt_keeps_its_inputs():
    """A post-norm OPT's attention and MLP inputs are the residual stream: no factor can
    go into a norm, so those sites stay as they are."""
    config, params = _model("opt-postln-proj")
    assert not config.pre_norm
    n = channel_norms(config, params)
    assert n["qkv"] is None and n["gate_up"] is None and n["down"] is not None
    new = weight_informed(config, params)
    np.testing.assert_array_equal(np.asarray(new.layers.attn_norm_scale),
                                  np.asarray(params.layers.attn_norm_scale))
