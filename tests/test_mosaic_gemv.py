"""The Mosaic GPU GEMVs of the benchmarks: numpy products in the GPU interpreter, and a
lowering for the GPU of every variant kernels.bench times (the lowering runs Mosaic
GPU's layout inference and shared-memory check on the CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.kernels import mosaic_gemv
from dejavu_jax.kernels.bench import MOSAIC_VARIANTS

K, D = 256, 512


@pytest.fixture(scope="module")
def operands():
    w = jax.random.normal(jax.random.key(0), (K, D), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (D,), jnp.float32)
    h = jax.random.normal(jax.random.key(2), (K,), jnp.float32)
    as64 = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    return w, x, h, as64(w), as64(x), as64(h)


@pytest.mark.parametrize("rows_cfg, cols_cfg", [
    (mosaic_gemv.MosaicConfig(), mosaic_gemv.MosaicConfig(tile_out=256)),
    (mosaic_gemv.MosaicConfig(tile_out=64, splits=2, max_steps=2),
     mosaic_gemv.MosaicConfig(tile_out=128, tile_k=128, splits=2, max_steps=2)),
])
def test_gemvs_equal_numpy_in_the_interpreter(operands, rows_cfg, cols_cfg):
    w, x, h, w64, x64, h64 = operands
    rows = np.asarray(mosaic_gemv.rows_gemv(w, x, rows_cfg, interpret=True))
    cols = np.asarray(mosaic_gemv.cols_gemv(h, w, cols_cfg, interpret=True))
    assert rows.shape == (K,) and cols.shape == (D,)
    assert np.isfinite(rows).all() and np.isfinite(cols).all()
    np.testing.assert_allclose(rows, w64 @ x64, rtol=0, atol=1e-4 * np.abs(w64 @ x64).max())
    np.testing.assert_allclose(cols, h64 @ w64, rtol=0, atol=1e-4 * np.abs(h64 @ w64).max())


@pytest.mark.parametrize("variant", range(len(MOSAIC_VARIANTS)))
def test_bench_variants_lower_for_the_gpu_at_opt_30b_shapes(variant):
    rows_cfg, cols_cfg = MOSAIC_VARIANTS[variant]
    d, k = 7168, 2816                  # opt-30b's width; 10% of its neurons, to 128
    w = jax.ShapeDtypeStruct((k, d), jnp.bfloat16)
    for fn, args, cfg in ((mosaic_gemv.rows_gemv, (w, jax.ShapeDtypeStruct((d,), jnp.float32)),
                           rows_cfg),
                          (mosaic_gemv.cols_gemv, (jax.ShapeDtypeStruct((k,), jnp.float32), w),
                           cols_cfg)):
        text = jax.jit(functools.partial(fn, cfg=cfg)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_shapes_that_do_not_divide_into_tiles_are_refused(operands):
    w, x, h, *_ = operands
    with pytest.raises(ValueError, match="does not divide into tiles"):
        mosaic_gemv.rows_gemv(w[:200], x, interpret=True)
    with pytest.raises(ValueError, match="does not divide into tiles"):
        mosaic_gemv.cols_gemv(h, w[:, :384], interpret=True)
    with pytest.raises(ValueError, match="must divide"):
        mosaic_gemv.rows_gemv(w, x, mosaic_gemv.MosaicConfig(splits=3), interpret=True)
