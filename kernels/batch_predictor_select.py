"""A batch's predictor selection in three launches, reading the stacked predictors in place.

At batch B > 1 a decode step needs, per layer, the union of the rows' neuron sets (one set
of MLP rows read for the batch) and each row's own query heads. Scoring through XLA slices
the layer out of the stacked predictors (a copy of every weight it reads) and runs a chain
of small fusions per layer. Here:

1. :func:`~.gather_matvec.gather_matvec` multiplies the rows' normalised inputs by the
   layer's rows of ``w1ᵀ`` (a segment of the stacked ``[L * R, d]`` matrix): fp32
   partials ``[P, B, R]``;
2. :func:`~.gather_matvec.gather_matvec_t` multiplies the rows' hidden units (finished in
   its loader: partials, bias, activation, rounding to the second layer's dtype) by the
   layer's rows of ``w2_mlp``: neuron score partials ``[S, B, F]``;
3. one launch of ``C + 1`` programs selects: each of the first C sums its chunk's score
   partials and bias row by row and writes the union of the rows' local top-k
   (:func:`~.union_select.union_top_k_local`'s set); the last scores the heads of every row
   and writes each row's exact top-k (:func:`~.top_k.top_k_indices`' set per row).

Both outputs come back ascending and exactly sized for the kernels that consume them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import activation_fn, check_array, next_pow2, resolve_impl
from .gather_matvec import Segment, batch_pad, gather_matvec_part, gather_matvec_t_part, mma
from .launch import LaunchPart, launch
from .predictor_select import ACTIVATIONS, _rounded
from .top_k import score_keys, top_k_indices_reference

MAX_HEADS = 1024   # head scores one program selects from
from .union_select import (chunk_lanes, last_chunk_cap, rows_chosen, union_local_shape,
                           union_local_size, union_slots, union_top_k_local_reference)


def batch_scores_reference(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, *,
                           activation="none"):
    """(neuron scores [B, F], head scores [B, H]) fp32 of layer `layer` for inputs
    x_rms [B, d] (x over its RMS, in the predictors' dtype): the products the kernels
    compute, at full fp32 precision."""
    hi = jax.lax.Precision.HIGHEST
    pick = lambda t: jax.lax.dynamic_index_in_dim(t, layer, keepdims=False).astype(jnp.float32)
    x = x_rms.astype(w1t.dtype).astype(jnp.float32)   # the kernels' first product reads it so
    h = jnp.dot(x, pick(w1t).T, precision=hi) + pick(b1)
    h = activation_fn(ACTIVATIONS[activation])(h)
    r_mlp = w2_mlp.shape[1]
    mlp = jnp.dot(_rounded(h[:, :r_mlp], w2_mlp.dtype), pick(w2_mlp), precision=hi)
    heads = jnp.dot(_rounded(h[:, r_mlp:], w2_heads.dtype), pick(w2_heads), precision=hi)
    return mlp + pick(b2_mlp), heads + pick(b2_heads)


def batch_predictor_select_reference(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads,
                                     layer, k_mlp: int, k_heads: int, *, activation="none",
                                     chunk: int = 2048):
    """jnp reference of :func:`batch_predictor_select` (same sets)."""
    mlp, heads = batch_scores_reference(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads,
                                        layer, activation=activation)
    rows = jnp.stack([top_k_indices_reference(h, k_heads) for h in heads])
    return union_top_k_local_reference(mlp, k_mlp, chunk), rows


def _hidden_rows_loader(act_refs, r, valid, rows, *, nds, B, Bp, r_mlp, r_all, activation,
                        dtype):
    """gather_matvec_t loader: the rows' neuron-predictor hidden units for logical rows r
    ([Bp, bk]); the w2 rows are ``layer * r_mlp + r``."""
    h_ref, b1_ref = act_refs
    brow = jnp.arange(Bp, dtype=jnp.int32)
    ok = (brow < B)[:, None] & valid[None, :]
    h = plgpu.load(h_ref.at[0, brow[:, None], r[None, :]], mask=ok, other=0.0)
    for s in range(1, nds):
        h = h + plgpu.load(h_ref.at[s, brow[:, None], r[None, :]], mask=ok, other=0.0)
    bias = plgpu.load(b1_ref.at[(rows - r) // r_mlp * r_all + r], mask=valid, other=0)
    a = activation_fn(ACTIVATIONS[activation])(h + bias.astype(jnp.float32)[None, :])
    return jnp.where(ok, _rounded(a, dtype), 0.0)


def _union_body(p, layer, sp_ref, b2m_ref, om_ref, *, B, n_sp, F, c, kc, cap, cap_last, C,
                block):
    """Chunk program p < C: the union of the rows' local top-k of its chunk, one row at a
    time (:func:`~.union_select.union_slots`)."""
    ids, valid = chunk_lanes(p, c, F, block)
    bias = plgpu.load(b2m_ref.at[layer * F + ids], mask=valid, other=0).astype(jnp.float32)

    def row_scores(b):
        s = bias
        for i in range(n_sp):
            s = s + plgpu.load(sp_ref.at[i, b, ids], mask=valid, other=0.0)
        return s

    slot, cap_p = union_slots(row_scores, p, valid, B=B, kc=kc, cap=cap, cap_last=cap_last,
                              last=C - 1, block=block)
    plgpu.store(om_ref.at[p * cap + slot], ids, mask=slot < cap_p)


def _heads_body(layer, h_ref, b1_ref, w2h_ref, b2h_ref, oh_ref, *, B, nds, r_mlp, r_heads, rhp,
                H, Hp, k_heads, activation, dtype):
    """The heads' program: every row's head scores and its exact top-k heads."""
    f32 = jnp.float32
    brow = jnp.arange(batch_pad(B), dtype=jnp.int32)   # >= 16 rows for the product
    live = brow < B
    j = jnp.arange(rhp, dtype=jnp.int32)
    jm = j < r_heads
    ok = live[:, None] & jm[None, :]
    col = r_mlp + j
    h = plgpu.load(h_ref.at[0, brow[:, None], col[None, :]], mask=ok, other=0.0)
    for s in range(1, nds):
        h = h + plgpu.load(h_ref.at[s, brow[:, None], col[None, :]], mask=ok, other=0.0)
    h = h + plgpu.load(b1_ref.at[layer * (r_mlp + r_heads) + col], mask=jm,
                       other=0).astype(f32)[None, :]
    a = jnp.where(ok, _rounded(activation_fn(ACTIVATIONS[activation])(h), dtype), 0.0)
    hc = jnp.arange(Hp, dtype=jnp.int32)
    hm = hc < H
    w = plgpu.load(w2h_ref.at[(layer * r_heads + j)[:, None], hc[None, :]],
                   mask=jm[:, None] & hm[None, :], other=0)
    scores = mma(a, w) + plgpu.load(b2h_ref.at[layer * H + hc], mask=hm,
                                    other=0).astype(f32)[None, :]
    chosen = rows_chosen(jnp.where(live[:, None] & hm[None, :], score_keys(scores), -1),
                         k_heads)
    slot = jnp.where(chosen, jnp.cumsum(chosen.astype(jnp.int32), axis=1),
                     k_heads + jnp.cumsum(jnp.logical_not(chosen).astype(jnp.int32),
                                          axis=1)) - 1     # distinct lanes, distinct slots
    plgpu.store(oh_ref.at[brow[:, None], slot],
                jnp.broadcast_to(hc[None, :], (brow.shape[0], Hp)),
                mask=live[:, None] & (slot < k_heads))


def _select_body(pids, layer_ref, sp_ref, b2m_ref, h_ref, b1_ref, w2h_ref, b2h_ref, om_ref,
                 oh_ref, *, union, heads):
    p = pids[0]
    layer = layer_ref[0]

    @pl.when(p < union["C"])
    def _():
        _union_body(p, layer, sp_ref, b2m_ref, om_ref, **union)

    @pl.when(p == union["C"])
    def _():
        _heads_body(layer, h_ref, b1_ref, w2h_ref, b2h_ref, oh_ref, **heads)


def _heads_part_body(pids, layer_ref, h_ref, b1_ref, w2h_ref, b2h_ref, oh_ref, *, heads):
    _heads_body(layer_ref[0], h_ref, b1_ref, w2h_ref, b2h_ref, oh_ref, **heads)


def _union_part_body(pids, layer_ref, sp_ref, b2m_ref, heads_in_ref, om_ref, oh_ref, *,
                     union):
    _union_body(pids[0], layer_ref[0], sp_ref, b2m_ref, om_ref, **union)   # heads: aliased


def batch_union_shape(B: int, F: int, k_mlp: int, chunk: int = 2048) -> int:
    """Neuron ids of :func:`batch_predictor_select`'s union
    (:func:`~.union_select.union_local_size`)."""
    return union_local_size(B, F, k_mlp, chunk)


def _layer_array(layer) -> jax.Array:
    return jnp.asarray(layer, jnp.int32).reshape(1)


def first_product_part(segment: Segment) -> LaunchPart:
    """Step 1 as a :class:`~.launch.LaunchPart`: the segment's own inputs ``segment.x``
    times its rows (one layer's rows of the stacked ``w1ᵀ``); its one output is the fp32
    partials ``[P, B, >= R]``. It runs alone (:func:`first_product`) or rides in another
    launch of the step."""
    return gather_matvec_part(segment.x, [segment], block_rows=16,
                              block_d=min(512, next_pow2(segment.x.shape[1])))


def first_product(x_rms, w1t, layer, *, interpret: bool = False) -> jax.Array:
    """Step 1 (its own launch): fp32 partials ``[P, B, >= R]`` of ``x_rms @ w1t[layer]ᵀ``."""
    L, R, d = w1t.shape
    seg = Segment(w1t.reshape(L * R, d), _layer_array(layer), R, x=x_rms.astype(w1t.dtype))
    (h_parts,), = launch([first_product_part(seg)], interpret=interpret)
    return h_parts


def score_part(h_parts, b1, w2_mlp, layer, B: int, *, activation: str = "none"
               ) -> LaunchPart:
    """Step 2 as a :class:`~.launch.LaunchPart`: the rows' neuron score partials
    ``[S, B, F]`` fp32 from the first product's partials."""
    L, r_mlp, F = w2_mlp.shape
    loader = functools.partial(_hidden_rows_loader, nds=h_parts.shape[0], B=B,
                               Bp=batch_pad(B), r_mlp=r_mlp, r_all=b1.shape[1],
                               activation=activation, dtype=w2_mlp.dtype)
    part = gather_matvec_t_part([h_parts, b1.reshape(-1)], loader,
                                w2_mlp.reshape(L * r_mlp, F), _layer_array(layer), B=B,
                                rows_per_id=r_mlp, block_rows=16,
                                block_d=min(256, next_pow2(F)), row_blocks_per_program=4)
    return dataclasses.replace(part, name="batch_predictor_scores")


def _union_settings(B: int, F: int, k_mlp: int, n_sp: int, chunk: int) -> dict:
    """The static settings of the chunk programs (`_union_body`)."""
    C, c, kc, cap = union_local_shape(B, F, k_mlp, chunk)
    return dict(B=B, n_sp=n_sp, F=F, c=c, kc=kc, cap=cap,
                cap_last=last_chunk_cap(B, F, k_mlp, chunk), C=C, block=next_pow2(c))


def _heads_settings(h_parts, b1, w2_heads, k_heads: int, activation: str) -> dict:
    """The static settings of the heads' program (`_heads_body`)."""
    r_heads, H = w2_heads.shape[1:]
    return dict(B=h_parts.shape[1], nds=h_parts.shape[0], r_mlp=b1.shape[1] - r_heads,
                r_heads=r_heads, rhp=max(16, next_pow2(r_heads)), H=H,
                Hp=max(16, next_pow2(H)), k_heads=k_heads, activation=activation,
                dtype=w2_heads.dtype)


def select_part(score_parts, h_parts, b1, b2_mlp, w2_heads, b2_heads, layer, k_mlp: int,
                k_heads: int, *, activation: str = "none", chunk: int = 2048) -> LaunchPart:
    """Step 3 as a :class:`~.launch.LaunchPart` of ``C + 1`` programs; its outputs are the
    union's neuron ids and the rows' head ids ``[B, k_heads]``."""
    L, F = b2_mlp.shape
    r_heads, H = w2_heads.shape[1:]
    B = score_parts.shape[1]
    union = _union_settings(B, F, k_mlp, score_parts.shape[0], chunk)
    body = functools.partial(_select_body, union=union,
                             heads=_heads_settings(h_parts, b1, w2_heads, k_heads, activation))
    inputs = (_layer_array(layer), score_parts, b2_mlp.reshape(-1), h_parts, b1.reshape(-1),
              w2_heads.reshape(L * r_heads, H), b2_heads.reshape(-1))
    out_shape = (jax.ShapeDtypeStruct((union_local_size(B, F, k_mlp, chunk),), jnp.int32),
                 jax.ShapeDtypeStruct((B, k_heads), jnp.int32))
    return LaunchPart(body, (union["C"] + 1,), inputs, out_shape,
                      name="batch_predictor_select")


def heads_part(h_parts, b1, w2_heads, b2_heads, layer, k_heads: int, *,
               activation: str = "none") -> LaunchPart:
    """The heads' program of :func:`select_part` as a part of its own (one program, output
    the rows' head ids ``[B, k_heads]``), to ride in another launch than the union's."""
    L, r_heads, H = w2_heads.shape
    heads = _heads_settings(h_parts, b1, w2_heads, k_heads, activation)
    inputs = (_layer_array(layer), h_parts, b1.reshape(-1), w2_heads.reshape(L * r_heads, H),
              b2_heads.reshape(-1))
    out_shape = (jax.ShapeDtypeStruct((h_parts.shape[1], k_heads), jnp.int32),)
    return LaunchPart(functools.partial(_heads_part_body, heads=heads), (1,), inputs,
                      out_shape, name="batch_predictor_heads")


def union_part(score_parts, b2_mlp, layer, k_mlp: int, head_ids, *,
               chunk: int = 2048) -> LaunchPart:
    """The chunk programs of :func:`select_part` alone (``C`` programs); its outputs are the
    union's neuron ids and ``head_ids`` (from :func:`heads_part`), handed through."""
    L, F = b2_mlp.shape
    B = score_parts.shape[1]
    union = _union_settings(B, F, k_mlp, score_parts.shape[0], chunk)
    inputs = (_layer_array(layer), score_parts, b2_mlp.reshape(-1), head_ids)
    out_shape = (jax.ShapeDtypeStruct((union_local_size(B, F, k_mlp, chunk),), jnp.int32),
                 jax.ShapeDtypeStruct(head_ids.shape, jnp.int32))
    return LaunchPart(functools.partial(_union_part_body, union=union), (union["C"],), inputs,
                      out_shape, aliases={3: 1}, name="batch_predictor_union")


def select_warps_default(B: int, F: int, k_mlp: int, chunk: int = 2048) -> int:
    """Warps of a standalone selection launch: by the keys a chunk program holds (one
    row's at a time)."""
    _, c, _, _ = union_local_shape(B, F, k_mlp, chunk)
    return min(16, max(4, next_pow2(c) // 512))


@functools.partial(jax.jit, static_argnames=("k_mlp", "k_heads", "activation", "chunk",
                                             "interpret"))
def _batch_select_pallas(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, *,
                         k_mlp, k_heads, activation, chunk, interpret):
    B = x_rms.shape[0]
    h_parts = first_product(x_rms, w1t, layer, interpret=interpret)
    (score_parts,), = launch([score_part(h_parts, b1, w2_mlp, layer, B,
                                         activation=activation)], interpret=interpret)
    select = select_part(score_parts, h_parts, b1, b2_mlp, w2_heads, b2_heads, layer, k_mlp,
                         k_heads, activation=activation, chunk=chunk)
    warps = select_warps_default(B, w2_mlp.shape[2], k_mlp, chunk)
    (ids_mlp, ids_heads), = launch([select], num_warps=warps, num_stages=1,
                                   interpret=interpret)
    return ids_mlp, ids_heads


def _validate(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, k_mlp, k_heads,
              activation, chunk):
    check_array("x_rms", x_rms, ndim=2, floating=True)
    check_array("w1t", w1t, ndim=3, floating=True)
    check_array("w2_mlp", w2_mlp, ndim=3, floating=True)
    B, d = x_rms.shape
    L, R, _ = w1t.shape
    r_mlp, F = w2_mlp.shape[1:]
    check_array("w1t", w1t, shape=(L, R, d))
    check_array("b1", b1, shape=(L, R), floating=True)
    check_array("b2_mlp", b2_mlp, shape=(L, F), floating=True)
    check_array("w2_heads", w2_heads, ndim=3, floating=True)
    H = w2_heads.shape[2]
    check_array("w2_heads", w2_heads, shape=(L, R - r_mlp, H))
    check_array("b2_heads", b2_heads, shape=(L, H), floating=True)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown predictor activation {activation!r}; known: "
                         f"{tuple(ACTIVATIONS)}")
    if not 2 <= B <= 64:
        raise ValueError(f"batch_predictor_select takes 2..64 rows, got {B}")
    if not (0 < k_mlp <= F and 0 < k_heads <= H):
        raise ValueError(f"k_mlp={k_mlp} / k_heads={k_heads} must be in 1..{F} / 1..{H}")
    if not 0 < chunk <= 1 << 15:
        raise ValueError(f"chunk={chunk} must be in 1..32768")
    if H > MAX_HEADS:
        raise ValueError(f"{H} head scores exceed the one-program selection ({MAX_HEADS})")


def batch_selection_parts_after(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer,
                                k_mlp: int, k_heads: int, *, activation: str = "none",
                                chunk: int = 2048, heads_first: bool = False):
    """:func:`batch_predictor_select`'s steps 2 and 3 as launch parts for other kernels'
    launches (the sparse MLP's, `kernels.sparse_mlp.Riders`), from the first product's fp32
    partials ``[P, B, >= R]`` (:func:`first_product`, or the same product riding in another
    launch): ``(first parts, then_of)``, the parts of the first launch (the score product)
    and a function of their outputs giving the part of the second launch, whose outputs are
    (union neuron ids, head ids [B, k_heads]). heads_first: the heads' program rides in
    the first launch (:func:`heads_part`) and the second holds the chunk programs alone."""
    B = h_parts.shape[1]
    if not 2 <= B <= 64:
        raise ValueError(f"batch selection takes 2..64 rows, got {B}")
    if h_parts.ndim != 3 or h_parts.shape[2] < b1.shape[1]:
        raise ValueError(f"first product partials {h_parts.shape} must be [P, B, >= "
                         f"{b1.shape[1]}]")
    score = score_part(h_parts, b1, w2_mlp, layer, B, activation=activation)
    if heads_first:
        heads = heads_part(h_parts, b1, w2_heads, b2_heads, layer, int(k_heads),
                           activation=activation)
        return (score, heads), lambda outs: union_part(outs[0][0], b2_mlp, layer, int(k_mlp),
                                                       outs[1][0], chunk=chunk)
    return (score,), lambda outs: select_part(
        outs[0][0], h_parts, b1, b2_mlp, w2_heads, b2_heads, layer, int(k_mlp), int(k_heads),
        activation=activation, chunk=chunk)


def batch_predictor_select(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer,
                           k_mlp: int, k_heads: int, *, activation: str = "none",
                           chunk: int = 2048, impl: str | None = None):
    """(union neuron ids, per-row head ids [B, k_heads]) of a batch from decode-form
    predictors (``train.predictor_model.DecodePredictors``' arrays).

    Args:
      x_rms: ``[B, d]``, 2 <= B <= 64: each row's predictor input over its RMS, in the
        predictors' dtype.
      w1t ``[L, R, d]``, b1 ``[L, R]`` (R = r_mlp + r_heads), w2_mlp ``[L, r_mlp, F]``,
        b2_mlp ``[L, F]``, w2_heads ``[L, r_heads, H]``, b2_heads ``[L, H]``.
      layer: int32 scalar (may be traced), the predicted layer.
      k_mlp: each row's neurons: the top ``round(k_mlp / C)`` of each of C chunks of about
        ``chunk`` scores; the union of the rows' sets, padded per chunk with its
        lowest-index non-members to ``batch_union_shape`` ids, ascending
        (:func:`~.union_select.union_top_k_local`).
      k_heads: each row's exact top-k heads (bfloat16-precision keys, ties to the lower
        id), ascending.
    """
    _validate(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, k_mlp, k_heads, activation,
              chunk)
    impl = resolve_impl(impl)
    if impl == "reference":
        return batch_predictor_select_reference(
            x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, int(k_mlp),
            int(k_heads), activation=activation, chunk=int(chunk))
    return _batch_select_pallas(x_rms, w1t, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer,
                                k_mlp=int(k_mlp), k_heads=int(k_heads), activation=activation,
                                chunk=int(chunk), interpret=impl == "interpret")
