"""The hidden units of a gated MLP under the gate site, finished in one launch.

With the gate site (CATS' threshold on ``|act(g)|``) the up projection reads only the rows
of the kept neurons (`threshold_matvec.row_masked_matvec`). :func:`gated_rows` takes the
gate projection's fp32 split-k partials ``[n, B, F]`` and the MLP's input, and in each
program (one block of neurons) sums the gate partials, applies the activation, decides
which neurons pass the gate threshold (``|act(g)|``, times the layer's per-neuron gate
weights), reads the up rows of those neurons over the input channels that pass the input
threshold, and writes ``h = act(g) * (u + b)`` there, 0 elsewhere. XLA would otherwise take
the gate's sum and activation, the masks, the up partials' sum and the product.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from ._common import activation_fn, cdiv, check_array, is_pow2, next_pow2, resolve_impl
from .gated_hidden import sum_partials, unit_refs, unit_vector
from .gather_matvec import accumulate_blocks, batch_pad, mma
from .launch import LaunchPart, launch
from .threshold_matvec import (_check_layer, _layer_arg, _layer_rows, _threshold_table,
                               _threshold_value)

F32 = jnp.float32


def gated_rows_reference(gate_parts, x, w_in, threshold, *, activation, input_index,
                         gate_index, b_in=None, gate_weight=None, layer=None):
    """jnp reference of :func:`gated_rows`."""
    F = gate_parts.shape[-1]
    g = activation_fn(activation)(jnp.sum(gate_parts.astype(F32), axis=0))
    mag = jnp.abs(g)
    if gate_weight is not None:
        mag = mag * _layer_rows(gate_weight.reshape(-1), layer, F).astype(F32)
    keep = mag > _threshold_value(threshold, gate_index, layer)
    x = x.astype(F32)
    xs = jnp.where(jnp.abs(x) > _threshold_value(threshold, input_index, layer), x, 0.0)
    u = jnp.dot(xs, _layer_rows(w_in, layer, F).astype(F32).T,
                precision=jax.lax.Precision.HIGHEST)
    if b_in is not None:
        u = u + _layer_rows(b_in.reshape(-1), layer, F).astype(F32)
    return jnp.where(keep, g * u, 0.0)


def _gated_rows_body(pids, g_ref, x_ref, t_ref, w_ref, *rest, B, Bp, F, d, bk, bd, chunks,
                     n_parts, tile_parts, act, has_bias, has_weight, t_in, t_gate, t_stride):
    layer, b_ref, gw_ref, o_ref = unit_refs(rest, t_stride, has_bias, has_weight)
    i, = pids
    r = i * bk + jnp.arange(bk, dtype=jnp.int32)
    valid = r < F
    unit = layer * F + r   # stacked: this layer's neurons among every layer's
    base = 0 if t_stride is None else layer * t_stride
    t_input, t_units = t_ref[base + t_in], t_ref[base + t_gate]
    weight = unit_vector(gw_ref, unit, valid)
    brow = jnp.arange(Bp, dtype=jnp.int32)
    bmask = brow < B
    g = jnp.zeros((Bp, bk), F32)
    for b in range(B):
        gb = sum_partials(g_ref, b, r, valid, n_parts, tile_parts)
        g = g + jnp.where(brow[:, None] == b, gb[None, :], 0.0)
    g = act(g)
    mag = jnp.abs(g) if weight is None else jnp.abs(g) * weight[None, :]
    keep = (mag > t_units) & bmask[:, None] & valid[None, :]
    rows = jnp.max(keep.astype(jnp.int32), axis=0) > 0   # read where any batch row keeps

    def chunk(c, acc):
        cols = c * bd + jnp.arange(bd, dtype=jnp.int32)
        cm = cols < d
        w = plgpu.load(w_ref.at[unit[:, None], cols[None, :]],
                       mask=rows[:, None] & cm[None, :], other=0)
        xb = plgpu.load(x_ref.at[brow[:, None], cols[None, :]],
                        mask=bmask[:, None] & cm[None, :], other=0).astype(F32)
        xb = jnp.where(jnp.abs(xb) > t_input, xb, 0.0)
        if Bp == 1:
            return acc + jnp.sum(w.astype(F32) * xb, axis=1)[None, :]
        return acc + mma(xb, w, trans_b=True)

    u = accumulate_blocks(chunk, chunks, (Bp, bk))
    if has_bias:
        u = u + unit_vector(b_ref, unit, valid)[None, :]
    plgpu.store(o_ref.at[brow[:, None], r[None, :]], jnp.where(keep, g * u, 0.0),
                mask=bmask[:, None] & valid[None, :])


def gated_rows(gate_parts, x, w_in, threshold, *, activation, input_index, gate_index,
               b_in=None, gate_weight=None, layer=None, block_rows=16, block_d=512,
               tile_parts=64, num_warps=4, impl=None):
    """``act(g) * (W_in[i] . x_s + b_in[i])`` for the neurons ``i`` whose ``|act(g_i)|``
    (times ``gate_weight``) exceeds the gate threshold, else 0: fp32 ``[B, F]``, with g the
    sum of the gate projection's fp32 partials ``gate_parts [n, B, F]`` and x_s the input
    ``x [B, d]`` with the channels of magnitude at most the input threshold set to 0. Only
    the rows of ``w_in [F, d]`` that some batch row keeps are read.

    threshold: as in :func:`~.threshold_matvec.threshold_matvec`, read at two elements:
    ``input_index`` (the input channels) and ``gate_index`` (the neurons); with ``layer``
    (an int32 scalar, may be traced) a table ``[L, S]`` read at ``[layer, index]``, and
    w_in, b_in, gate_weight hold every layer's rows (this layer's read in place).
    activation: as ``kernels.sparse_mlp`` names them; block_rows neurons per program,
    block_d input columns per load, tile_parts chunks of gate partials per load (powers of
    two).
    """
    check_array("gate_parts", gate_parts, ndim=3, floating=True)
    check_array("x", x, ndim=2, floating=True)
    check_array("w_in", w_in, ndim=2, floating=True)
    n_parts, B, F = gate_parts.shape
    d = x.shape[1]
    if not (n_parts and B and F and d):
        raise ValueError(f"gate_parts {tuple(gate_parts.shape)} and x {tuple(x.shape)} "
                         f"must not be empty")
    if x.shape[0] != B:
        raise ValueError(f"x has {x.shape[0]} rows, gate_parts {B}")
    if w_in.shape[1] != d or w_in.shape[0] % F or (layer is None and w_in.shape[0] != F):
        raise ValueError(f"w_in must be [{F}, {d}] (with a layer, every layer's rows "
                         f"[L * {F}, {d}]), got {tuple(w_in.shape)}")
    for name, w in (("b_in", b_in), ("gate_weight", gate_weight)):
        if w is not None and w.size != w_in.shape[0]:
            raise ValueError(f"{name} must hold {F} values per layer like w_in, got "
                             f"{tuple(w.shape)}")
    if layer is not None:
        table = jnp.shape(threshold)
        _check_layer(layer, w_in.shape[0] // F, table[0] if len(table) == 2 else None)
    if not (is_pow2(block_rows) and is_pow2(block_d) and is_pow2(tile_parts)):
        raise ValueError(f"block_rows={block_rows}, block_d={block_d} and "
                         f"tile_parts={tile_parts} must be powers of 2")
    activation_fn(activation)   # an unknown name is refused before anything runs
    table, t_stride = _threshold_table(threshold, input_index, layer)
    _threshold_table(threshold, gate_index, layer)
    impl = resolve_impl(impl)
    if impl == "reference":
        return gated_rows_reference(gate_parts, x, w_in, threshold, activation=activation,
                                    input_index=input_index, gate_index=gate_index,
                                    b_in=b_in, gate_weight=gate_weight, layer=layer)
    Bp = batch_pad(B)
    bk = min(block_rows if Bp == 1 else max(16, block_rows), max(16, next_pow2(F)))
    bd = min(block_d, max(16, next_pow2(d)))
    body = functools.partial(_gated_rows_body, B=B, Bp=Bp, F=F, d=d, bk=bk, bd=bd,
                             chunks=cdiv(d, bd), n_parts=n_parts,
                             tile_parts=min(tile_parts, next_pow2(n_parts)),
                             act=activation_fn(activation), has_bias=b_in is not None,
                             has_weight=gate_weight is not None, t_in=input_index,
                             t_gate=gate_index, t_stride=t_stride)
    args = [gate_parts.astype(F32), x, table, w_in]
    args += [] if layer is None else [_layer_arg(layer)]
    args += [w.reshape(-1) for w in (b_in, gate_weight) if w is not None]
    part = LaunchPart(body, (cdiv(F, bk),), tuple(args),
                      (jax.ShapeDtypeStruct((B, F), F32),), name="gated_rows")
    (out,), = launch([part], num_warps=num_warps, interpret=impl == "interpret")
    return out
