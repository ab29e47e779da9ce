"""LayerNorm / RMSNorm of a few rows in one launch, output in the consumer's dtype.

XLA splits a decode step's LayerNorm of one row into three launches (the mean, the
variance of the centred row, the scaled output with its cast), two per layer for every
norm: about 1.4 µs each on an H200, a few per cent of a sparse step. Here one program per
row holds the row in registers and writes the normed row, cast, in one launch.

The math is `dejavu_jax.ops.norm`'s: fp32, two passes (mean, then the mean square of the
centred row) for LayerNorm, the mean square for RMSNorm.

:func:`add_norm` is the residual step of a pre-norm decode layer in the same single
launch: it sums a sublayer's split-k partial outputs, adds their bias and the residual
row, writes the new residual row and its norm (and, on request, the row over its root
mean square, the sparsity predictors' input). It replaces XLA's reduction, add and the
norm's launches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import check_array, check_bias, next_pow2, resolve_impl

MAX_WIDTH = 1 << 15


def layer_norm_reference(x, scale, bias, eps: float, out_dtype=None):
    """jnp reference: LayerNorm when bias is given, RMSNorm when None; fp32 math."""
    f32 = jnp.float32
    xf = x.astype(f32)
    if bias is None:
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        y = y * scale.astype(f32)
    else:
        xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
        y = y * scale.astype(f32) + bias.astype(f32)
    return y.astype(out_dtype or f32)


def _norm_kernel(x_ref, s_ref, *refs, d: int, block: int, eps: float, has_bias: bool):
    b_ref, o_ref = refs if has_bias else (None, refs[0])
    r = pl.program_id(0)
    cols = jnp.arange(block, dtype=jnp.int32)
    m = cols < d
    x = plgpu.load(x_ref.at[r, cols], mask=m, other=0).astype(jnp.float32)
    scale = plgpu.load(s_ref.at[cols], mask=m, other=0).astype(jnp.float32)
    if has_bias:
        xc = jnp.where(m, x - jnp.sum(x) / d, 0.0)
        y = xc * jax.lax.rsqrt(jnp.sum(xc * xc) / d + eps) * scale
        y = y + plgpu.load(b_ref.at[cols], mask=m, other=0).astype(jnp.float32)
    else:
        y = x * jax.lax.rsqrt(jnp.sum(x * x) / d + eps) * scale
    plgpu.store(o_ref.at[r, cols], y.astype(o_ref.dtype), mask=m)


RMS_EPS = 1e-6  # the predictors' x / rms(x) (`train.predictor_model.rms_normalise`)


def add_norm_reference(x, parts, bias, scale, norm_bias, eps: float, out_dtype=None,
                       rms_dtype=None):
    """jnp reference of :func:`add_norm`."""
    f32 = jnp.float32
    new = x.astype(f32)
    if parts is not None:
        new = new + parts.astype(f32).sum(0)
    if bias is not None:
        new = new + bias.astype(f32)
    outs = (new, layer_norm_reference(new, scale, norm_bias, eps, out_dtype))
    if rms_dtype is None:
        return outs
    rms = new * jax.lax.rsqrt(jnp.mean(new * new, axis=-1, keepdims=True) + RMS_EPS)
    return outs + (rms.astype(rms_dtype),)


def _add_norm_kernel(*refs, d, block, eps, n_parts, has_bias, has_norm_bias, with_rms):
    it = iter(refs)
    x_ref = next(it)
    p_ref = next(it) if n_parts else None
    b_ref = next(it) if has_bias else None
    s_ref = next(it)
    nb_ref = next(it) if has_norm_bias else None
    new_ref, y_ref = next(it), next(it)
    rms_ref = next(it) if with_rms else None
    f32 = jnp.float32
    r = pl.program_id(0)
    cols = jnp.arange(block, dtype=jnp.int32)
    m = cols < d
    x = plgpu.load(x_ref.at[r, cols], mask=m, other=0).astype(f32)
    for i in range(n_parts):
        x = x + plgpu.load(p_ref.at[i, r, cols], mask=m, other=0).astype(f32)
    if has_bias:
        x = x + plgpu.load(b_ref.at[cols], mask=m, other=0).astype(f32)
    plgpu.store(new_ref.at[r, cols], x.astype(new_ref.dtype), mask=m)
    scale = plgpu.load(s_ref.at[cols], mask=m, other=0).astype(f32)
    mean_sq = jnp.sum(x * x) / d
    if has_norm_bias:
        xc = jnp.where(m, x - jnp.sum(x) / d, 0.0)
        y = xc * jax.lax.rsqrt(jnp.sum(xc * xc) / d + eps) * scale
        y = y + plgpu.load(nb_ref.at[cols], mask=m, other=0).astype(f32)
    else:
        y = x * jax.lax.rsqrt(mean_sq + eps) * scale
    plgpu.store(y_ref.at[r, cols], y.astype(y_ref.dtype), mask=m)
    if with_rms:
        rms = x * jax.lax.rsqrt(mean_sq + RMS_EPS)
        plgpu.store(rms_ref.at[r, cols], rms.astype(rms_ref.dtype), mask=m)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "rms_dtype", "impl"))
def _add_norm_jit(x, parts, bias, scale, norm_bias, *, eps, out_dtype, rms_dtype, impl):
    if impl == "reference":
        return add_norm_reference(x, parts, bias, scale, norm_bias, eps, out_dtype, rms_dtype)
    B, d = x.shape
    block = next_pow2(d)
    args = [x] + [t for t in (parts, bias, scale, norm_bias) if t is not None]
    shapes = [jax.ShapeDtypeStruct((B, d), jnp.float32), jax.ShapeDtypeStruct((B, d), out_dtype)]
    if rms_dtype is not None:
        shapes.append(jax.ShapeDtypeStruct((B, d), rms_dtype))
    kernel = functools.partial(
        _add_norm_kernel, d=d, block=block, eps=eps,
        n_parts=0 if parts is None else parts.shape[0], has_bias=bias is not None,
        has_norm_bias=norm_bias is not None, with_rms=rms_dtype is not None)
    return tuple(pl.pallas_call(
        kernel,
        grid=(B,),
        out_shape=tuple(shapes),
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, block // 1024)),
                                             num_stages=1),
        interpret=impl == "interpret",
        name="add_norm",
    )(*args))


def add_norm(x, parts, bias, scale, norm_bias, eps: float, *, out_dtype=None, rms_dtype=None,
             impl: str | None = None):
    """The residual step of a pre-norm layer in one launch.

    ``new = x + sum(parts, axis=0) + bias`` (fp32), and the norm of ``new`` as
    :func:`layer_norm` computes it (LayerNorm when ``norm_bias`` is given, RMSNorm when
    None, times ``scale``).

    Args:
      x: ``[B, d]`` residual rows (any float dtype; the sum is fp32).
      parts: ``[P, B, d]`` partial sums of the sublayer's output (split-k partials), or
        None (then only the norm of ``x + bias``).
      bias: ``[d]`` the sublayer's output bias, or None.
      scale, norm_bias: the norm's ``[d]`` weights (``norm_bias`` None: RMSNorm).
      out_dtype: dtype of the normed rows (default fp32).
      rms_dtype: when given, also return ``new / sqrt(mean(new**2) + 1e-6)`` in it.

    One program per row sums the ``P`` partials, so it suits few of them (112 partials of
    7168 floats took 52.7 µs on an H200, XLA's reduction 2.5 µs). Rows wider than
    ``MAX_WIDTH`` use the jnp reference.
    Returns:
      ``(new fp32 [B, d], normed [B, d])`` (plus the RMS-scaled rows with ``rms_dtype``).
    """
    check_array("x", x, ndim=2, floating=True)
    B, d = x.shape
    if parts is not None:
        check_array("parts", parts, ndim=3, floating=True)
        if parts.shape[1:] != (B, d):
            raise ValueError(f"parts must be [P, {B}, {d}], got {tuple(parts.shape)}")
    check_bias("bias", bias, (d,))
    check_array("scale", scale, shape=(d,), floating=True)
    check_bias("norm_bias", norm_bias, (d,))
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    rms_dtype = None if rms_dtype is None else jnp.dtype(rms_dtype)
    impl = resolve_impl(impl)
    if d > MAX_WIDTH:  # the kernel holds a row in registers; wider rows take the reference
        impl = "reference"
    return _add_norm_jit(x, parts, bias, scale, norm_bias, eps=float(eps), out_dtype=out_dtype,
                         rms_dtype=rms_dtype, impl=impl)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "impl"))
def _norm_jit(x, scale, bias, *, eps, out_dtype, impl):
    if impl == "reference":
        return layer_norm_reference(x, scale, bias, eps, out_dtype)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    block = next_pow2(d)
    args = (rows, scale) + (() if bias is None else (bias,))
    out = pl.pallas_call(
        functools.partial(_norm_kernel, d=d, block=block, eps=eps, has_bias=bias is not None),
        grid=(rows.shape[0],),
        out_shape=jax.ShapeDtypeStruct(rows.shape, out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, block // 1024)),
                                             num_stages=1),
        interpret=impl == "interpret",
        name="layer_norm",
    )(*args)
    return out.reshape(*lead, d)


def layer_norm(x, scale, bias, eps: float, *, out_dtype=None, impl: str | None = None):
    """Normed rows of ``x [..., d]``: LayerNorm (``bias [d]`` given) or RMSNorm (None),
    times ``scale [d]``; fp32 math, the result in ``out_dtype`` (default fp32).

    One Pallas launch with one program per row (on GPU); meant for decode steps, where a
    handful of rows make XLA's three-launch norm a launch-bound cost.
    """
    check_array("x", x, floating=True)
    if x.ndim < 1 or x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"x must be [..., d] with d <= {MAX_WIDTH}, got {tuple(x.shape)}")
    d = x.shape[-1]
    check_array("scale", scale, shape=(d,), floating=True)
    check_bias("bias", bias, (d,))
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    return _norm_jit(x, scale, bias, eps=float(eps), out_dtype=out_dtype,
                     impl=resolve_impl(impl))
