"""LayerNorm / RMSNorm of a few rows in one launch, output in the consumer's dtype.

XLA splits a decode step's LayerNorm of one row into three launches (the mean, the
variance of the centred row, the scaled output with its cast), two per layer for every
norm: about 1.4 µs each on an H200, a few per cent of a sparse step. Here one program per
row holds the row in registers and writes the normed row, cast, in one launch. On request
the same launch also writes the row over its root mean square, the sparsity predictors'
input.

The math is `dejavu_jax.ops.norm`'s: fp32, two passes (mean, then the mean square of the
centred row) for LayerNorm, the mean square for RMSNorm.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import check_array, check_bias, next_pow2, resolve_impl

MAX_WIDTH = 1 << 15
RMS_EPS = 1e-6  # the predictors' x / rms(x) (`train.predictor_model.rms_normalise`)


def layer_norm_reference(x, scale, bias, eps: float, out_dtype=None, rms_dtype=None):
    """jnp reference: LayerNorm when bias is given, RMSNorm when None; fp32 math (with
    rms_dtype, also x / sqrt(mean(x**2) + 1e-6) in it)."""
    f32 = jnp.float32
    xf = x.astype(f32)
    if bias is None:
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        y = y * scale.astype(f32)
    else:
        xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
        y = y * scale.astype(f32) + bias.astype(f32)
    y = y.astype(out_dtype or f32)
    if rms_dtype is None:
        return y
    rms = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + RMS_EPS)
    return y, rms.astype(rms_dtype)


def _norm_kernel(x_ref, s_ref, *refs, d: int, block: int, eps: float, has_bias: bool,
                 with_rms: bool):
    it = iter(refs)
    b_ref = next(it) if has_bias else None
    o_ref = next(it)
    rms_ref = next(it) if with_rms else None
    r = pl.program_id(0)
    cols = jnp.arange(block, dtype=jnp.int32)
    m = cols < d
    x = plgpu.load(x_ref.at[r, cols], mask=m, other=0).astype(jnp.float32)
    scale = plgpu.load(s_ref.at[cols], mask=m, other=0).astype(jnp.float32)
    mean_sq = jnp.sum(x * x) / d
    if has_bias:
        xc = jnp.where(m, x - jnp.sum(x) / d, 0.0)
        y = xc * jax.lax.rsqrt(jnp.sum(xc * xc) / d + eps) * scale
        y = y + plgpu.load(b_ref.at[cols], mask=m, other=0).astype(jnp.float32)
    else:
        y = x * jax.lax.rsqrt(mean_sq + eps) * scale
    plgpu.store(o_ref.at[r, cols], y.astype(o_ref.dtype), mask=m)
    if with_rms:
        rms = x * jax.lax.rsqrt(mean_sq + RMS_EPS)
        plgpu.store(rms_ref.at[r, cols], rms.astype(rms_ref.dtype), mask=m)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "rms_dtype", "impl"))
def _norm_jit(x, scale, bias, *, eps, out_dtype, rms_dtype, impl):
    if impl == "reference":
        return layer_norm_reference(x, scale, bias, eps, out_dtype, rms_dtype)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    block = next_pow2(d)
    args = (rows, scale) + (() if bias is None else (bias,))
    shapes = [jax.ShapeDtypeStruct(rows.shape, out_dtype)]
    if rms_dtype is not None:
        shapes.append(jax.ShapeDtypeStruct(rows.shape, rms_dtype))
    outs = pl.pallas_call(
        functools.partial(_norm_kernel, d=d, block=block, eps=eps, has_bias=bias is not None,
                          with_rms=rms_dtype is not None),
        grid=(rows.shape[0],),
        out_shape=tuple(shapes),
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, block // 1024)),
                                             num_stages=1),
        interpret=impl == "interpret",
        name="layer_norm",
    )(*args)
    outs = tuple(o.reshape(*lead, d) for o in outs)
    return outs[0] if rms_dtype is None else outs


def layer_norm(x, scale, bias, eps: float, *, out_dtype=None, rms_dtype=None,
               impl: str | None = None):
    """Normed rows of ``x [..., d]``: LayerNorm (``bias [d]`` given) or RMSNorm (None),
    times ``scale [d]``; fp32 math, the result in ``out_dtype`` (default fp32).

    With ``rms_dtype`` it returns ``(normed, x / sqrt(mean(x**2) + 1e-6))``, the second in
    ``rms_dtype`` (the sparsity predictors' input), from the same launch.

    One Pallas launch with one program per row (on GPU); meant for decode steps, where a
    handful of rows make XLA's three-launch norm a launch-bound cost. Rows wider than
    ``MAX_WIDTH``, which the kernel cannot hold in registers, take the jnp reference.
    """
    check_array("x", x, floating=True)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., d], got {tuple(x.shape)}")
    d = x.shape[-1]
    check_array("scale", scale, shape=(d,), floating=True)
    check_bias("bias", bias, (d,))
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    rms_dtype = None if rms_dtype is None else jnp.dtype(rms_dtype)
    impl = resolve_impl(impl)
    if d > MAX_WIDTH:
        impl = "reference"
    return _norm_jit(x, scale, bias, eps=float(eps), out_dtype=out_dtype, rms_dtype=rms_dtype,
                     impl=impl)
