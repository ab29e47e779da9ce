"""The dense decoder: full-sequence forward (prefill, logits) and cached decode steps.

Layers run under `jax.lax.scan` over the stacked LayerParams. The KV cache lives in
`DecodeState` and is updated in place inside one jitted step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dejavu_jax import ops
from dejavu_jax.config import ModelConfig
from dejavu_jax.inputs import (check_mask, check_next_positions, check_prompt,
                               check_step_tokens, check_token_ids, checked, is_traced,
                               largest_position)
from dejavu_jax.params import OPT_POSITION_OFFSET, ModelParams, check_fits, scan_layers

F32 = jnp.float32


@struct.dataclass
class DecodeState:
    """Everything a decode step reads and writes besides the weights.

    k, v: [B, L, Hk, S, hd] cache, one contiguous history per head. Batch-major, so that
      `k.reshape(B, L * Hk, S, hd)` addresses every layer's heads without a copy. With
      unstacked weights (`params.unstack_layers`) they are tuples of per-layer
      [B, Hk, S, hd] buffers instead, so each layer reads and writes its own buffer.
    valid: [B, S] which cache slots hold real tokens (left padding is invalid).
    slot: int32 scalar, the next slot to write (shared by the batch).
    positions: [B] int32, the position id of each row's next token.
    live: [B] bool, rows still generating. A finished row (`finish_rows`) still decodes,
      its tokens unread, but no longer weighs in a batch's shared selection.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    slot: jax.Array
    positions: jax.Array
    live: jax.Array


def finish_rows(state, finished: jax.Array):
    """The decode state (a DecodeState, or an engine's state holding one as `dense`) with
    the rows `finished` [B] bool no longer live."""
    if isinstance(state, DecodeState):
        return state.replace(live=state.live & ~finished)
    return state.replace(dense=finish_rows(state.dense, finished))


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Position ids [B, T] counting real tokens only (left padding gets 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def embed(config: ModelConfig, params: ModelParams, ids: jax.Array, positions: jax.Array):
    """Token (and for OPT, learned position) embeddings in fp32: [..., d]. Models with an
    `embed_scale` (Gemma) multiply by it in the embedding's dtype."""
    x = jnp.take(params.embed, ids, axis=0)
    if config.embed_scale is not None:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    x = x.astype(F32)
    if params.project_in is not None:
        x = ops.rows_matmul(x, params.project_in)
    if params.pos_embed is not None:
        x = x + jnp.take(params.pos_embed, positions + OPT_POSITION_OFFSET, axis=0).astype(F32)
    return x


def unembed(config: ModelConfig, params: ModelParams, x: jax.Array) -> jax.Array:
    """Final norm, projection and LM head: fp32 logits [..., V]."""
    if params.final_norm_scale is not None:
        x = ops.norm(x, params.final_norm_scale, params.final_norm_bias, config.norm_eps)
    if params.project_out is not None:
        x = ops.rows_matmul(x, params.project_out)
    head = params.embed if params.lm_head is None else params.lm_head
    return ops.softcap(ops.rows_matmul(x, head), config.final_logit_softcap)


def head_output_norms(lp, heads_out: jax.Array) -> jax.Array:
    """||H_i(y) W_O^i|| for each head: heads_out [..., H, hd] -> [..., H], fp32.

    Uses the per-head Gram matrix W_O^i W_O^iᵀ so the [.., H, d] products are never formed.
    """
    wo = lp.wo.astype(F32)
    gram = jnp.einsum("dhk,dhl->hkl", wo, wo)
    sq = jnp.einsum("...hk,hkl,...hl->...h", heads_out, gram, heads_out)
    return jnp.sqrt(jnp.maximum(sq, 0.0))


def sequence_attention(config: ModelConfig, lp, y: jax.Array, positions: jax.Array,
                       mask: jax.Array, layer, mask_heads=None):
    """Causal self-attention of normed inputs y [B, T, d] over the whole sequence (the
    layer's sliding window and RoPE included): (output [B, T, d], per-head outputs
    [B, T, H, hd], k, v [B, T, Hk, hd]). mask_heads(heads) may zero parts of the per-head
    outputs before the out-projection (the returned heads are the unmasked ones)."""
    B, T, _ = y.shape
    q, k, v = ops.project_qkv(config, lp, y, positions, layer)  # [B,T,H,hd], [B,T,Hk,hd]
    q = q.reshape(B, T, config.n_kv_heads, config.group_size, config.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
    causal = jnp.tril(jnp.ones((T, T), bool))
    steps = jnp.arange(T)
    window = ops.window_mask(config, layer, steps, steps)
    if window is not None:
        causal = causal & window
    allowed = causal[None, None, None] & mask[:, None, None, None, :].astype(bool)
    weights = ops.attention_weights(ops.softcap(scores, config.attn_logit_softcap), allowed)
    heads = jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(B, T, config.n_heads, -1)
    projected = heads if mask_heads is None else mask_heads(heads)
    return ops.out_project(lp, projected), heads, k, v


def sequence_forward(config: ModelConfig, params: ModelParams, input_ids: jax.Array,
                     attention_mask: jax.Array | None = None, *, records: bool = False):
    """Run all layers over [B, T] tokens.

    Returns (hidden [B,T,d] fp32 before the final norm, (k, v) each [B,L,Hk,T,hd],
    records). With records=True, `records` is a dict of per-layer arrays [L, B, T, ...]:
      attn_in, mlp_in: residual stream entering the attention / MLP block (pre-norm);
      mlp_act: neuron activations [.., F]; head_norm: ||H_i W_O^i|| [.., H].
    """
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    positions = positions_from_mask(attention_mask)
    x = embed(config, params, input_ids, positions)

    def layer(x, inputs):
        lp, index = inputs
        rec = {}

        def attn(y):
            out, heads, k, v = sequence_attention(config, lp, y, positions, attention_mask,
                                                   index)
            rec["kv"] = (k, v)
            if records:
                rec["head_norm"] = head_output_norms(lp, heads)
            return out

        def mlp(y):
            hidden = ops.mlp_hidden(config, lp, y)
            if records:
                rec["mlp_act"] = hidden
            return ops.mlp_output(lp, hidden)

        rec_in = {"attn_in": x} if records else {}
        h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                         lp.post_attn_norm_scale)
        if records:
            rec_in["mlp_in"] = h
        out = ops.residual(config, h, mlp, lp.mlp_norm_scale, lp.mlp_norm_bias,
                           lp.post_mlp_norm_scale)
        k, v = rec.pop("kv")
        kv = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return out, (kv, {**rec_in, **rec})

    x, ((k, v), recs) = scan_layers(layer, x, params.layers, with_index=True)
    kv = (k.transpose(1, 0, 2, 3, 4), v.transpose(1, 0, 2, 3, 4))
    return x, kv, (recs if records else None)


@functools.partial(jax.jit, static_argnums=0)
def _logits(config, params, input_ids, attention_mask):
    hidden, _, _ = sequence_forward(config, params, input_ids, attention_mask)
    return unembed(config, params, hidden)


def position_limit(config: ModelConfig) -> tuple[int, str] | None:
    """(positions, what bounds them) for a model with nothing computed past a bound: an OPT
    model's learned positions and dynamic RoPE's default frequencies end at
    `max_positions`; None for the other rotary models, which compute any position."""
    if config.family == "opt":
        return config.max_positions, "learned positions"
    if config.rope_dynamic:
        return config.max_positions, ("positions (dynamic RoPE rescales its frequencies past "
                                      "them; not implemented)")
    return None


def check_positions(config: ModelConfig, length: int) -> None:
    """ValueError when a sequence of `length` tokens passes `position_limit` (an OPT
    model's learned positions, a dynamic RoPE model's `max_positions`, a LongRoPE model's
    original context)."""
    limit = position_limit(config)
    if limit is not None and length > limit[0]:
        raise ValueError(f"{length} tokens exceed the model's {limit[0]} {limit[1]}")


def check_step_positions(config: ModelConfig, state: DecodeState) -> None:
    """ValueError when a decode step's tokens would sit past `position_limit`, or when a
    LongRoPE model's step would take its sequence past the original context, where the
    cache (computed with the short factors) must be recomputed with the long ones: prefill
    the whole sequence instead, as `generate_tokens` does (checked when the state's
    positions are concrete)."""
    limit = position_limit(config)
    if limit is not None:
        check_next_positions(state.positions, *limit)
    if config.rope_longrope is not None:
        original = int(config.rope_longrope[1])
        if largest_position(state.positions) == original:
            raise ValueError(
                f"this step takes the sequence past the model's original context of "
                f"{original} tokens, where LongRoPE switches to its long factors for every "
                f"position: prefill the whole sequence again (generate_tokens does)")


def logits(config: ModelConfig, params: ModelParams, input_ids,
           attention_mask=None) -> jax.Array:
    """Full-sequence float32 logits [B, T, V] for token ids [B, T] (mask: 1 = real token).

    Raises ValueError for ids outside [0, vocab_size) (checked when concrete: traced ids
    must be in range), non-integer ids, a mask not shaped like the ids, or more tokens
    than OPT's learned positions, and for params of other shapes than the config's.
    """
    check_fits(config, params)
    check_token_ids(input_ids, config.vocab_size)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    check_positions(config, input_ids.shape[-1])
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    check_mask(attention_mask, input_ids.shape)
    return _logits(config, params, input_ids, jnp.asarray(attention_mask, jnp.int32))


def init_state(config: ModelConfig, batch: int, max_len: int, dtype,
               per_layer: bool = False) -> DecodeState:
    """An empty decode state with room for `max_len` tokens per row.

    per_layer: tuples of per-layer cache buffers (for unstacked weights).
    """
    if per_layer:
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
    else:
        shape = (batch, config.n_layers, config.n_kv_heads, max_len, config.head_dim)
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return DecodeState(
        k=k, v=v,
        valid=jnp.zeros((batch, max_len), bool), slot=jnp.zeros((), jnp.int32),
        positions=jnp.zeros((batch,), jnp.int32), live=jnp.ones((batch,), bool))


def prefill_fn(config: ModelConfig, params: ModelParams, input_ids: jax.Array,
               attention_mask: jax.Array, state: DecodeState):
    """Dense forward over left-padded prompts [B, T] with mask [B, T] (1 = token).

    Fills cache slots 0..T-1 for every head and returns (last-position logits [B, V],
    the state ready for decoding at slot T; a used state forgets what it held). Ids must lie
    in [0, vocab_size), and an OPT prompt within its learned positions: concrete ids are
    checked (ValueError), traced ones are the caller's contract (`dejavu_jax.inputs`).
    """
    check_prompt(input_ids, attention_mask, config.vocab_size, state)
    if not is_traced(input_ids):  # traced: a benchmark may time OPT's shapes past them
        check_positions(config, input_ids.shape[1])
    T = input_ids.shape[1]
    hidden, (k, v), _ = sequence_forward(config, params, input_ids, attention_mask)
    logits_last = unembed(config, params, hidden[:, -1])
    def fill(cache, new):
        if isinstance(cache, tuple):
            return tuple(jax.lax.dynamic_update_slice(c, new[:, l].astype(c.dtype), (0, 0, 0, 0))
                         for l, c in enumerate(cache))
        return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, 0, 0, 0, 0))

    new_state = DecodeState(
        k=fill(state.k, k), v=fill(state.v, v),
        # the prompt's slots only: entries a used state held past them are not attended
        valid=jax.lax.dynamic_update_slice(jnp.zeros_like(state.valid),
                                           attention_mask.astype(bool), (0, 0)),
        slot=jnp.asarray(T, jnp.int32),
        positions=jnp.sum(attention_mask, axis=-1).astype(jnp.int32),
        live=jnp.ones(attention_mask.shape[:1], bool))
    return logits_last, new_state


prefill = checked(
    jax.jit(prefill_fn, static_argnums=0, donate_argnums=(4,)),
    lambda config, params, ids, mask, state: (check_prompt(ids, mask, config.vocab_size, state),
                                              check_positions(config, np.shape(ids)[1])))
prefill.__doc__ = """Jitted `prefill_fn` (the state donated), after a check of concrete ids."""


def cached_attention(config: ModelConfig, q: jax.Array, k_layer: jax.Array,
                     v_layer: jax.Array, valid: jax.Array) -> jax.Array:
    """One query per row against a layer's cache: q [B,H,hd], k/v [B,Hk,S,hd] -> [B,H,hd]."""
    B = q.shape[0]
    qg = q.reshape(B, config.n_kv_heads, config.group_size, config.head_dim)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg.astype(k_layer.dtype), k_layer,
                        preferred_element_type=F32)
    weights = ops.attention_weights(ops.softcap(scores, config.attn_logit_softcap),
                                    valid[:, None, None, :])
    out = jnp.einsum("bkgs,bksd->bkgd", weights.astype(v_layer.dtype), v_layer,
                     preferred_element_type=F32)
    return out.reshape(B, config.n_heads, config.head_dim)


def cache_layer(cache, layer) -> jax.Array:
    """One layer's [B, Hk, S, hd] cache, from a stacked cache or a per-layer tuple."""
    return cache[layer] if isinstance(cache, tuple) else cache[:, layer]


def set_cache_layer(cache, layer, value: jax.Array):
    """The cache with one layer's [B, Hk, S, hd] buffer replaced."""
    if isinstance(cache, tuple):
        return cache[:layer] + (value,) + cache[layer + 1:]
    return cache.at[:, layer].set(value)


def write_kv(cache, layer, slot: jax.Array, new: jax.Array):
    """Write new [B, Hk, hd] into the cache at (layer, slot), in place."""
    if isinstance(cache, tuple):
        upd = new.astype(cache[layer].dtype)[:, :, None, :]
        return set_cache_layer(cache, layer,
                               jax.lax.dynamic_update_slice(cache[layer], upd, (0, 0, slot, 0)))
    upd = new.astype(cache.dtype)[:, None, :, None, :]
    return jax.lax.dynamic_update_slice(cache, upd, (0, layer, 0, slot, 0))


def layer_valid(config: ModelConfig, layer, step: dict) -> jax.Array:
    """The cache slots [B, S] that `layer` attends to at this step: step["valid"], on
    sliding layers narrowed to the window that ends at step["slot"]."""
    valid = step["valid"]
    window = ops.window_mask(config, layer, step["slot"],
                             jnp.arange(valid.shape[-1], dtype=jnp.int32))
    return valid if window is None else valid & window[None]


def dense_attention(config: ModelConfig, lp, y: jax.Array, k_all, v_all, layer, step: dict,
                    mask_heads=None):
    """Dense attention for one new token per row, normed inputs y [B, d]: (output [B, d]
    before any residual add, k_all, v_all with this layer's K/V written at step["slot"]).
    step and mask_heads are as in `decode_layer`."""
    q, k, v = ops.project_qkv(config, lp, y, step["positions"], layer)
    k_all = write_kv(k_all, layer, step["slot"], k)
    v_all = write_kv(v_all, layer, step["slot"], v)
    heads = cached_attention(config, q, cache_layer(k_all, layer), cache_layer(v_all, layer),
                             layer_valid(config, layer, step))
    if mask_heads is not None:
        heads = mask_heads(lp, heads)
    return ops.out_project(lp, heads), k_all, v_all


def decode_layer(config: ModelConfig, lp, x: jax.Array, k_all, v_all, layer, step: dict,
                 mask_heads=None, mask_neurons=None, reduce=None):
    """One dense layer for one new token per row; returns (x, k_all, v_all) with this
    layer's K/V written at step["slot"].

    step holds "slot", "positions" [B] and "valid" [B, S] (the current slot included).
    mask_heads(lp, heads [B,H,hd]) and mask_neurons(hidden [B,F]) may zero units before the
    output projections (the sparse engine's oracle mode). reduce, when given, is applied to
    the attention and MLP outputs before the residual add (a psum under tensor parallelism).
    """
    reduce = reduce or (lambda out: out)
    box = {}

    def attn(y):
        out, box["k"], box["v"] = dense_attention(config, lp, y, k_all, v_all, layer, step,
                                                  mask_heads)
        return reduce(out)

    def mlp(y):
        hidden = ops.mlp_hidden(config, lp, y)
        if mask_neurons is not None:
            hidden = mask_neurons(hidden)
        return reduce(ops.mlp_output(lp, hidden))

    h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                     lp.post_attn_norm_scale)
    x = ops.residual(config, h, mlp, lp.mlp_norm_scale, lp.mlp_norm_bias,
                     lp.post_mlp_norm_scale)
    return x, box["k"], box["v"]


def check_cache_layout(params: ModelParams, state: DecodeState) -> None:
    """ValueError when a per-layer cache (`init_state(..., per_layer=True)`) meets stacked
    weights, whose layer loop cannot index it."""
    if isinstance(state.k, tuple) and not isinstance(params.layers, tuple):
        raise ValueError("a per-layer cache (init_state(..., per_layer=True)) decodes with "
                         "per-layer weights (params.unstack_layers); stacked weights take "
                         "a stacked cache")


def decode_layers(config: ModelConfig, params: ModelParams, x: jax.Array,
                  state: DecodeState):
    """All layers for one new token per row: x [B, d] -> (x, state) with the cache updated."""
    check_cache_layout(params, state)
    valid = jax.lax.dynamic_update_slice(
        state.valid, jnp.ones((state.valid.shape[0], 1), bool), (0, state.slot))
    step = {"slot": state.slot, "positions": state.positions, "valid": valid}

    def layer(carry, inputs):
        (lp, index), (x, k_all, v_all) = inputs, carry
        return decode_layer(config, lp, x, k_all, v_all, index, step), None

    (x, k, v), _ = scan_layers(layer, (x, state.k, state.v), params.layers, with_index=True)
    return x, DecodeState(k=k, v=v, valid=valid, slot=state.slot + 1,
                          positions=state.positions + 1, live=state.live)


def decode_step_fn(config: ModelConfig, params: ModelParams, state: DecodeState,
                   tokens: jax.Array):
    """One cached decode step for tokens [B]: returns (logits [B, V] fp32, new state).

    Pure and unjitted; `decode_step` is the jitted form with the state donated. Tokens must
    lie in [0, vocab_size), with a free cache slot and (OPT) a learned position left:
    concrete ones are checked (ValueError), traced ones are the caller's contract
    (`dejavu_jax.inputs`).
    """
    check_step_tokens(tokens, config.vocab_size, state)
    check_step_positions(config, state)
    x = embed(config, params, tokens, state.positions)
    x, state = decode_layers(config, params, x, state)
    return unembed(config, params, x), state


decode_step = checked(
    jax.jit(decode_step_fn, static_argnums=0, donate_argnums=(2,)),
    lambda config, params, state, tokens: (check_step_tokens(tokens, config.vocab_size, state),
                                           check_step_positions(config, state)))
decode_step.__doc__ = """Jitted `decode_step_fn`, after a check of concrete tokens; the
state's cache buffers are updated in place."""
