"""Phi-3's LongRoPE: the short factors and attention factor as transformers reads and
applies them up to the original context, checked against numpy and against the linear
RoPE they equal when every factor is the same; positions past the original context, where
transformers switches to the long factors and recomputes the cache, are refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import model, ops
from dejavu_jax.config import from_hf_config

HEAD_DIM = 8
PHI3 = dict(model_type="phi3", vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, original_max_position_embeddings=16,
            rope_theta=10000.0)
SHORT = [1.0, 1.3, 2.5, 7.0]


def phi3(short=SHORT, kind="longrope", **rope):
    return from_hf_config({**PHI3, "rope_scaling": {
        "type": kind, "short_factor": short, "long_factor": [9.0] * (HEAD_DIM // 2), **rope}})


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])   # Phi3Config's older names
def test_longrope_settings_as_transformers_reads_them(kind):
    config = phi3(kind=kind)
    attention, original, *short = config.rope_longrope
    assert short == SHORT and original == 16.0 and config.max_positions == 64
    assert attention == pytest.approx(math.sqrt(1 + math.log(64 / 16) / math.log(16)))
    assert config.rope_yarn is None and config.rope_linear_factor == 1.0
    assert phi3(attention_factor=1.25).rope_longrope[0] == 1.25
    assert phi3(factor=1.0).rope_longrope[0] == 1.0
    no_original = {k: v for k, v in PHI3.items() if k != "original_max_position_embeddings"}
    assert from_hf_config({**no_original, "rope_scaling": {
        "type": "longrope", "short_factor": SHORT}}).rope_longrope[1] == 4096.0


@pytest.mark.parametrize("short, words", [
    (SHORT[:3], "short_factor, a list of 4 numbers"),
    (None, "short_factor, a list of 4 numbers"),
    ([1.0, 0.0, 1.0, 1.0], r"short_factor\[1\] must be positive"),
])
def test_bad_short_factors_are_refused(short, words):
    with pytest.raises(ValueError, match=words):
        phi3(short=short)


def test_other_phi3_rope_types_are_refused():
    with pytest.raises(ValueError, match="Phi-3 rope type 'linear' is not supported"):
        from_hf_config({**PHI3, "rope_scaling": {"type": "linear", "factor": 2.0}})


def test_longrope_tables_against_numpy():
    attention, positions = 1.2, np.array([0, 1, 5, 15])
    cos, sin = ops.rope_tables(jnp.asarray(positions), HEAD_DIM, 1e4,
                               longrope=(attention, 16.0, *SHORT))
    inv = 1.0 / (np.asarray(SHORT) * 1e4 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles = np.concatenate([positions[:, None] * inv] * 2, axis=-1)
    np.testing.assert_allclose(np.asarray(cos), attention * np.cos(angles), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), attention * np.sin(angles), rtol=1e-5, atol=1e-6)


def test_equal_short_factors_give_linear_ropes_logits():
    """Every short factor c and attention factor a: the frequencies of linear RoPE with
    factor c, and q and k each scaled by a, so the attention logits by a^2."""
    config = phi3(short=[2.5] * 4, attention_factor=1.3)
    linear = from_hf_config({**PHI3, "rope_scaling": {"type": "linear", "factor": 2.5},
                             "model_type": "llama"}).replace(
        query_scale=1.3 ** 2 * HEAD_DIM ** -0.5)
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    got = np.asarray(dj.logits(config, params, ids))
    want = np.asarray(dj.logits(linear.replace(name=config.name), params, ids))
    assert np.isfinite(got).all() and np.abs(got).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    plain = np.asarray(dj.logits(from_hf_config({**PHI3}), params, ids))
    assert np.abs(plain - got).max() > 1e-2 * np.abs(got).max()   # the scaling shows


def test_positions_past_the_original_context_are_refused():
    config = phi3()
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.2)
    assert np.isfinite(np.asarray(dj.logits(config, params, jnp.ones((1, 16), jnp.int32)))).all()
    with pytest.raises(ValueError, match="17 tokens exceed the model's 16 positions of its "
                                         "original context"):
        dj.logits(config, params, jnp.ones((1, 17), jnp.int32))
    ids = jnp.ones((1, 16), jnp.int32)
    state = model.init_state(config, 1, 32, jnp.float32)
    _, state = model.prefill(config, params, ids, jnp.ones_like(ids), state)
    with pytest.raises(ValueError, match="LongRoPE"):
        model.decode_step(config, params, state, jnp.asarray([3]))
    with pytest.raises(ValueError, match="exceeds the model's 16 positions of its original"):
        dj.generate_tokens(dj.dense_engine(config), params, [[1, 2, 3]], max_new_tokens=14)
    out = dj.generate_tokens(dj.dense_engine(config), params, [[1, 2, 3]], max_new_tokens=13,
                             stop_ids=[])
    assert len(out.tokens[0]) == 13


def test_the_sparse_step_applies_longrope_as_the_dense_one():
    """Every unit selected, kv_window 4: each sparse step's logits equal the dense model's,
    so the sparse path's rotary tables (the step's and the missing-KV window's) carry the
    short factors and attention factor too."""
    from conftest import assert_finite_close
    from test_sparse import _full_sets, _full_sparse, _run_both
    config = phi3()
    params = dj.init_params(config, jax.random.key(1), jnp.float32, std=0.3)
    scfg = _full_sparse(config, kv_window=4, batch_policy="kernels")
    steps = _run_both(config, params, scfg, _full_sets(config), [[5, 9, 14, 3], [8, 2]], steps=6)
    scale = max(np.abs(d).max() for d, _ in steps)
    for i, (dense_logits, sparse_logits) in enumerate(steps):
        assert_finite_close(sparse_logits, dense_logits, atol=2e-6 * scale, err_msg=f"step {i}")
