"""LayerNorm / RMSNorm of a few rows in one launch, output in the consumer's dtype.

XLA splits a decode step's LayerNorm of one row into three launches (the mean, the
variance of the centred row, the scaled output with its cast), two per layer for every
norm: about 1.4 µs each on an H200, a few per cent of a sparse step. Here one program per
row holds the row in registers and writes the normed row, cast, in one launch. On request
the same launch also writes the row over its root mean square, the sparsity predictors'
input, and the normed row into one row of a ring buffer (the missing-KV window's stored
inputs), which spares the step a dynamic-update-slice launch.

The math is `dejavu_jax.ops.norm`'s: fp32, two passes (mean, then the mean square of the
centred row) for LayerNorm, the mean square for RMSNorm.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from ._common import check_array, check_bias, next_pow2, resolve_impl
from .launch import LaunchPart, launch

MAX_WIDTH = 1 << 15
RMS_EPS = 1e-6  # the predictors' x / rms(x) (`train.predictor_model.rms_normalise`)


def layer_norm_reference(x, scale, bias, eps: float, out_dtype=None, rms_dtype=None,
                         ring=None, ring_row=None):
    """jnp reference: LayerNorm when bias is given, RMSNorm when None; fp32 math (with
    rms_dtype, also x / sqrt(mean(x**2) + 1e-6) in it; with ring, also the ring with the
    normed rows written at ring_row)."""
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
    outs = (y,)
    if rms_dtype is not None:
        rms = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + RMS_EPS)
        outs += (rms.astype(rms_dtype),)
    if ring is not None:
        row = jnp.asarray(ring_row, jnp.int32)
        outs += (jax.lax.dynamic_update_slice(ring, y.astype(ring.dtype)[:, None, :],
                                              (jnp.int32(0), row, jnp.int32(0))),)
    return outs[0] if len(outs) == 1 else outs


def _norm_body(pids, x_ref, s_ref, *refs, d: int, block: int, eps: float, has_bias: bool,
               with_rms: bool, with_ring: bool):
    it = iter(refs)
    b_ref = next(it) if has_bias else None
    if with_ring:
        row_ref, _ = next(it), next(it)      # the ring's input is aliased to ring_ref
    o_ref = next(it)
    rms_ref = next(it) if with_rms else None
    ring_ref = next(it) if with_ring else None
    r = pids[0]
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
    y = y.astype(o_ref.dtype)
    plgpu.store(o_ref.at[r, cols], y, mask=m)
    if with_ring:
        plgpu.store(ring_ref.at[r, row_ref[0], cols], y.astype(ring_ref.dtype), mask=m)
    if with_rms:
        rms = x * jax.lax.rsqrt(mean_sq + RMS_EPS)
        plgpu.store(rms_ref.at[r, cols], rms.astype(rms_ref.dtype), mask=m)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "rms_dtype", "impl"))
def _norm_jit(x, scale, bias, ring, ring_row, *, eps, out_dtype, rms_dtype, impl):
    if impl == "reference":
        return layer_norm_reference(x, scale, bias, eps, out_dtype, rms_dtype, ring, ring_row)
    return _norm_pallas(x, scale, bias, ring, ring_row, eps=eps, out_dtype=out_dtype,
                        rms_dtype=rms_dtype, interpret=impl == "interpret")


def _norm_pallas(x, scale, bias, ring, ring_row, *, eps, out_dtype, rms_dtype, interpret,
                 riders=()):
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    block = next_pow2(d)
    args = [rows, scale] + ([] if bias is None else [bias])
    shapes = [jax.ShapeDtypeStruct(rows.shape, out_dtype)]
    if rms_dtype is not None:
        shapes.append(jax.ShapeDtypeStruct(rows.shape, rms_dtype))
    aliases = {}
    if ring is not None:
        args += [jnp.asarray(ring_row, jnp.int32).reshape(1), ring]
        aliases = {len(args) - 1: len(shapes)}
        shapes.append(jax.ShapeDtypeStruct(ring.shape, ring.dtype))
    part = LaunchPart(
        functools.partial(_norm_body, d=d, block=block, eps=eps, has_bias=bias is not None,
                          with_rms=rms_dtype is not None, with_ring=ring is not None),
        (rows.shape[0],), tuple(args), tuple(shapes), aliases, name="layer_norm")
    *rider_outs, outs = launch(list(riders) + [part], num_warps=min(16, max(4, block // 1024)),
                               num_stages=1, interpret=interpret)
    n_rows_out = 1 + (rms_dtype is not None)
    outs = tuple(o.reshape(*lead, d) for o in outs[:n_rows_out]) + tuple(outs[n_rows_out:])
    outs = outs[0] if len(outs) == 1 else outs
    return (outs, rider_outs) if riders else outs


def layer_norm(x, scale, bias, eps: float, *, out_dtype=None, rms_dtype=None,
               ring=None, ring_row=None, impl: str | None = None, riders=()):
    """Normed rows of ``x [..., d]``: LayerNorm (``bias [d]`` given) or RMSNorm (None),
    times ``scale [d]``; fp32 math, the result in ``out_dtype`` (default fp32).

    With ``rms_dtype`` it returns ``(normed, x / sqrt(mean(x**2) + 1e-6))``, the second in
    ``rms_dtype`` (the sparsity predictors' input), from the same launch.

    With ``ring [B, R, d]`` (x then ``[B, d]``) and ``ring_row`` (an int32 scalar in
    ``[0, R)``, may be traced) the launch also writes the normed rows, in ``out_dtype``
    then cast to the ring's dtype, at ``ring[:, ring_row]`` (in place when the ring is
    donated), and the updated ring is the last item returned.

    One Pallas launch with one program per row (on GPU); meant for decode steps, where a
    handful of rows make XLA's three-launch norm a launch-bound cost. Rows wider than
    ``MAX_WIDTH``, which the kernel cannot hold in registers, take the jnp reference.

    ``riders``: other kernels' :class:`~.launch.LaunchPart` s run in the same launch
    (Pallas paths; the call is then not jitted on its own, and rows wider than
    ``MAX_WIDTH`` run them in a launch of their own); returns ``(the result above, the
    riders' outputs: one tuple per part)``.
    """
    check_array("x", x, floating=True)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., d], got {tuple(x.shape)}")
    d = x.shape[-1]
    check_array("scale", scale, shape=(d,), floating=True)
    check_bias("bias", bias, (d,))
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    rms_dtype = None if rms_dtype is None else jnp.dtype(rms_dtype)
    if ring is not None:
        if x.ndim != 2:
            raise ValueError(f"a ring needs x as [B, d], got {tuple(x.shape)}")
        check_array("ring", ring, ndim=3)
        if ring.shape[0] != x.shape[0] or ring.shape[2] != d:
            raise ValueError(f"ring must be [{x.shape[0]}, R, {d}], got {tuple(ring.shape)}")
        if ring_row is None:
            raise ValueError("a ring needs ring_row")
        check_array("ring_row", jnp.asarray(ring_row), shape=())
    impl = resolve_impl(impl)
    riders = list(riders)
    if riders and impl == "reference":
        raise ValueError("launch riders need a Pallas path (impl 'pallas' or 'interpret')")
    if d > MAX_WIDTH:
        if riders:
            return (_norm_jit(x, scale, bias, ring, None if ring is None else ring_row,
                              eps=float(eps), out_dtype=out_dtype, rms_dtype=rms_dtype,
                              impl="reference"),
                    launch(riders, interpret=impl == "interpret"))
        impl = "reference"
    if riders:
        return _norm_pallas(x, scale, bias, ring, None if ring is None else ring_row,
                            eps=float(eps), out_dtype=out_dtype, rms_dtype=rms_dtype,
                            interpret=impl == "interpret", riders=riders)
    return _norm_jit(x, scale, bias, ring, None if ring is None else ring_row, eps=float(eps),
                     out_dtype=out_dtype, rms_dtype=rms_dtype, impl=impl)
