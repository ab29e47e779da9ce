"""Parallel teacher-forced scoring that reproduces the sparse decode step, per position.

The token-by-token sparse engine (`dejavu_jax.sparse`) prefills a prompt densely and
then decodes one token at a time. Scoring a text that way costs one jitted step per
token; this module computes the same logits for a whole window [B, T] in one pass.

For row b, positions t < dense_prefix[b] (the prompt the engine would prefill) run dense.
For t >= dense_prefix[b], every layer l >= scfg.dense_layers applies its own per-position
index sets, exactly as the decode step picks them at batch 1:
  * predictors: layer l's sets are predicted from the attention input (pre-norm residual)
    of layer l-1 at the same position (lookahead; layer 0 reads its own input), which is
    what `sparse.sparse_layers` carries from layer to layer, also across segments;
  * oracle: the top-k of the layer's own |MLP activation| and of its KV groups' head
    output norms (`group_scores` of ||H_i W_O^i||).
The MLP keeps only the selected neurons: masking the dense activations equals the
gathered sparse MLP. Attention: the decode path recomputes missing KV from each token's
stored layer input, so a selected head attends over the K/V of every earlier position
computed from that position's own (sparse-residual) layer input, which is what one dense
attention pass over the sparse residual stream gives; unselected heads contribute zero.
`tests/test_eval.py` checks logits and index sets against the decode engine.

Rows are independent (one batch-1 decode each); right padding is harmless because
attention is causal.

Tensor parallel (`shards` = tp > 1): the tensor-parallel decode engine
(`dejavu_jax.tp_decode`) lets every device pick the top ceil(k / tp) of its own neurons and
KV groups (devices hold equal contiguous blocks of units). With `shards` the scorer applies
that same rule: the scores of each layer split into `shards` equal blocks, each keeping its
own top ceil(k / tp). The rule is a function of the global scores, so it gives the same sets
on one device or under GSPMD with sharded weights (`--devices N` in the CLIs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dejavu_jax import ops
from dejavu_jax.config import ModelConfig
from dejavu_jax.model import embed, head_output_norms, positions_from_mask, unembed
from dejavu_jax.params import ModelParams
from dejavu_jax.sharding import check_tp
from dejavu_jax.sparse import SparseConfig, sparse_config

F32 = jnp.float32
MODES = ("dense", "sparse", "oracle")


@dataclasses.dataclass(frozen=True)
class EvalMode:
    """What to score with: `name` in MODES; `scfg` is None for dense."""

    name: str
    scfg: SparseConfig | None = None
    shards: int = 1  # top-k per block of units, as tp devices select (see module doc)

    def describe(self, config: ModelConfig) -> dict:
        """A JSON-friendly summary (mean densities over all layers, sparse settings)."""
        if self.scfg is None:
            return {"mode": "dense", "mlp_density": 1.0, "head_density": 1.0}
        dens = self.scfg.density(config)
        out = {"mode": self.name,
               "mlp_density": sum(dens["mlp"]) / config.n_layers,
               "head_density": sum(dens["heads"]) / config.n_layers,
               "dense_layers": self.scfg.dense_layers,
               "mlp_k": list(self.scfg.mlp_k), "head_k": list(self.scfg.head_k)}
        if self.shards > 1:  # each of `shards` blocks keeps ceil(k / shards) of its units
            out["selection_shards"] = self.shards
            out["mlp_k_per_shard"] = [local_k(k, self.shards) for k in self.scfg.mlp_k]
            out["head_k_per_shard"] = [local_k(k, self.shards) for k in self.scfg.head_k]
        return out


def make_mode(config: ModelConfig, name: str, mlp_density=1.0, head_density=1.0,
              dense_layers: int = 2, shards: int = 1) -> EvalMode:
    """An EvalMode; densities are as for `sparse.sparse_config` (float or per layer).

    shards > 1 (sparse and oracle): select per block of units as `shards` tensor-parallel
    devices do; raises sharding.ShardingError when the heads or neurons do not divide.
    """
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; known: {MODES}")
    if name == "dense":
        return EvalMode("dense")
    if shards > 1:
        check_tp(config, shards)
    return EvalMode(name, sparse_config(config, mlp_density, head_density, dense_layers,
                                        oracle=name == "oracle"), shards)


def local_k(k: int, shards: int) -> int:
    """Units each of `shards` blocks keeps for a global budget k: ceil(k / shards), as
    `tp_decode.local_k`."""
    return -(-k // shards)


def top_k_mask(scores: jax.Array, k: int, shards: int = 1) -> jax.Array:
    """Boolean [..., n]: the top-k of each row (lax.top_k, the decode path's tie order).

    shards > 1: the row splits into `shards` equal contiguous blocks and each block keeps
    its own top-k (k is then the per-block count), the tensor-parallel decode's rule.
    """
    n = scores.shape[-1]
    if shards == 1:
        flat = scores.reshape(-1, n)
        idx = jax.lax.top_k(flat, k)[1]
        rows = jnp.arange(flat.shape[0])[:, None]
        return jnp.zeros(flat.shape, bool).at[rows, idx].set(True).reshape(scores.shape)
    if n % shards:
        raise ValueError(f"{n} units do not split into {shards} equal blocks")

    def one_row(row):  # [m] -> [m] bool
        return jnp.zeros(row.shape, bool).at[jax.lax.top_k(row, k)[1]].set(True)

    # no reshape that merges leading axes: a block axis split over devices stays split
    blocks = scores.reshape(*scores.shape[:-1], shards, n // shards)
    return jnp.vectorize(one_row, signature="(m)->(m)")(blocks).reshape(scores.shape)


def _group_scores(config: ModelConfig, head_scores: jax.Array) -> jax.Array:
    """Per-KV-group scores [..., Hk] from per-query-head scores [..., H] (max over group)."""
    g = config.group_size
    return head_scores.reshape(*head_scores.shape[:-1], config.n_kv_heads, g).max(axis=-1)


def _attention(config, lp, y, positions, mask):
    """Causal attention over the window: (per-head outputs [B,T,H,hd])."""
    B, T, _ = y.shape
    q, k, v = ops.project_qkv(config, lp, y, positions)
    q = q.reshape(B, T, config.n_kv_heads, config.group_size, config.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
    allowed = jnp.tril(jnp.ones((T, T), bool))[None, None, None] \
        & mask[:, None, None, None, :].astype(bool)
    weights = ops.attention_weights(scores, allowed)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(B, T, config.n_heads, -1)


def _layer(config, lp, x, src, positions, mask, active, sel, shards=1):
    """One block. sel: None (dense) or (kind, layer, pred_params, k_mlp, k_heads), with k
    per block of units when shards > 1 (see `top_k_mask`).

    `active` [B, T] marks positions that run sparse; `src` is the lookahead input.
    Returns (x_out, (neuron_mask [B,T,F], group_mask [B,T,Hk])).
    """
    B, T, _ = x.shape
    n_mask = jnp.ones((B, T, config.ffn), bool)
    g_mask = jnp.ones((B, T, config.n_kv_heads), bool)
    pred = None
    if sel is not None and sel[0] == "sparse":
        from dejavu_jax.train.predict import predictor_scores
        _, layer, pred_params, k_mlp, k_heads = sel
        mlp_s, head_s = predictor_scores(pred_params, layer, src.reshape(B * T, -1))
        pred = (mlp_s.reshape(B, T, -1), _group_scores(config, head_s.reshape(B, T, -1)))

    def attn(y):
        nonlocal g_mask
        heads = _attention(config, lp, y, positions, mask)
        if sel is not None and sel[4] < config.n_kv_heads // shards:
            scores = (pred[1] if pred is not None
                      else _group_scores(config, head_output_norms(lp, heads)))
            g_mask = top_k_mask(scores, sel[4], shards) | ~active[..., None]
            heads = heads * jnp.repeat(g_mask, config.group_size, axis=-1)[..., None]
        return ops.out_project(lp, heads)

    def mlp(y):
        nonlocal n_mask
        hidden = ops.mlp_hidden(config, lp, y)
        if sel is not None and sel[3] < config.ffn // shards:
            scores = pred[0] if pred is not None else jnp.abs(hidden)
            n_mask = top_k_mask(scores, sel[3], shards) | ~active[..., None]
            hidden = hidden * n_mask
        return ops.mlp_output(lp, hidden)

    h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias)
    out = ops.residual(config, h, mlp, lp.mlp_norm_scale, lp.mlp_norm_bias)
    return out, (n_mask, g_mask)


def scored_hidden(config: ModelConfig, scfg: SparseConfig | None, params: ModelParams,
                  pred_params, ids: jax.Array, mask: jax.Array, dense_prefix: jax.Array,
                  return_sets: bool = False, shards: int = 1):
    """Final hidden states [B, T, d] (before the final norm) of the sparse computation.

    scfg None: dense. scfg.oracle: oracle top-k. Otherwise predictors (`pred_params`).
    dense_prefix [B]: positions below it run dense (the engine's dense prefill).
    With return_sets, also (neuron masks [L,B,T,F], KV-group masks [L,B,T,Hk]) bool.
    shards > 1: each of `shards` blocks of units keeps ceil(k / shards) (tensor parallel).
    """
    if shards > 1:
        check_tp(config, shards)
    B, T = ids.shape
    positions = positions_from_mask(mask)
    active = jnp.arange(T)[None, :] >= dense_prefix[:, None]
    x = embed(config, params, ids, positions)
    segments = ([(0, config.n_layers, True, config.ffn, config.n_kv_heads)]
                if scfg is None else scfg.segments(config))
    kind = None if scfg is None else ("oracle" if scfg.oracle else "sparse")
    src = x  # lookahead source: the previous layer's attention input (layer 0: its own)
    sets = []
    for start, stop, dense, k_mlp, k_heads in segments:
        layers = jax.tree.map(lambda w: w[start:stop], params.layers)

        def body(carry, xs, dense=dense, k_mlp=local_k(k_mlp, shards),
                 k_heads=local_k(k_heads, shards)):
            x, src = carry
            lp, layer = xs
            sel = None if dense else (kind, layer, pred_params, k_mlp, k_heads)
            out, masks = _layer(config, lp, x, src, positions, mask, active, sel, shards)
            return (out, x), (masks if return_sets else None)

        (x, src), ys = jax.lax.scan(body, (x, src),
                                    (layers, jnp.arange(start, stop, dtype=jnp.int32)))
        sets.append(ys)
    if not return_sets:
        return x
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *sets)


@functools.partial(jax.jit, static_argnames=("config", "scfg", "shards"))
def window_logits(config: ModelConfig, scfg: SparseConfig | None, params: ModelParams,
                  pred_params, ids, mask, dense_prefix, shards: int = 1):
    """(logits [B, T, V] fp32, (neuron masks, group masks)) for tests and small models."""
    hidden, sets = scored_hidden(config, scfg, params, pred_params, ids, mask, dense_prefix,
                                 return_sets=True, shards=shards)
    return unembed(config, params, hidden), sets


@functools.partial(jax.jit, static_argnames=("config", "scfg", "shards"))
def token_scores(config: ModelConfig, scfg: SparseConfig | None, params: ModelParams,
                 pred_params, ids, mask, dense_prefix, targets, shards: int = 1):
    """Per-position (log p(target) [B, T], greedy hit [B, T]) for next tokens `targets`.

    Only the [B, T] scores leave the jit; the [B, T, V] logits stay inside. With weights
    placed on a mesh (`sharding.shard_params`), it runs under GSPMD (see `shards`).
    """
    hidden = scored_hidden(config, scfg, params, pred_params, ids, mask, dense_prefix,
                           shards=shards)
    logits = unembed(config, params, hidden)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return target_logit - logz, greedy
