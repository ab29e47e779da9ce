"""The gated MLP's hidden-unit finish (`kernels.gated_hidden`) in the Pallas interpreter
against numpy, and fed by the input-sparse GEMVs' own partials."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

from dejavu_jax.kernels.gated_hidden import gated_hidden
from dejavu_jax.kernels.threshold_matvec import threshold_matvecs

ACTIVATIONS = {"silu": lambda g: g / (1 + np.exp(-g)), "relu": lambda g: np.maximum(g, 0),
               "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi)
                                                            * (g + 0.044715 * g ** 3)))}


def _numpy_hidden(gp, up, t, activation, bias=None, weight=None):
    g = ACTIVATIONS[activation](gp.astype(np.float64).sum(0))
    u = up.astype(np.float64).sum(0) + (0 if bias is None else bias)
    mag = np.abs(g) * (1 if weight is None else weight)
    return np.where(mag > t, g * u, 0.0)


@pytest.mark.parametrize("B,n,F,activation,extras", [
    (1, 5, 300, "silu", ()), (3, 2, 130, "gelu_tanh", ("bias",)),
    (2, 7, 257, "relu", ("bias", "weight")), (1, 1, 64, "silu", ("weight",))])
def test_gated_hidden_equals_numpy(rng, B, n, F, activation, extras):
    """Ragged neuron counts, one row and several, partials in one tile of chunks and in
    two, with and without the up projection's bias and the gate weights; the threshold
    keeps about half the units, and every unit it drops is exactly 0."""
    gp = rng.standard_normal((n, B, F)).astype(np.float32)
    up = rng.standard_normal((n, B, F)).astype(np.float32)
    bias = rng.standard_normal(F).astype(np.float32) if "bias" in extras else None
    weight = rng.uniform(0.2, 3, F).astype(np.float32) if "weight" in extras else None
    ref_mag = np.abs(ACTIVATIONS[activation](gp.sum(0))) * (1 if weight is None else weight)
    t = float(np.median(ref_mag))
    want = _numpy_hidden(gp, up, t, activation, bias, weight)
    opt = lambda a: None if a is None else jnp.asarray(a)
    for impl in ("interpret", "reference"):
        got = np.asarray(gated_hidden(jnp.asarray(gp), jnp.asarray(up), jnp.float32(t),
                                      activation=activation, b_in=opt(bias),
                                      gate_weight=opt(weight), block_n=64, tile_parts=4,
                                      impl=impl))
        assert got.shape == (B, F)
        assert_finite_close(got, want, rtol=1e-5, atol=1e-5)
        assert 0.3 < (got != 0).mean() < 0.7
        assert np.all(got[want == 0] == 0)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_gated_hidden_reads_the_traced_layers_table_row_and_weights(rng, impl):
    """With `layer` (traced, as under a scan over layers) the kernel reads that layer's
    threshold from a table [L, S] and that layer's bias and gate weights among every
    layer's; NaN in the other layers' rows changes nothing."""
    L, S, B, n, F = 3, 5, 2, 3, 90
    gp = rng.standard_normal((n, B, F)).astype(np.float32)
    up = rng.standard_normal((n, B, F)).astype(np.float32)
    table = rng.uniform(0.05, 0.6, (L, S)).astype(np.float32)
    bias = rng.standard_normal((L, F)).astype(np.float32)
    weight = rng.uniform(0.2, 3, (L, F)).astype(np.float32)
    fn = jax.jit(lambda layer, b, w: gated_hidden(
        jnp.asarray(gp), jnp.asarray(up), jnp.asarray(table), activation="silu", b_in=b,
        gate_weight=w, threshold_index=3, layer=layer, block_n=32, impl=impl))
    for layer in range(L):
        poisoned = [np.full_like(a, np.nan) for a in (bias, weight)]
        for a, p in zip((bias, weight), poisoned):
            p[layer] = a[layer]
        got = np.asarray(fn(jnp.int32(layer), *map(jnp.asarray, poisoned)))
        assert_finite_close(got, _numpy_hidden(gp, up, table[layer, 3], "silu", bias[layer],
                                               weight[layer]), rtol=1e-5, atol=1e-5)


def test_gated_hidden_of_the_gemvs_partials_is_the_gated_mlps_units(rng):
    """Fed the gate and up projections' unsummed partials of one input-sparse launch, the
    finish gives silu(g) * u of the masked input's products."""
    B, K, F, t_in = 2, 200, 150, 0.5
    x = rng.standard_normal((B, K)).astype(np.float32)
    wg = (rng.standard_normal((K, F)) * 0.1).astype(np.float32)
    wu = (rng.standard_normal((K, F)) * 0.1).astype(np.float32)
    parts = threshold_matvecs(jnp.asarray(x), [jnp.asarray(wg), jnp.asarray(wu)], t_in,
                              block_rows=16, block_n=64, row_blocks=2, partials=True,
                              impl="interpret")
    assert parts[0].shape == parts[1].shape == (7, B, F)   # 200 rows in chunks of 32
    got = np.asarray(gated_hidden(*parts, jnp.float32(0.0), activation="silu",
                                  impl="interpret"))
    xs = np.where(np.abs(x) > t_in, x, 0.0).astype(np.float64)
    g, u = xs @ wg, xs @ wu
    assert_finite_close(got, ACTIVATIONS["silu"](g) * u, rtol=1e-5, atol=1e-5)


def test_gated_hidden_refuses_bad_input():
    """Mismatched partials, a bias of the wrong length, a layer outside the weights, an
    unknown activation and blocks that are not powers of two are ValueErrors."""
    z = jnp.zeros((2, 1, 8), jnp.float32)
    cases = (((z, jnp.zeros((3, 1, 8))), {}, "like gate_parts"),
             ((z, z), dict(b_in=jnp.zeros(7)), "8 values per layer"),
             ((z, z), dict(b_in=jnp.zeros((2, 8)), layer=2,
                           threshold_index=0), "outside the 2 layers"),
             ((z, z), dict(activation="tanh"), "activation must be"),
             ((z, z), dict(block_n=48), "powers of 2"),
             ((z, z), dict(tile_parts=3), "powers of 2"))
    for args, kw, match in cases:
        threshold = jnp.zeros((2, 5)) if "layer" in kw else jnp.float32(0.1)
        kw = dict(dict(activation="silu"), **kw)
        with pytest.raises(ValueError, match=match):
            gated_hidden(*args, threshold, impl="interpret", **kw)
