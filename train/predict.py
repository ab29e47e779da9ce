"""Predictor inference: scores and top-k index sets, jit- and scan-friendly.

`layer` is always a traced int32 scalar, so a `lax.scan` over layers can carry it;
`k` and capacities are static. Returned index sets are distinct and sorted ascending.

  params, manifest = load_predictors(folder, config)
  neuron_idx, head_idx = predict(params, layer, x, k_mlp=256, k_heads=4)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dejavu_jax.train.checkpoint import PredictorCheckpointError, load_predictors
from dejavu_jax.train.predictor_model import PredictorParams, layer_slice, predictor_logits

__all__ = ["load_predictors", "PredictorCheckpointError", "predictor_scores", "predict",
           "select_top_k", "default_union_size", "recommended_k"]


def predictor_scores(pred_params: PredictorParams, layer: jax.Array,
                     x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mlp_scores [B, F], head_scores [B, H]) fp32 logits for residual stream x [B, d].

    pred_params: PredictorParams, or their `decode_predictors` form (same scores, fewer
    launches per layer).

    `layer` selects which layer's predictors run (dynamic indexing into the stacks).
    Feed x as the manifest's `inputs` say (lookahead: layer l-1's attention input).
    """
    from dejavu_jax.train.predictor_model import DecodePredictors, decode_logits
    layer = jnp.asarray(layer, jnp.int32)
    if isinstance(pred_params, DecodePredictors):
        return decode_logits(layer_slice(pred_params, layer), x)
    mlp = predictor_logits(layer_slice(pred_params.mlp, layer), x, pred_params.activation)
    heads = predictor_logits(layer_slice(pred_params.heads, layer), x,
                             pred_params.activation)
    return mlp, heads


def default_union_size(n: int, k: int, batch: int) -> int:
    """The static size of a batch's union of its rows' k-unit sets, by default: every
    possible member, min(n, k * batch)."""
    return min(n, k * batch)


def select_top_k(scores: jax.Array, k: int, capacity: int | None = None) -> jax.Array:
    """A static-size set of distinct unit ids [capacity], sorted ascending.

    scores [B, n]. One row: its top-k (capacity defaults to k). Several rows: the union
    of the rows' top-k sets (capacity defaults to min(n, k*B)); union members come
    first, ranked by their best score over the rows, then the best non-members pad the
    set; a union larger than capacity is truncated by score.
    """
    B, n = scores.shape
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in 1..{n}")
    capacity = capacity or default_union_size(n, k, B)
    if not 0 < capacity <= n:
        raise ValueError(f"capacity={capacity} must be in 1..{n}")
    if capacity == n:  # every unit: nothing to rank
        return jnp.arange(n, dtype=jnp.int32)
    if B == 1 and capacity == k:
        return jnp.sort(jax.lax.top_k(scores[0], k)[1]).astype(jnp.int32)
    top = jax.lax.top_k(scores, k)[1].reshape(-1)
    member = jnp.zeros((n,), bool).at[top].set(True)
    best = scores.max(axis=0)
    ids = jnp.arange(n, dtype=jnp.int32)
    _, _, order = jax.lax.sort(((~member).astype(jnp.int32), -best, ids), num_keys=3)
    return jnp.sort(order[:capacity])


@functools.partial(jax.jit, static_argnames=("k_mlp", "k_heads", "union_capacity"))
def predict(pred_params: PredictorParams, layer: jax.Array, x: jax.Array, k_mlp: int,
            k_heads: int, *, union_capacity: int | tuple[int, int] | None = None):
    """(neuron_idx [K] int32, head_idx [Kh] int32) for residual stream x [B, d] or [d].

    Heads are query heads (also for grouped-query models: the KV groups to read follow
    from them, `kernels.query_head_groups`). For B > 1 the sets are the union over rows
    (see `select_top_k`); union_capacity is the neuron set's size, or a pair (neurons,
    heads); by default min(F, k_mlp*B) and min(H, k_heads*B).
    """
    if x.ndim == 1:
        x = x[None]
    mlp, heads = predictor_scores(pred_params, layer, x)
    cap_mlp, cap_heads = (union_capacity if isinstance(union_capacity, tuple)
                          else (union_capacity, None))
    neuron_idx = select_top_k(mlp, k_mlp, cap_mlp)
    head_idx = select_top_k(heads, k_heads, cap_heads)
    return neuron_idx, head_idx


def recommended_k(manifest: dict, target: float = 0.95) -> tuple[list[int], list[int]]:
    """Per-layer (k_mlp, k_heads) reaching validation recall `target` (from the manifest).

    k_heads counts query heads (the unit `predict` selects); a manifest written before
    query-head selection may count KV groups for GQA models (its "heads_unit" says).
    """
    rec = manifest["recommended_k"]
    key = f"{target:g}"
    if key not in rec["mlp"]:
        raise KeyError(f"no recommended k for recall {target}; have {sorted(rec['mlp'])}")
    return rec["mlp"][key], rec["heads"][key]
