"""Per-layer quality of predictors on validation tokens, at the top-k inference uses.

Definitions (micro-averaged over tokens):
  recall@k     selected ∩ active / active
  precision@k  selected ∩ active / selected   (selected = k per token)
  recall curve recall@k for every k; recommended k = smallest k reaching a target
  mlp_captured 1 - ||y - y_S|| / ||y||, mean over tokens, where y = Σ_i act_i w_out_t[i]
               is the MLP output without bias and y_S keeps the selected neurons
               (activations recomputed from the recorded MLP input and model weights)
  head_norm_captured  Σ_{i∈S} ||H_i W_O^i|| / Σ_i ||H_i W_O^i||, mean over tokens (the
               head output vectors are not recorded, so this is a share of the norms)
  *_oracle     the same measure for the best possible set of the same size
GQA: heads are scored per query head; `groups_*` select KV groups by the max score of
their query heads, and count an active query head as found when its group is chosen.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import ops

F32 = jnp.float32


def top_k_mask(scores: jax.Array, k: int) -> jax.Array:
    """Boolean [N, n]: each row's k highest scores."""
    idx = jax.lax.top_k(scores, k)[1]
    return jnp.zeros(scores.shape, bool).at[jnp.arange(scores.shape[0])[:, None], idx].set(True)


def expand_groups(mask: jax.Array, group_size: int) -> jax.Array:
    """A per-group mask [N, G] as a per-query-head mask [N, G*group_size]."""
    return jnp.repeat(mask, group_size, axis=-1)


def group_max(scores: jax.Array, group_size: int) -> jax.Array:
    """Max over each group of `group_size` consecutive units: [N, n] -> [N, n/g]."""
    N, n = scores.shape
    return scores.reshape(N, n // group_size, group_size).max(-1)


def hits_at_k(scores: jax.Array, labels: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(hits, positives): Σ selected ∩ active and Σ active over the tokens."""
    sel = top_k_mask(scores, k)
    return jnp.sum(sel & labels), jnp.sum(labels)


def recall_curve(scores: jax.Array, labels: jax.Array, group_size: int = 1) -> jax.Array:
    """recall@k for k = 1..n_units [n_units]; units are groups when group_size > 1."""
    s = group_max(scores, group_size)
    N, n = s.shape
    order = jnp.argsort(-s, axis=-1)
    rank = jnp.zeros_like(order).at[jnp.arange(N)[:, None], order].set(jnp.arange(n))
    head_rank = jnp.repeat(rank, group_size, axis=-1)
    found = jnp.zeros((n,), F32).at[head_rank.reshape(-1)].add(labels.reshape(-1).astype(F32))
    return jnp.cumsum(found) / jnp.maximum(jnp.sum(labels), 1)


def smallest_k(curve: np.ndarray, target: float) -> int:
    """The smallest k (1-based) with curve[k-1] >= target (all units if none)."""
    reached = np.nonzero(np.asarray(curve) >= target - 1e-9)[0]
    return int(reached[0]) + 1 if len(reached) else len(curve)


def mlp_captured(config, lp, mlp_in: jax.Array, scores: jax.Array, k: int):
    """(predicted, oracle) mean 1 - ||y - y_S|| / ||y|| for one layer's MLP.

    lp: that layer's LayerParams slice; mlp_in [N, d] its recorded MLP input.
    """
    y = ops.norm(mlp_in, lp.mlp_norm_scale, lp.mlp_norm_bias, config.norm_eps) \
        if config.pre_norm else mlp_in.astype(F32)
    act = ops.mlp_hidden(config, lp, y)
    w = lp.w_out_t.astype(F32)
    full = act @ w

    def captured(mask):
        err = jnp.linalg.norm(full - (act * mask) @ w, axis=-1)
        return jnp.mean(1.0 - err / jnp.maximum(jnp.linalg.norm(full, axis=-1), 1e-12))

    contribution = jnp.abs(act) * jnp.linalg.norm(w, axis=-1)
    return captured(top_k_mask(scores, k)), captured(top_k_mask(contribution, k))


def head_captured(norms: jax.Array, scores: jax.Array, k: int, group_size: int = 1):
    """(predicted, oracle) mean share of the head-norm sum in the top-k units."""
    norms = norms.astype(F32)
    total = jnp.maximum(norms.sum(-1), 1e-12)
    if group_size == 1:
        pred, best = top_k_mask(scores, k), top_k_mask(norms, k)
    else:
        pred = expand_groups(top_k_mask(group_max(scores, group_size), k), group_size)
        group_norm = norms.reshape(norms.shape[0], -1, group_size).sum(-1)
        best = expand_groups(top_k_mask(group_norm, k), group_size)
    share = lambda m: jnp.mean((norms * m).sum(-1) / total)  # noqa: E731
    return share(pred), share(best)


def layer_arrays(mlp_scores, mlp_labels, head_scores, head_labels, head_norms, *,
                 k_mlp: int, k_heads: int, group_size: int, k_groups: int) -> dict:
    """The raw metric arrays of one layer (jit-compatible; k's and group_size static)."""
    out = {}
    for kind, s, y, k in (("mlp", mlp_scores, mlp_labels, k_mlp),
                          ("heads", head_scores, head_labels, k_heads)):
        hits, pos = hits_at_k(s, y, k)
        out[kind] = {"hits": hits, "positives": pos, "curve": recall_curve(s, y),
                     "correct_at_0": jnp.sum((s > 0) == y), "size": jnp.asarray(y.size)}
    out["heads"]["captured"] = head_captured(head_norms, head_scores, k_heads)
    if group_size > 1:
        out["groups"] = {"curve": recall_curve(head_scores, head_labels, group_size),
                         "captured": head_captured(head_norms, head_scores, k_groups,
                                                   group_size)}
    return out


def layer_report(arrays: dict, *, k_mlp: int, k_heads: int, group_size: int, k_groups: int,
                 n_tokens: int, targets=(0.9, 0.95, 0.99), captured=None) -> dict:
    """JSON-ready metrics of one layer from `layer_arrays`' results.

    captured: optional (predicted, oracle) MLP output capture from `mlp_captured`.
    """
    a = jax.tree.map(np.asarray, arrays)
    out = {}
    for kind, k in (("mlp", k_mlp), ("heads", k_heads)):
        m = a[kind]
        out[kind] = {
            "k": k,
            "recall": float(m["hits"] / max(m["positives"], 1)),
            "precision": float(m["hits"] / (k * n_tokens)),
            "active_fraction": float(m["positives"] / m["size"]),
            "accuracy_at_0": float(m["correct_at_0"] / m["size"]),
            "recommended_k": {f"{t:g}": smallest_k(m["curve"], t) for t in targets},
        }
    if captured is not None:
        out["mlp"]["output_captured"] = float(captured[0])
        out["mlp"]["output_captured_oracle"] = float(captured[1])
    out["heads"]["norm_captured"] = float(a["heads"]["captured"][0])
    out["heads"]["norm_captured_oracle"] = float(a["heads"]["captured"][1])
    if group_size > 1:
        g = a["groups"]
        out["groups"] = {
            "k": k_groups, "group_size": group_size,
            "recall": float(g["curve"][k_groups - 1]),
            "norm_captured": float(g["captured"][0]),
            "norm_captured_oracle": float(g["captured"][1]),
            "recommended_k": {f"{t:g}": smallest_k(g["curve"], t) for t in targets},
        }
    return out
