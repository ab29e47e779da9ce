"""The gate-masked MLP kernel (`kernels.gate_masked_mlp`) in the Pallas interpreter against
numpy: ragged shapes, biases, the loop over column chunks, and rows it must not read."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

from dejavu_jax.kernels.gate_masked_mlp import gate_masked_mlp


def _numpy_mlp(x, gate_kept, w_up, w_down_t, t, residual, b_up, b_down):
    up = x.astype(np.float64) @ w_up.T.astype(np.float64)
    if b_up is not None:
        up = up + b_up
    h = np.where(gate_kept != 0, gate_kept * up, 0.0)
    h = np.where(np.abs(h) > t, h, 0.0)
    out = residual + h @ w_down_t.astype(np.float64)
    return out if b_down is None else out + b_down


@pytest.mark.parametrize("F,d,biases,block_d", [(300, 200, False, 64), (333, 130, True, 32),
                                                 (64, 96, True, 512)])
def test_gate_masked_mlp_equals_numpy(rng, F, d, biases, block_d):
    """About 60% of the neurons fail the gate and a third of the rest the down threshold;
    their weight rows are NaN, so a read of one would show. block_d 32 on d 130 takes the
    kernel's loop over 5 column chunks; 512 is cut to d's power of two below."""
    x = rng.standard_normal((1, d)).astype(np.float32)
    gate = rng.standard_normal((1, F)).astype(np.float32)
    gate_kept = np.where(rng.random((1, F)) < 0.4, gate, 0.0).astype(np.float32)
    w_up = (rng.standard_normal((F, d)) / np.sqrt(d)).astype(np.float32)
    w_down_t = (rng.standard_normal((F, d)) / np.sqrt(F)).astype(np.float32)
    res = rng.standard_normal((1, d)).astype(np.float32)
    b_up = rng.standard_normal(F).astype(np.float32) if biases else None
    b_down = rng.standard_normal(d).astype(np.float32) if biases else None
    h = gate_kept * (x.astype(np.float64) @ w_up.T.astype(np.float64)
                     + (0.0 if b_up is None else b_up))
    live = np.abs(h[gate_kept != 0])
    t = float(np.quantile(live, 0.33))
    want = _numpy_mlp(x, gate_kept, w_up, w_down_t, t, res, b_up, b_down)
    up_poisoned, down_poisoned = w_up.copy(), w_down_t.copy()
    up_poisoned[gate_kept[0] == 0] = np.nan
    down_poisoned[~(np.abs(h[0]) > t)] = np.nan
    assert (gate_kept != 0).sum() > 0.25 * F and (np.abs(h) > t).sum() > 0.2 * F
    opt = lambda b: None if b is None else jnp.asarray(b)  # noqa: E731
    got = gate_masked_mlp(jnp.asarray(x), jnp.asarray(gate_kept), jnp.asarray(up_poisoned),
                          jnp.asarray(down_poisoned), t, jnp.asarray(res), b_up=opt(b_up),
                          b_down=opt(b_down), block_rows=16, block_d=block_d,
                          impl="interpret")
    assert_finite_close(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_gate_masked_mlp_with_no_neuron_kept_returns_the_residual(rng):
    res = rng.standard_normal((1, 40)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((50, 40)), jnp.float32)
    got = gate_masked_mlp(jnp.ones((1, 40)), jnp.zeros((1, 50)), w, w, 0.0, jnp.asarray(res),
                          block_rows=16, block_d=16, impl="interpret")
    np.testing.assert_array_equal(np.asarray(got), res)


def test_gate_masked_mlp_bad_inputs_are_errors():
    x, w, res = jnp.zeros((1, 8)), jnp.zeros((5, 8)), jnp.zeros((1, 8))
    with pytest.raises(ValueError, match="one row"):
        gate_masked_mlp(jnp.zeros((2, 8)), jnp.zeros((1, 5)), w, w, 0.1, res)
    with pytest.raises(ValueError, match="w_up and w_down_t"):
        gate_masked_mlp(x, jnp.zeros((1, 5)), w, jnp.zeros((5, 9)), 0.1, res)
    with pytest.raises(ValueError, match="gate_kept"):
        gate_masked_mlp(x, jnp.zeros((1, 4)), w, w, 0.1, res)
    with pytest.raises(ValueError, match="residual"):
        gate_masked_mlp(x, jnp.zeros((1, 5)), w, w, 0.1, jnp.zeros((1, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="b_up"):
        gate_masked_mlp(x, jnp.zeros((1, 5)), w, w, 0.1, res, b_up=jnp.zeros(4))
