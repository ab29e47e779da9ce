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
  * oracle: the top-k of the layer's own |MLP activation| and of its query heads' output
    norms ||H_i W_O^i||.
Heads are query heads (for grouped-query models too): a KV group's K/V are used when one
of its query heads is selected, and the decode step recomputes what its group missed.
The MLP keeps only the selected neurons: masking the dense activations equals the
gathered sparse MLP. Attention: the decode path recomputes missing KV from each token's
stored layer input, so a selected head attends over the K/V of every earlier position
computed from that position's own (sparse-residual) layer input, which is what one dense
attention pass over the sparse residual stream gives; unselected heads contribute zero.
`tests/test_eval.py` checks logits and index sets against the decode engine.

Rows are independent (one batch-1 decode each); right padding is harmless because
attention is causal. With `share` > 1 (predictors) consecutive groups of `share` rows are
sequences decoded together under `SparseConfig.batch_policy` "shared": at each position
the group's rows use one set per layer, the top-k of their summed predicted
probabilities (`sparse.shared_scores`; rows still in their dense prefix, and padding,
do not vote).

Tensor parallel (`shards` = tp > 1): the tensor-parallel decode engine
(`dejavu_jax.tp_decode`) lets every device pick the top ceil(k / tp) of its own neurons and
query heads (devices hold equal contiguous blocks of units). With `shards` the scorer applies
that same rule: the scores of each layer split into `shards` equal blocks, each keeping its
own top ceil(k / tp). The rule is a function of the global scores, so it gives the same sets
on one device or under GSPMD with sharded weights (`--devices N` in the CLIs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import activation_sparsity, ops
from dejavu_jax.config import ModelConfig
from dejavu_jax.inputs import check_mask, check_token_ids, checked
from dejavu_jax.model import (embed, head_output_norms, positions_from_mask,
                              sequence_attention, unembed)
from dejavu_jax.params import ModelParams
from dejavu_jax.sharding import check_tp
from dejavu_jax.sparse import SparseConfig, sparse_config, threshold_config

F32 = jnp.float32
MODES = ("dense", "sparse", "oracle", "threshold")


@dataclasses.dataclass(frozen=True)
class EvalMode:
    """What to score with: `name` in MODES; `scfg` is None for dense. "sparse" scores with
    predictors, "oracle" with each layer's true top-k, "threshold" with activation
    thresholds (`activation_sparsity`); their selector params are the predictors, None
    and the thresholds [L, len(SITES)]."""

    name: str
    scfg: SparseConfig | None = None
    shards: int = 1  # top-k per block of units, as tp devices select (see module doc)
    shared_rows: int = 1  # rows per group sharing their sets (see module doc)
    source: str | None = None  # where the selector params came from (a profile file)

    def describe(self, config: ModelConfig) -> dict:
        """A JSON-friendly summary (mean densities over all layers, sparse settings)."""
        if self.scfg is None:
            return {"mode": "dense", "mlp_density": 1.0, "head_density": 1.0}
        if self.scfg.threshold_sites:
            return {"mode": self.name, "sites": list(self.scfg.threshold_sites),
                    "dense_layers": self.scfg.dense_layers, "profile": self.source}
        dens = self.scfg.density(config)
        out = {"mode": self.name,
               "mlp_density": sum(dens["mlp"]) / config.n_layers,
               "head_density": sum(dens["heads"]) / config.n_layers,
               "dense_layers": self.scfg.dense_layers,
               "mlp_k": list(self.scfg.mlp_k), "head_k": list(self.scfg.head_k)}
        if self.shared_rows > 1:
            out["shared_rows"] = self.shared_rows
        if self.shards > 1:  # each of `shards` blocks keeps ceil(k / shards) of its units
            out["selection_shards"] = self.shards
            out["mlp_k_per_shard"] = [local_k(k, self.shards) for k in self.scfg.mlp_k]
            out["head_k_per_shard"] = [local_k(k, self.shards) for k in self.scfg.head_k]
        return out


def make_mode(config: ModelConfig, name: str, mlp_density=1.0, head_density=1.0,
              dense_layers: int | None = None, shards: int = 1, sites=None,
              shared_rows: int = 1) -> EvalMode:
    """An EvalMode; densities are as for `sparse.sparse_config` (float or per layer).
    "threshold" takes the thresholded `sites` (default every site the model has) instead,
    and per-layer thresholds as its selector params, so dense_layers defaults to none.

    shards > 1 (sparse and oracle): select per block of units as `shards` tensor-parallel
    devices do; raises sharding.ShardingError when the heads or neurons do not divide.
    shared_rows > 1 (sparse): groups of that many rows share their sets (module doc).
    """
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; known: {MODES}")
    if shared_rows < 1 or (shared_rows > 1 and name != "sparse"):
        raise ValueError(f"shared_rows={shared_rows}: groups of rows share predicted sets "
                         f"(sparse mode, shared_rows >= 1)")
    if name == "dense":
        return EvalMode("dense")
    if name == "threshold":
        from dejavu_jax.activation_sparsity import SITES
        sites = sites or [s for s in SITES if s != "gate" or config.gated_mlp]
        return EvalMode(name, threshold_config(config, sites, 0), shards)
    if shards > 1:
        check_tp(config, shards)
    return EvalMode(name, sparse_config(config, mlp_density, head_density, dense_layers,
                                        oracle=name == "oracle"), shards, shared_rows)


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


def shared_top_k_mask(logits: jax.Array, k: int, votes: jax.Array, share: int,
                      shards: int = 1) -> jax.Array:
    """Boolean [B, T, n]: for each group of `share` consecutive rows and each position, the
    top-k (`top_k_mask`) of the group's summed predicted probabilities, the voting rows'
    (`votes` [B, T] bool) only; every row of a group gets its group's set."""
    from dejavu_jax.sparse import shared_scores
    B, T, n = logits.shape
    if B % share:
        raise ValueError(f"{B} rows do not split into groups of {share}")
    grouped = logits.reshape(B // share, share, T, n).transpose(0, 2, 1, 3)
    w = votes.reshape(B // share, share, T).transpose(0, 2, 1)
    summed = jax.vmap(jax.vmap(shared_scores))(grouped, w)[..., 0, :]   # [G, T, n]
    return jnp.repeat(top_k_mask(summed, k, shards), share, axis=0)


def _layer(config, lp, x, src, positions, mask, active, sel, layer, shards=1, share=1):
    """One block. sel: None (dense) or (kind, selector params, k_mlp, k_heads), with k per
    block of units when shards > 1 (see `top_k_mask`); for kind "threshold" the selector
    params are the thresholds [L, len(SITES)] (`activation_sparsity`).

    `active` [B, T] marks positions that run sparse; `src` is the lookahead input.
    share > 1 (predictors): groups of `share` rows share their sets (`shared_top_k_mask`).
    Returns (x_out, (neuron mask [B,T,F], query-head mask [B,T,H], kept [B,T,len(SITES)])):
    kept holds, per position, the fraction of each threshold site's channels kept (1 for
    the index-set modes and dense positions).
    """
    B, T, _ = x.shape
    n_mask = jnp.ones((B, T, config.ffn), bool)
    h_mask = jnp.ones((B, T, config.n_heads), bool)
    kept = {}
    kind = None if sel is None else sel[0]
    thresholds = None
    if kind == "threshold":  # dense positions: threshold 0, the dense computation
        thresholds = jnp.where(active[..., None], sel[1][layer], 0.0)
    pred = None
    if kind == "sparse":
        from dejavu_jax.train.predict import predictor_scores
        _, pred_params, k_mlp, k_heads = sel
        mlp_s, head_s = predictor_scores(pred_params, layer, src.reshape(B * T, -1))
        pred = (mlp_s.reshape(B, T, -1), head_s.reshape(B, T, -1))
    votes = active & (mask > 0)

    def pick(scores, k):
        if pred is not None and share > 1:
            return shared_top_k_mask(scores, k, votes, share, shards)
        return top_k_mask(scores, k, shards)

    def attn(y):
        nonlocal h_mask
        if thresholds is None:
            mask_heads = None
        else:
            mask_input, mask_out = activation_sparsity.attention_hooks(thresholds)
            y = mask_input(y)
            kept["qkv"] = jnp.mean(y != 0, axis=-1, dtype=F32)

            def mask_heads(heads):
                masked = mask_out(heads)
                kept["o"] = jnp.mean(masked.reshape(B, T, -1) != 0, axis=-1, dtype=F32)
                return masked
        out, heads, _, _ = sequence_attention(config, lp, y, positions, mask, layer,
                                              mask_heads)
        if kind in ("sparse", "oracle") and sel[3] < config.n_heads // shards:
            scores = pred[1] if pred is not None else head_output_norms(lp, heads)
            h_mask = pick(scores, sel[3]) | ~active[..., None]
            heads = heads * h_mask[..., None]
            out = ops.out_project(lp, heads)
        return out

    def mlp(y):
        nonlocal n_mask
        if thresholds is not None:
            out, mlp_kept = activation_sparsity.mlp(config, lp, y, thresholds)
            for i, site in enumerate(("gate_up", "gate", "down")):
                kept[site] = mlp_kept[..., i]
            return out
        hidden = ops.mlp_hidden(config, lp, y)
        if kind in ("sparse", "oracle") and sel[2] < config.ffn // shards:
            scores = pred[0] if pred is not None else jnp.abs(hidden)
            n_mask = pick(scores, sel[2]) | ~active[..., None]
            hidden = hidden * n_mask
        return ops.mlp_output(lp, hidden)

    h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                     lp.post_attn_norm_scale)
    out = ops.residual(config, h, mlp, lp.mlp_norm_scale, lp.mlp_norm_bias,
                       lp.post_mlp_norm_scale)
    ones = jnp.ones((B, T), F32)
    kept = jnp.stack([kept.get(site, ones) for site in activation_sparsity.SITES], axis=-1)
    return out, (n_mask, h_mask, kept)


def read_fraction(config: ModelConfig, scfg: SparseConfig | None, sets) -> jax.Array:
    """Per position [B, T]: the fraction of the decoder layers' matmul weight bytes read,
    from `scored_hidden`'s sets (masks of the index-set modes, kept fractions of the
    threshold mode), averaged over the layers. Predictor weights are not counted. The
    q/o rows count per selected query head, the k/v rows per KV group holding one."""
    n_mask, h_mask, kept = sets  # [L, B, T, ...]
    if scfg is not None and scfg.threshold_sites:
        names = activation_sparsity.SITES
        reads = activation_sparsity.threshold_reads(
            config, scfg.threshold_sites, {s: kept[..., i] for i, s in enumerate(names)})
    else:
        groups = h_mask.reshape(*h_mask.shape[:-1], config.n_kv_heads, config.group_size)
        reads = activation_sparsity.unit_reads(config, jnp.mean(n_mask, -1, dtype=F32),
                                               jnp.mean(h_mask, -1, dtype=F32),
                                               jnp.mean(groups.any(-1), -1, dtype=F32))
    sizes = activation_sparsity.matmul_elements(config)
    per_layer = sum(sizes[m] * reads[m] for m in activation_sparsity.MATMULS)
    return jnp.mean(per_layer, axis=0) / activation_sparsity.layer_elements(config)


def scored_hidden(config: ModelConfig, scfg: SparseConfig | None, params: ModelParams,
                  pred_params, ids: jax.Array, mask: jax.Array, dense_prefix: jax.Array,
                  return_sets: bool = False, shards: int = 1, share: int = 1):
    """Final hidden states [B, T, d] (before the final norm) of the sparse computation.

    scfg None: dense. scfg.oracle: oracle top-k. scfg.threshold_sites: activation
    thresholds (`pred_params` the thresholds [L, len(SITES)]). Otherwise predictors
    (`pred_params`). dense_prefix [B]: positions below it run dense (the engine's dense
    prefill). With return_sets, also (neuron masks [L,B,T,F], query-head masks [L,B,T,H]
    bool, kept fractions of the threshold sites [L,B,T,len(SITES)]).
    shards > 1: each of `shards` blocks of units keeps ceil(k / shards) (tensor parallel).
    share > 1: groups of `share` rows share their predicted sets (module doc).
    Ids must lie in [0, vocab_size) (`check_window`).
    """
    check_window(config, ids, mask, dense_prefix)
    if shards > 1:
        check_tp(config, shards)
    B, T = ids.shape
    positions = positions_from_mask(mask)
    active = jnp.arange(T)[None, :] >= dense_prefix[:, None]
    x = embed(config, params, ids, positions)
    segments = ([(0, config.n_layers, True, config.ffn, config.n_heads)]
                if scfg is None else scfg.segments(config))
    kind = None
    if scfg is not None:
        kind = ("oracle" if scfg.oracle else "threshold" if scfg.threshold_sites
                else "sparse")
    src = x  # lookahead source: the previous layer's attention input (layer 0: its own)
    sets = []
    for start, stop, dense, k_mlp, k_heads in segments:
        layers = jax.tree.map(lambda w: w[start:stop], params.layers)

        def body(carry, xs, dense=dense, k_mlp=local_k(k_mlp, shards),
                 k_heads=local_k(k_heads, shards)):
            x, src = carry
            lp, layer = xs
            sel = None if dense else (kind, pred_params, k_mlp, k_heads)
            out, masks = _layer(config, lp, x, src, positions, mask, active, sel, layer,
                                shards, share)
            return (out, x), (masks if return_sets else None)

        (x, src), ys = jax.lax.scan(body, (x, src),
                                    (layers, jnp.arange(start, stop, dtype=jnp.int32)))
        sets.append(ys)
    if not return_sets:
        return x
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *sets)


def check_window(config: ModelConfig, ids, mask, dense_prefix, targets=None) -> None:
    """ValueError unless ids (and targets) are [B, T] token ids in the vocabulary (values
    checked when concrete; `dejavu_jax.inputs`), mask is [B, T] and dense_prefix is [B]."""
    check_token_ids(ids, config.vocab_size)
    shape = np.shape(ids)
    check_mask(mask, shape)
    if np.shape(dense_prefix) != shape[:1]:
        raise ValueError(f"dense_prefix must be [batch] = [{shape[0]}], got shape "
                         f"{np.shape(dense_prefix)}")
    if targets is not None:
        check_token_ids(targets, config.vocab_size, "targets")
        check_mask(targets, shape, "targets")


@functools.partial(checked, check=lambda config, scfg, params, pred_params, ids, mask,
                   dense_prefix, shards=1, share=1: check_window(config, ids, mask,
                                                                 dense_prefix))
@functools.partial(jax.jit, static_argnames=("config", "scfg", "shards", "share"))
def window_logits(config: ModelConfig, scfg: SparseConfig | None, params: ModelParams,
                  pred_params, ids, mask, dense_prefix, shards: int = 1, share: int = 1):
    """(logits [B, T, V] fp32, (neuron masks, query-head masks, kept fractions)) for tests and
    small models."""
    hidden, sets = scored_hidden(config, scfg, params, pred_params, ids, mask, dense_prefix,
                                 return_sets=True, shards=shards, share=share)
    return unembed(config, params, hidden), sets


@functools.partial(checked, check=lambda config, scfg, params, pred_params, ids, mask,
                   dense_prefix, targets, shards=1, share=1: check_window(
                       config, ids, mask, dense_prefix, targets))
@functools.partial(jax.jit, static_argnames=("config", "scfg", "shards", "share"))
def token_scores(config: ModelConfig, scfg: SparseConfig | None, params: ModelParams,
                 pred_params, ids, mask, dense_prefix, targets, shards: int = 1,
                 share: int = 1):
    """Per-position (log p(target) [B, T], greedy hit [B, T], bytes read [B, T]) for next
    tokens `targets`; bytes read is `read_fraction`, the share of the decoder layers'
    matmul weights a decode step of that position reads.

    Only the [B, T] scores leave the jit; the [B, T, V] logits stay inside. With weights
    placed on a mesh (`sharding.shard_params`), it runs under GSPMD (see `shards`).
    Concrete ids and targets are checked against the vocabulary before the jit.
    """
    hidden, sets = scored_hidden(config, scfg, params, pred_params, ids, mask, dense_prefix,
                                 return_sets=True, shards=shards, share=share)
    logits = unembed(config, params, hidden)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return target_logit - logz, greedy, read_fraction(config, scfg, sets)
