"""The predictors' second half and the top-k selection, in two launches (batch 1).

A decode-form predictor (``train.predictor_model.DecodePredictors``) scores a token with
``h = act(x_rms @ w1ᵀ + b1)`` (both kinds' hidden units side by side: ``r_mlp`` then
``r_heads``), then ``h_mlp @ w2_mlp + b2_mlp`` (F neuron scores) and ``h_heads @ w2_heads +
b2_heads`` (H head scores). The hidden units are rounded to the second layer's dtype
before the second product, as the predictors' own forward pass does. The first product is
a plain gathered GEMV; the decode step runs it as one more segment of the attention's
projection launch, whose fp32 partials ``h_parts`` arrive here. :func:`predictor_select` then

1. multiplies the neuron part in a :func:`~.gather_matvec.gather_matvec_t` launch whose
   loader finishes ``h`` (partials, bias, activation): fp32 score partials ``[P, 1, F]``;
2. selects in one launch of ``C + 1`` programs: each of the first C sums its chunk's score
   partials and bias and keeps the chunk's top ``round(k / C)`` (the ``local`` top-k of
   :func:`~.top_k.top_k_indices_local`); the last computes the H head scores from the
   heads' hidden units and keeps their exact top-k (bfloat16-precision keys, ties to the
   lower id, as :func:`~.top_k.top_k_indices`).

Both id vectors come back ascending and exactly sized, so no XLA op runs between the
launches and the kernels that consume them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import activation_fn, check_array, next_pow2, resolve_impl
from .gather_matvec import gather_matvec_t_part
from .launch import LaunchPart, launch
from .top_k import (_ranked_slots, local_top_k_shape, score_keys, top_k_indices_local_reference,
                    top_k_indices_reference)

# the predictors' "gelu" is jax.nn.gelu's default, the tanh approximation
ACTIVATIONS = {"none": "identity", "relu": "relu", "gelu": "gelu_tanh"}


def _hidden(h_parts, b1, layer, activation):
    """act(sum of the first-product partials + b1[layer]) [r_mlp + r_heads] fp32 (row 0)."""
    r = b1.shape[1]
    h = h_parts.astype(jnp.float32).sum(0)[0, :r] + jax.lax.dynamic_index_in_dim(
        b1, layer, keepdims=False).astype(jnp.float32)
    return activation_fn(ACTIVATIONS[activation])(h)


def _rounded(a, dtype):
    """fp32 values rounded to `dtype` (the second layer's, as the predictors' forward pass
    casts its hidden units before the second product), back in fp32."""
    return a.astype(dtype).astype(jnp.float32)


def predictor_select_reference(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer,
                               k_mlp: int, k_heads: int, *, activation="none", chunk=2048):
    """jnp reference of :func:`predictor_select` (same sets)."""
    hi = jax.lax.Precision.HIGHEST
    h = _hidden(h_parts, b1, layer, activation)
    r_mlp = w2_mlp.shape[1]
    pick = lambda t: jax.lax.dynamic_index_in_dim(t, layer, keepdims=False).astype(jnp.float32)
    mlp = jnp.dot(_rounded(h[:r_mlp], w2_mlp.dtype), pick(w2_mlp), precision=hi) + pick(b2_mlp)
    heads = (jnp.dot(_rounded(h[r_mlp:], w2_heads.dtype), pick(w2_heads), precision=hi)
             + pick(b2_heads))
    return (top_k_indices_local_reference(mlp, k_mlp, chunk),
            top_k_indices_reference(heads, k_heads))


def _hidden_loader(act_refs, r, valid, rows, *, nds, r_mlp, r_all, activation, dtype):
    """gather_matvec_t loader: the neuron predictor's hidden units for logical rows r.

    The w2 rows are ``layer * r_mlp + r``, so the layer's b1 row starts at
    ``(rows - r) // r_mlp * r_all``."""
    h_ref, b1_ref = act_refs
    h = plgpu.load(h_ref.at[0, 0, r], mask=valid, other=0.0)
    for s in range(1, nds):
        h = h + plgpu.load(h_ref.at[s, 0, r], mask=valid, other=0.0)
    bias = plgpu.load(b1_ref.at[(rows - r) // r_mlp * r_all + r], mask=valid, other=0.0)
    a = activation_fn(ACTIVATIONS[activation])(h + bias.astype(jnp.float32))
    return jnp.where(valid, _rounded(a, dtype), 0.0)


def _select_body(pids, layer_ref, sp_ref, b2m_ref, h_ref, b1_ref, w2h_ref, b2h_ref, om_ref,
                 oh_ref, *, n_sp, F, c, kc, C, block, nds, r_mlp, r_heads, rhp, H, Hp, k_heads,
                 activation, dtype, offset_ids):
    f32 = jnp.float32
    p = pids[0]
    layer = layer_ref[0]

    @pl.when(p < C)
    def _():
        lane = jnp.arange(block, dtype=jnp.int32)
        ids = p * c + lane
        valid = (lane < c) & (ids < F)
        s = plgpu.load(b2m_ref.at[layer * F + ids], mask=valid, other=0).astype(f32)
        for i in range(n_sp):
            s = s + plgpu.load(sp_ref.at[i, 0, ids], mask=valid, other=0.0)
        slots = _ranked_slots(jnp.where(valid, score_keys(s), -1), kc)
        plgpu.store(om_ref.at[p * kc + slots], ids + layer * F if offset_ids else ids,
                    mask=slots < kc)

    @pl.when(p == C)
    def _():
        j = jnp.arange(rhp, dtype=jnp.int32)
        jm = j < r_heads
        col = r_mlp + j
        h = plgpu.load(h_ref.at[0, 0, col], mask=jm, other=0.0)
        for s in range(1, nds):
            h = h + plgpu.load(h_ref.at[s, 0, col], mask=jm, other=0.0)
        h = h + plgpu.load(b1_ref.at[layer * (r_mlp + r_heads) + col], mask=jm,
                           other=0).astype(f32)
        a = jnp.where(jm, _rounded(activation_fn(ACTIVATIONS[activation])(h), dtype), 0.0)
        hc = jnp.arange(Hp, dtype=jnp.int32)
        hm = hc < H
        w = plgpu.load(w2h_ref.at[(layer * r_heads + j)[:, None], hc[None, :]],
                       mask=jm[:, None] & hm[None, :], other=0).astype(f32)
        scores = jnp.sum(a[:, None] * w, axis=0)
        scores = scores + plgpu.load(b2h_ref.at[layer * H + hc], mask=hm, other=0).astype(f32)
        slots = _ranked_slots(jnp.where(hm, score_keys(scores), -1), k_heads)
        plgpu.store(oh_ref.at[slots], hc + layer * H if offset_ids else hc,
                    mask=slots < k_heads)


def score_part(h_parts, b1, w2_mlp, layer, *, activation: str = "none", row_blocks: int = 2,
               block_d: int = 256, deferred_sum: bool = True) -> LaunchPart:
    """The neuron scores' product (step 1 of :func:`predictor_select`) as a
    :class:`~.launch.LaunchPart`; its output is the fp32 score partials ``[P, 1, F]``."""
    L, r_mlp, F = w2_mlp.shape
    r_all = b1.shape[1]
    loader = functools.partial(_hidden_loader, nds=h_parts.shape[0], r_mlp=r_mlp, r_all=r_all,
                               activation=activation, dtype=w2_mlp.dtype)
    part = gather_matvec_t_part([h_parts, b1.reshape(-1)], loader,
                                w2_mlp.reshape(L * r_mlp, F), _layer_array(layer), B=1,
                                rows_per_id=r_mlp, block_rows=16,
                                block_d=min(block_d, next_pow2(F)),
                                row_blocks_per_program=row_blocks, deferred_sum=deferred_sum)
    return dataclasses.replace(part, name="predictor_scores")


def select_part(score_parts, h_parts, b1, b2_mlp, w2_heads, b2_heads, layer, k_mlp: int,
                k_heads: int, *, activation: str = "none", chunk: int = 2048,
                offset_ids: bool = False) -> LaunchPart:
    """The selection (step 2 of :func:`predictor_select`) as a :class:`~.launch.LaunchPart`
    of ``C + 1`` programs; its outputs are the neuron ids ``[C * kc]`` and head ids
    ``[k_heads]``, with ``offset_ids`` offset by the layer's rows in the stacked weights
    flattened over layers (``layer * F + neuron``, ``layer * H + head``)."""
    L, F = b2_mlp.shape
    r_heads, H = w2_heads.shape[1:]
    r_mlp = b1.shape[1] - r_heads
    C, c, kc = local_top_k_shape(F, k_mlp, chunk)
    block = next_pow2(c)
    body = functools.partial(
        _select_body, n_sp=score_parts.shape[0], F=F, c=c, kc=kc, C=C, block=block,
        nds=h_parts.shape[0], r_mlp=r_mlp, r_heads=r_heads, rhp=max(16, next_pow2(r_heads)),
        H=H, Hp=max(16, next_pow2(H)), k_heads=k_heads, activation=activation,
        dtype=w2_heads.dtype, offset_ids=offset_ids)
    inputs = (_layer_array(layer), score_parts, b2_mlp.reshape(-1), h_parts, b1.reshape(-1),
              w2_heads.reshape(L * r_heads, H), b2_heads.reshape(-1))
    out_shape = (jax.ShapeDtypeStruct((C * kc,), jnp.int32),
                 jax.ShapeDtypeStruct((k_heads,), jnp.int32))
    return LaunchPart(body, (C + 1,), inputs, out_shape, name="predictor_select")


def select_warps_default(F: int, k_mlp: int, chunk: int = 2048) -> int:
    """Warps of a selection launch by its chunk length (8 for chunks of 2048)."""
    return min(16, max(4, next_pow2(local_top_k_shape(F, k_mlp, chunk)[1]) // 256))


def _layer_array(layer) -> jax.Array:
    return jnp.asarray(layer, jnp.int32).reshape(1)


@functools.partial(jax.jit, static_argnames=("k_mlp", "k_heads", "activation", "chunk",
                                             "interpret", "row_blocks", "block_d",
                                             "deferred_sum", "select_warps"))
def _predictor_select_pallas(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, *,
                             k_mlp, k_heads, activation, chunk, interpret, row_blocks=2,
                             block_d=256, deferred_sum=True, select_warps=None):
    score = score_part(h_parts, b1, w2_mlp, layer, activation=activation,
                       row_blocks=row_blocks, block_d=block_d, deferred_sum=deferred_sum)
    (score_parts,), = launch([score], interpret=interpret)
    select = select_part(score_parts, h_parts, b1, b2_mlp, w2_heads, b2_heads, layer, k_mlp,
                         k_heads, activation=activation, chunk=chunk)
    warps = select_warps or select_warps_default(w2_mlp.shape[2], k_mlp, chunk)
    (ids_mlp, ids_heads), = launch([select], num_warps=warps, num_stages=1,
                                   interpret=interpret)
    return ids_mlp, ids_heads


def _validate(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, k_mlp, k_heads, activation):
    check_array("h_parts", h_parts, ndim=3, floating=True)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown predictor activation {activation!r}; known: "
                         f"{tuple(ACTIVATIONS)}")
    check_array("w2_mlp", w2_mlp, ndim=3, floating=True)
    L, r_mlp, F = w2_mlp.shape
    r_heads, H = w2_heads.shape[1:]
    if h_parts.shape[1] != 1 or h_parts.shape[2] < r_mlp + r_heads:
        raise ValueError(f"h_parts must be [P, 1, >= {r_mlp + r_heads}] (one token), got "
                         f"{tuple(h_parts.shape)}")
    check_array("b1", b1, shape=(L, r_mlp + r_heads), floating=True)
    check_array("b2_mlp", b2_mlp, shape=(L, F), floating=True)
    check_array("w2_heads", w2_heads, shape=(L, r_heads, H), floating=True)
    check_array("b2_heads", b2_heads, shape=(L, H), floating=True)
    if not (0 < k_mlp <= F and 0 < k_heads <= H):
        raise ValueError(f"k_mlp={k_mlp} / k_heads={k_heads} must be in 1..{F} / 1..{H}")
    if H > 4096:
        raise ValueError(f"{H} head scores exceed the one-program selection (4096)")


def selection_parts(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, k_mlp: int,
                    k_heads: int, *, activation: str = "none", chunk: int = 2048,
                    offset_ids: bool = False):
    """:func:`predictor_select` as launch parts for other kernels' launches: the score
    product's part, and a function of its output (the score partials) giving the
    selection's part, whose outputs are (neuron ids, head ids), with ``offset_ids`` offset
    by the layer's rows in the flattened stacked weights (:func:`select_part`). Same
    arguments and checks as :func:`predictor_select`; the parts run with their host
    launches' warps."""
    _validate(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, k_mlp, k_heads, activation)
    score = score_part(h_parts, b1, w2_mlp, layer, activation=activation)
    return score, lambda score_parts: select_part(
        score_parts, h_parts, b1, b2_mlp, w2_heads, b2_heads, layer, int(k_mlp),
        int(k_heads), activation=activation, chunk=chunk, offset_ids=offset_ids)


def predictor_select(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, k_mlp: int,
                     k_heads: int, *, activation: str = "none", chunk: int = 2048,
                     impl: str | None = None, row_blocks: int = 2, block_d: int = 256,
                     deferred_sum: bool = True, select_warps: int | None = None):
    """(neuron ids, head ids) of one token from its first-product partials.

    Args:
      h_parts: ``[P, 1, R]`` fp32 partials of ``x_rms @ w1ᵀ`` for one token, ``R >=
        r_mlp + r_heads`` (columns past that are ignored).
      b1: ``[L, r_mlp + r_heads]``; w2_mlp ``[L, r_mlp, F]``, b2_mlp ``[L, F]``,
        w2_heads ``[L, r_heads, H]``, b2_heads ``[L, H]``: the decode-form predictors.
      layer: int32 scalar (may be traced), the predicted layer.
      k_mlp: neurons wanted: the top ``round(k_mlp / C)`` of each of ``C = ceil(F /
        chunk)`` equal chunks (:func:`~.top_k.local_top_k_shape`), ascending; k_mlp = F
        gives every neuron.
      k_heads: heads wanted: the exact top-k, ascending.
      activation: the predictors' hidden activation ("none", "relu" or "gelu").
      row_blocks, block_d: the score product's blocks of 16 hidden rows per program and
        columns per program (Pallas paths; powers of two for block_d); deferred_sum: one
        cross-lane sum per program (see :func:`~.gather_matvec.gather_matvec_t`). The
        defaults were the fastest of 7 variants on an H200 at OPT-30B sizes (rank 256).
      select_warps: warps per program of the selection launch (None: by chunk length).
    """
    _validate(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, k_mlp, k_heads, activation)
    if block_d < 1 or block_d & (block_d - 1) or row_blocks < 1:
        raise ValueError(f"block_d={block_d} must be a power of two and row_blocks="
                         f"{row_blocks} positive")
    impl = resolve_impl(impl)
    if impl == "reference":
        ids = predictor_select_reference(h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads,
                                         layer, int(k_mlp), int(k_heads),
                                         activation=activation, chunk=int(chunk))
    else:
        ids = _predictor_select_pallas(
            h_parts, b1, w2_mlp, b2_mlp, w2_heads, b2_heads, layer, k_mlp=int(k_mlp),
            k_heads=int(k_heads), activation=activation, chunk=int(chunk),
            interpret=impl == "interpret", row_blocks=int(row_blocks),
            block_d=int(block_d), deferred_sum=bool(deferred_sum), select_warps=select_warps)
    if k_mlp == w2_mlp.shape[2]:   # every neuron (the chunks' quotas would miss some)
        ids = (jnp.arange(k_mlp, dtype=jnp.int32), ids[1])
    return ids
