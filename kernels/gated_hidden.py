"""The hidden units of a gated MLP under input sparsity, finished in one launch.

The gate and up projections of an activation-sparse layer (`threshold_matvec.
threshold_matvecs`) leave fp32 split-k partials ``[n, B, F]`` each. :func:`gated_hidden`
sums both, applies the activation to the gate, adds the up projection's bias and keeps a
unit where ``|act(g)|`` (times the layer's per-neuron gate weight) passes the gate
threshold: ``h = act(g) * (u + b)`` there, 0 elsewhere. XLA would take three launches
(two sums and the product); here each program finishes one block of neurons.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from ._common import activation_fn, cdiv, check_array, is_pow2, next_pow2, resolve_impl
from .launch import LaunchPart, launch
from .threshold_matvec import (_check_layer, _layer_arg, _layer_rows, _threshold_table,
                               _threshold_value)

F32 = jnp.float32


def gated_hidden_reference(gate_parts, up_parts, threshold, *, activation, b_in=None,
                           gate_weight=None, threshold_index=0, layer=None):
    """jnp reference of :func:`gated_hidden`."""
    F = gate_parts.shape[-1]
    g = activation_fn(activation)(jnp.sum(gate_parts.astype(F32), axis=0))
    u = jnp.sum(up_parts.astype(F32), axis=0)
    if b_in is not None:
        u = u + _layer_rows(b_in.reshape(-1), layer, F).astype(F32)
    mag = jnp.abs(g)
    if gate_weight is not None:
        mag = mag * _layer_rows(gate_weight.reshape(-1), layer, F).astype(F32)
    t = _threshold_value(threshold, threshold_index, layer)
    return jnp.where(mag > t, g * u, 0.0)


def unit_refs(rest, t_stride, has_bias: bool, has_weight: bool):
    """(layer, bias ref, gate-weight ref, output ref) from a unit kernel's trailing refs:
    the layer index (stacked weights; else layer 0), then the optional per-unit vectors."""
    it = iter(rest)
    layer = next(it)[0] if t_stride is not None else 0
    b_ref = next(it) if has_bias else None
    w_ref = next(it) if has_weight else None
    return layer, b_ref, w_ref, next(it)


def unit_vector(ref, unit, mask):
    """fp32 values of a per-unit vector at `unit` (None without one)."""
    return None if ref is None else plgpu.load(ref.at[unit], mask=mask, other=0).astype(F32)


def sum_partials(ref, b, cols, cm, n_parts: int, tile_parts: int):
    """Row b's sum over the fp32 split-k partials ``ref [n_parts, B, F]`` at `cols`, in
    tiles of up to `tile_parts` chunks, every load of a tile issued at once (a loop over the
    chunks would wait on one load after another)."""
    kk = jnp.arange(tile_parts, dtype=jnp.int32)
    total = jnp.zeros(cols.shape, F32)
    for first in range(0, n_parts, tile_parts):
        k = first + kk
        m = (k < n_parts)[:, None] & cm[None, :]
        total = total + jnp.sum(plgpu.load(ref.at[k[:, None], b, cols[None, :]], mask=m,
                                           other=0.0), axis=0)
    return total


def _gated_body(pids, g_ref, u_ref, t_ref, *rest, B, F, bn, n_parts, tile_parts, act,
                has_bias, has_weight, t_index, t_stride):
    layer, b_ref, w_ref, o_ref = unit_refs(rest, t_stride, has_bias, has_weight)
    j, = pids
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    cm = cols < F
    unit = layer * F + cols   # stacked: this layer's units among every layer's
    bias, weight = unit_vector(b_ref, unit, cm), unit_vector(w_ref, unit, cm)
    t = t_ref[t_index if t_stride is None else layer * t_stride + t_index]
    for b in range(B):
        g = act(sum_partials(g_ref, b, cols, cm, n_parts, tile_parts))
        u = sum_partials(u_ref, b, cols, cm, n_parts, tile_parts)
        u = u if bias is None else u + bias
        mag = jnp.abs(g) if weight is None else jnp.abs(g) * weight
        plgpu.store(o_ref.at[b, cols], jnp.where(mag > t, g * u, 0.0), mask=cm)


def gated_hidden(gate_parts, up_parts, threshold, *, activation, b_in=None,
                 gate_weight=None, threshold_index=0, layer=None, block_n=64, tile_parts=64,
                 num_warps=4, impl=None):
    """``act(g) * (u + b_in)`` where ``|act(g)|`` (times ``gate_weight``) exceeds the
    threshold, else 0: fp32 ``[B, F]``, with g and u the sums of the gate's and the up
    projection's fp32 partials ``gate_parts``, ``up_parts [n, B, F]``.

    threshold: as in :func:`~.threshold_matvec.threshold_matvec` (flat element
    ``threshold_index``, or with ``layer`` element ``[layer, threshold_index]`` of a table
    ``[L, S]``); b_in, gate_weight: optional ``[F]``, or with ``layer`` every layer's
    ``[L, F]`` (this layer's read in place); activation: as ``kernels.sparse_mlp`` names
    them; block_n (a power of two) neurons per program, which loads up to tile_parts (a
    power of two) chunks of partials at once.
    """
    check_array("gate_parts", gate_parts, ndim=3, floating=True)
    check_array("up_parts", up_parts, ndim=3, floating=True)
    n_parts, B, F = gate_parts.shape
    if up_parts.shape != gate_parts.shape:
        raise ValueError(f"up_parts must be {tuple(gate_parts.shape)} like gate_parts, got "
                         f"{tuple(up_parts.shape)}")
    if not (n_parts and B and F):
        raise ValueError(f"gate_parts {tuple(gate_parts.shape)} holds no units")
    per_layer = {}
    for name, w in (("b_in", b_in), ("gate_weight", gate_weight)):
        if w is None:
            continue
        if w.size % F or (layer is None and w.size != F):
            raise ValueError(f"{name} must hold {F} values per layer, got "
                             f"{tuple(w.shape)}")
        per_layer[name] = w.size // F
    if layer is not None:
        table = jnp.shape(threshold)
        for n in per_layer.values():
            _check_layer(layer, n, table[0] if len(table) == 2 else None)
    if not (is_pow2(block_n) and is_pow2(tile_parts)):
        raise ValueError(f"block_n={block_n} and tile_parts={tile_parts} must be powers of 2")
    activation_fn(activation)   # an unknown name is refused before anything runs
    impl = resolve_impl(impl)
    if impl == "reference":
        return gated_hidden_reference(gate_parts, up_parts, threshold, activation=activation,
                                      b_in=b_in, gate_weight=gate_weight,
                                      threshold_index=threshold_index, layer=layer)
    table, t_stride = _threshold_table(threshold, threshold_index, layer)
    bn = min(block_n, next_pow2(F))
    body = functools.partial(_gated_body, B=B, F=F, bn=bn, n_parts=n_parts,
                             tile_parts=min(tile_parts, next_pow2(n_parts)),
                             act=activation_fn(activation),
                             has_bias=b_in is not None, has_weight=gate_weight is not None,
                             t_index=threshold_index, t_stride=t_stride)
    args = [gate_parts.astype(F32), up_parts.astype(F32), table]
    args += [] if layer is None else [_layer_arg(layer)]
    args += [w.reshape(-1) for w in (b_in, gate_weight) if w is not None]
    part = LaunchPart(body, (cdiv(F, bn),), tuple(args),
                      (jax.ShapeDtypeStruct((B, F), F32),), name="gated_hidden")
    (out,), = launch([part], num_warps=num_warps, interpret=impl == "interpret")
    return out
