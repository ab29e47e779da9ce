"""The input-sparse GEMV over a listed set of kept channels (`threshold_matvec_compact`):
equal to the jnp reference in the Pallas interpreter, with and without the residual, and
lowered through the Triton backend for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.kernels.threshold_matvec import (threshold_matvec_compact,
                                                 threshold_matvec_reference)

K, N = 300, 256


@pytest.fixture(scope="module")
def operands():
    x = jax.random.normal(jax.random.key(0), (1, K), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (K, N), jnp.float32) * 0.1).astype(jnp.bfloat16)
    residual = jax.random.normal(jax.random.key(2), (1, N), jnp.float32)
    return x, w, residual


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.97, 1.0])
def test_compact_equals_the_reference(operands, sparsity):
    x, w, residual = operands
    a = np.abs(np.asarray(x, np.float32))
    t = float(np.quantile(a, sparsity)) if sparsity < 1 else float(a.max())
    ref = np.asarray(threshold_matvec_reference(x, w, t))
    got = np.asarray(threshold_matvec_compact(x, w, t, impl="interpret"))
    got_res = np.asarray(threshold_matvec_compact(x, w, t, residual=residual,
                                                  impl="interpret"))
    assert got.shape == (1, N) and np.isfinite(got).all() and np.isfinite(got_res).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_res, np.asarray(residual) + ref, rtol=0, atol=1e-5)
    if sparsity == 1.0:
        assert not got.any()        # no channel above the threshold: nothing is added


def test_compact_lowers_for_the_gpu(monkeypatch):
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
    z = lambda *shape, dtype=jnp.bfloat16: jnp.zeros(shape, dtype)
    for fn, args in ((lambda x, w: threshold_matvec_compact(x, w, 0.1, impl="pallas"),
                      (z(1, 18944), z(18944, 3584))),
                     (lambda x, w, r: threshold_matvec_compact(x, w, 0.1, residual=r,
                                                               impl="pallas"),
                      (z(1, 18944), z(18944, 3584), z(1, 3584, dtype=jnp.float32)))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "gather_matvec_t" in text


def test_compact_takes_one_row(operands):
    x, w, _ = operands
    with pytest.raises(ValueError, match="takes one row"):
        threshold_matvec_compact(jnp.concatenate([x, x]), w, 0.1, impl="interpret")
