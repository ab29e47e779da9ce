"""A gated MLP's up and down projections for the neurons that pass the gate, in one launch.

Under CATS' gate site (`dejavu_jax.activation_sparsity`) the gate runs first; a neuron
whose gate does not pass reads neither its up row nor its down row. Both are one
contiguous row per neuron (``w_up [F, d]`` row-major, ``w_down_t [F, d]`` input-major),
so one program takes a block of neurons through both: the up rows' dot products, the
hidden value ``h = gate * (up + b_up)``, TEAL's threshold on ``|h|`` (the down site), then
``h @ w_down_t`` over the rows still kept, added atomically into the residual row. The
neuron activations never leave the program, and the step saves the launch and the
round trip through memory between the two projections.

Batch 1 only (the caller decodes a batch through the two-launch path). ``impl`` as in
``kernels._common``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import cdiv, check_array, is_pow2, resolve_impl
from .gather_matvec import accumulate_blocks
from .launch import LaunchPart, launch

F32 = jnp.float32


def gate_masked_mlp_reference(x, gate_kept, w_up, w_down_t, down_threshold, residual, *,
                              b_up=None, b_down=None):
    """jnp reference of :func:`gate_masked_mlp`."""
    up = jnp.dot(x.astype(F32), w_up.astype(F32).T, precision=lax.Precision.HIGHEST)
    if b_up is not None:
        up = up + b_up.astype(F32)
    h = jnp.where(gate_kept != 0, gate_kept.astype(F32) * up, 0.0)
    h = jnp.where(jnp.abs(h) > down_threshold, h, 0.0)
    out = jnp.dot(h, w_down_t.astype(F32), precision=lax.Precision.HIGHEST)
    if b_down is not None:
        out = out + b_down.astype(F32)
    return residual + out


def _loop(step, n: int) -> None:
    """``step(c)`` for ``c < n``: unrolled up to 4, a ``fori_loop`` beyond."""
    if n <= 4:
        for c in range(n):
            step(c)
        return
    lax.fori_loop(0, n, lambda c, carry: (step(c), carry)[1], jnp.int32(0))


def _body(pids, x_ref, g_ref, wu_ref, wd_ref, t_ref, res_ref, *rest, F, d, bk, bd,
          has_b_up, has_b_down):
    b_up_ref = rest[0] if has_b_up else None
    b_down_ref = rest[int(has_b_up)] if has_b_down else None
    o_ref = rest[-1]
    del res_ref  # aliased to o_ref
    (i,) = pids
    r = i * bk + jnp.arange(bk, dtype=jnp.int32)
    valid = r < F
    gate = plgpu.load(g_ref.at[0, r], mask=valid, other=0).astype(F32)
    rows = valid & (gate != 0)
    n_chunks = cdiv(d, bd)

    def up_chunk(c, acc):
        cols = c * bd + jnp.arange(bd, dtype=jnp.int32)
        cm = cols < d
        w = plgpu.load(wu_ref.at[r[:, None], cols[None, :]],
                       mask=rows[:, None] & cm[None, :], other=0)
        xv = plgpu.load(x_ref.at[0, cols], mask=cm, other=0).astype(F32)
        return acc + jnp.sum(w.astype(F32) * xv[None, :], axis=1)

    up = accumulate_blocks(up_chunk, n_chunks, (bk,))
    if has_b_up:
        up = up + plgpu.load(b_up_ref.at[r], mask=valid, other=0).astype(F32)
    h = gate * up
    live = rows & (jnp.abs(h) > t_ref[0])
    h = jnp.where(live, h, 0.0)

    def down_chunk(c):
        cols = c * bd + jnp.arange(bd, dtype=jnp.int32)
        cm = cols < d
        w = plgpu.load(wd_ref.at[r[:, None], cols[None, :]],
                       mask=live[:, None] & cm[None, :], other=0)
        part = jnp.sum(h[:, None] * w.astype(F32), axis=0)
        if has_b_down:
            part = part + plgpu.load(b_down_ref.at[cols], mask=cm & (i == 0),
                                     other=0).astype(F32)
        # Lanes past d add 0 at distinct wrapped columns (bd <= d): the interpreter has
        # neither masked atomics nor sums over repeated addresses.
        plgpu.atomic_add(o_ref, (0, cols % d), jnp.where(cm, part, 0.0))

    any_live = jnp.max(live.astype(jnp.int32)) > 0
    if has_b_down:
        any_live = any_live | (i == 0)
    pl.when(any_live)(lambda: _loop(down_chunk, n_chunks))


def gate_masked_mlp(x, gate_kept, w_up, w_down_t, down_threshold, residual, *, b_up=None,
                    b_down=None, block_rows=32, block_d=256, num_warps=4, impl=None):
    """``residual + h @ w_down_t (+ b_down)`` as fp32 ``[1, d]``, where ``h = gate_kept *
    (x @ w_up.T + b_up)`` kept where ``gate_kept != 0`` and ``|h| > down_threshold``.

    x: ``[1, d]`` (the MLP's input, already masked by any input threshold); gate_kept:
    fp32 ``[1, F]``, the activated gate of the neurons that pass, 0 for the others (their
    up and down rows are never fetched); w_up, w_down_t: ``[F, d]``; residual: fp32
    ``[1, d]``, updated in place when the caller donates it (the programs add into it
    atomically, so the low bits of the fp32 sums vary between runs; zeros give the MLP's
    output alone). block_rows neurons per program, block_d columns per load (powers of two).
    """
    check_array("x", x, ndim=2, floating=True)
    check_array("w_up", w_up, ndim=2, floating=True)
    check_array("w_down_t", w_down_t, ndim=2, floating=True)
    B, d = x.shape
    F = w_up.shape[0]
    if B != 1:
        raise ValueError(f"gate_masked_mlp decodes one row, x has {B}")
    if w_up.shape != (F, d) or w_down_t.shape != (F, d):
        raise ValueError(f"w_up and w_down_t must be [{F}, {d}] for x [1, {d}], got "
                         f"{tuple(w_up.shape)} and {tuple(w_down_t.shape)}")
    if tuple(gate_kept.shape) != (1, F):
        raise ValueError(f"gate_kept must be [1, {F}], got {tuple(gate_kept.shape)}")
    if residual.shape != (1, d) or residual.dtype != F32:
        raise ValueError(f"residual must be fp32 (1, {d}), got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    for name, b, n in (("b_up", b_up, F), ("b_down", b_down, d)):
        if b is not None and tuple(b.shape) != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(b.shape)}")
    if not (is_pow2(block_rows) and is_pow2(block_d)):
        raise ValueError(f"block_rows={block_rows} and block_d={block_d} must be powers of 2")
    impl = resolve_impl(impl)
    if impl == "reference":
        return gate_masked_mlp_reference(x, gate_kept, w_up, w_down_t, down_threshold,
                                         residual, b_up=b_up, b_down=b_down)
    bd = min(block_d, 1 << (d.bit_length() - 1))
    body = functools.partial(_body, F=F, d=d, bk=block_rows, bd=bd,
                             has_b_up=b_up is not None, has_b_down=b_down is not None)
    args = [x, gate_kept.astype(F32), w_up, w_down_t,
            jnp.asarray(down_threshold, F32).reshape(1), residual]
    args += [b for b in (b_up, b_down) if b is not None]
    part = LaunchPart(body, (cdiv(F, block_rows),), tuple(args),
                      (jax.ShapeDtypeStruct((1, d), F32),), {5: 0}, name="gate_masked_mlp")
    (out,), = launch([part], num_warps=num_warps, interpret=impl == "interpret")
    return out
