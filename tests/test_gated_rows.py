"""The gate site's hidden units in one launch (`kernels.gated_rows`) in the Pallas
interpreter against numpy, and fed by the gate projection's own partials."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

from dejavu_jax.kernels.gated_rows import gated_rows
from dejavu_jax.kernels.threshold_matvec import row_masked_matvec, threshold_matvecs

ACTIVATIONS = {"silu": lambda g: g / (1 + np.exp(-g)), "relu": lambda g: np.maximum(g, 0),
               "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi)
                                                            * (g + 0.044715 * g ** 3)))}


def _numpy_rows(gp, x, w_in, t_in, t_gate, activation, bias=None, weight=None):
    g = ACTIVATIONS[activation](gp.astype(np.float64).sum(0))
    mag = np.abs(g) * (1 if weight is None else weight)
    xs = np.where(np.abs(x) > t_in, x, 0.0).astype(np.float64)
    u = xs @ w_in.astype(np.float64).T + (0 if bias is None else bias)
    return np.where(mag > t_gate, g * u, 0.0)


@pytest.mark.parametrize("B,n,F,d,activation,extras", [
    (1, 5, 300, 200, "silu", ()), (3, 2, 130, 96, "gelu_tanh", ("bias",)),
    (2, 7, 257, 520, "relu", ("bias", "weight")), (1, 1, 64, 64, "silu", ("weight",))])
def test_gated_rows_equals_numpy(rng, B, n, F, d, activation, extras):
    """Ragged neuron counts and widths (one block of input columns and several), one row
    and several, gate partials in one tile of chunks and in two, with and without the up
    bias and the gate weights; the thresholds keep about half the neurons and half the
    input channels, and every neuron they drop is exactly 0."""
    gp = rng.standard_normal((n, B, F)).astype(np.float32)
    x = rng.standard_normal((B, d)).astype(np.float32)
    w_in = (rng.standard_normal((F, d)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(F).astype(np.float32) if "bias" in extras else None
    weight = rng.uniform(0.2, 3, F).astype(np.float32) if "weight" in extras else None
    ref_mag = np.abs(ACTIVATIONS[activation](gp.sum(0))) * (1 if weight is None else weight)
    t_gate, t_in = float(np.median(ref_mag)), float(np.median(np.abs(x)))
    table = np.asarray([0.0, t_in, 0.0, t_gate], np.float32)
    want = _numpy_rows(gp, x, w_in, t_in, t_gate, activation, bias, weight)
    opt = lambda a: None if a is None else jnp.asarray(a)
    for impl in ("interpret", "reference"):
        got = np.asarray(gated_rows(jnp.asarray(gp), jnp.asarray(x), jnp.asarray(w_in),
                                    jnp.asarray(table), activation=activation,
                                    input_index=1, gate_index=3, b_in=opt(bias),
                                    gate_weight=opt(weight), block_rows=16, block_d=128,
                                    tile_parts=4, impl=impl))
        assert got.shape == (B, F)
        assert_finite_close(got, want, rtol=1e-5, atol=1e-5)
        assert 0.3 < (got != 0).mean() < 0.7
        assert np.all(got[want == 0] == 0)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_gated_rows_reads_the_traced_layers_rows_and_thresholds(rng, impl):
    """With `layer` (traced, as under a scan over layers) the kernel reads that layer's two
    thresholds from a table [L, S], and that layer's up rows, bias and gate weights among
    every layer's; NaN in the other layers' rows changes nothing."""
    L, S, B, n, F, d = 3, 5, 2, 3, 90, 70
    gp = rng.standard_normal((n, B, F)).astype(np.float32)
    x = rng.standard_normal((B, d)).astype(np.float32)
    table = rng.uniform(0.05, 0.6, (L, S)).astype(np.float32)
    w_in = (rng.standard_normal((L, F, d)) * 0.1).astype(np.float32)
    bias = rng.standard_normal((L, F)).astype(np.float32)
    weight = rng.uniform(0.2, 3, (L, F)).astype(np.float32)
    fn = jax.jit(lambda layer, w, b, gw: gated_rows(
        jnp.asarray(gp), jnp.asarray(x), w.reshape(L * F, d), jnp.asarray(table),
        activation="silu", input_index=2, gate_index=4, b_in=b, gate_weight=gw, layer=layer,
        block_rows=16, block_d=64, impl=impl))
    for layer in range(L):
        poisoned = [np.full_like(a, np.nan) for a in (w_in, bias, weight)]
        for a, p in zip((w_in, bias, weight), poisoned):
            p[layer] = a[layer]
        got = np.asarray(fn(jnp.int32(layer), *map(jnp.asarray, poisoned)))
        want = _numpy_rows(gp, x, w_in[layer], table[layer, 2], table[layer, 4], "silu",
                           bias[layer], weight[layer])
        assert_finite_close(got, want, rtol=1e-5, atol=1e-5)


def test_gated_rows_equals_the_gate_sites_ops(rng):
    """Fed the gate projection's unsummed partials of an input-sparse launch, the kernel
    gives what the gate site's XLA ops compute: silu of the summed gate, the neurons over
    the gate threshold, their up rows over the thresholded input (`row_masked_matvec`),
    the product."""
    B, d, F, t_in = 2, 200, 150, 0.5
    x = rng.standard_normal((B, d)).astype(np.float32)
    wg = (rng.standard_normal((d, F)) * 0.1).astype(np.float32)
    w_in = (rng.standard_normal((F, d)) * 0.1).astype(np.float32)
    parts, = threshold_matvecs(jnp.asarray(x), [jnp.asarray(wg)], t_in, block_rows=16,
                               block_n=64, row_blocks=2, partials=True, impl="interpret")
    g = jax.nn.silu(jnp.sum(parts, axis=0))
    t_gate = float(jnp.median(jnp.abs(g)))
    table = jnp.asarray([t_in, t_gate], jnp.float32)
    got = np.asarray(gated_rows(parts, jnp.asarray(x), jnp.asarray(w_in), table,
                                activation="silu", input_index=0, gate_index=1,
                                impl="interpret"))
    keep = jnp.abs(g) > t_gate
    xs = jnp.where(jnp.abs(x) > t_in, x, 0.0)
    up = row_masked_matvec(xs, jnp.asarray(w_in), keep, impl="interpret")
    assert 0.3 < float(keep.mean()) < 0.7
    assert_finite_close(got, np.asarray(jnp.where(keep, g * up, 0.0)), rtol=1e-5, atol=1e-5)


def test_gated_rows_refuses_bad_input():
    """Rows that do not match, up weights of the wrong width, a bias of the wrong length, a
    layer outside the weights, a threshold index outside the table, an unknown activation
    and blocks that are not powers of two are ValueErrors."""
    gp, x, w = jnp.zeros((2, 1, 8)), jnp.zeros((1, 6)), jnp.zeros((8, 6))
    cases = ((dict(x=jnp.zeros((2, 6))), "x has 2 rows"),
             (dict(w_in=jnp.zeros((8, 5))), "w_in must be"),
             (dict(b_in=jnp.zeros(7)), "8 values per layer"),
             (dict(w_in=jnp.zeros((16, 6)), layer=2), "outside the 2 layers"),
             (dict(gate_index=9), "outside a threshold"),
             (dict(activation="tanh"), "activation must be"),
             (dict(block_rows=24), "powers of 2"), (dict(tile_parts=3), "powers of 2"))
    for kw, match in cases:
        args = dict(gate_parts=gp, x=x, w_in=w, activation="silu", input_index=0,
                    gate_index=1)
        args.update(kw)
        threshold = jnp.zeros((2, 5)) if "layer" in kw else jnp.zeros(5)
        with pytest.raises(ValueError, match=match):
            gated_rows(threshold=threshold, impl="interpret", **args)
