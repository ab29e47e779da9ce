"""Calibration of activation thresholds on text (`dejavu_jax.activation_sparsity`).

A backward pass gives the gradient g of the windows' next-token NLL with respect to each
sublayer's residual contribution; then one dense pass over the same windows gives, per
layer and site:
  * the magnitude quantiles of the site's activations (`QUANTILES`): the threshold that
    drops a fraction s of the channels is the s-quantile of |x|;
  * for each of `levels` s, with that site alone dropping a fraction s and delta the
    change of the sublayer's contribution: the relative output error sum ||delta||^2 /
    sum ||x||^2 (x the residual stream entering the sublayer), and the first- and
    second-order terms of the NLL it adds per token, mean(g . delta) and
    mean((g . delta)^2) / 2 (the empirical Fisher's). The estimate ranks what each (layer, site) costs per byte skipped
    (`train.allocate`).
Positions 0 (the BOS of a window, which a decode step never takes as input) and padding do
not count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import activation_sparsity as act
from dejavu_jax import ops
from dejavu_jax.config import ModelConfig
from dejavu_jax.model import embed, positions_from_mask, sequence_attention
from dejavu_jax.params import ModelParams

F32 = jnp.float32
QUANTILES = np.linspace(0.0, 1.0, 101)


def _site_thresholds(site: int, value) -> jax.Array:
    return jnp.zeros(len(act.SITES), F32).at[site].set(value)


def _sublayer_error(out, dense_out, x, grad, valid):
    """(sum ||out - dense_out||^2 / sum ||x||^2, the first- and second-order terms of the
    NLL change per token) over valid positions, grad the NLL's gradient with respect to
    the sublayer's contribution."""
    w = valid.astype(F32)
    delta = out - dense_out
    first = jnp.sum(delta * grad, -1)
    relative = jnp.sum(jnp.sum(delta ** 2, -1) * w) / jnp.sum(jnp.sum(x ** 2, -1) * w)
    n = jnp.sum(w)
    return relative, jnp.sum(first * w) / n, jnp.sum(0.5 * first ** 2 * w) / n


def _next_token_nll(config, params, ids, mask, offsets, base):
    """Total NLL of each window's next tokens (positions whose target is a token) with
    `offsets` [2, L, B, T, d] added to every attention and MLP contribution, the layers
    running under thresholds `base` [L, len(SITES)]."""
    from dejavu_jax.model import unembed
    B, T = ids.shape
    positions = positions_from_mask(mask)

    @jax.checkpoint
    def layer(x, inputs):
        lp, index, extra, t = inputs
        mask_input, mask_heads = act.attention_hooks(t)

        def attn(y):
            return sequence_attention(config, lp, mask_input(y), positions, mask, index,
                                      mask_heads)[0]
        h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                         lp.post_attn_norm_scale) + extra[0]
        out = ops.residual(config, h, lambda y: act.mlp(config, lp, y, t)[0],
                           lp.mlp_norm_scale, lp.mlp_norm_bias,
                           lp.post_mlp_norm_scale) + extra[1]
        return out, None

    x = embed(config, params, ids, positions)
    index = jnp.arange(config.n_layers, dtype=jnp.int32)
    x, _ = jax.lax.scan(layer, x, (params.layers, index, jnp.moveaxis(offsets, 0, 1), base))
    logp = jax.nn.log_softmax(unembed(config, params, x[:, :-1]), axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    scored = mask[:, 1:].astype(bool) & mask[:, :-1].astype(bool)
    return jnp.sum(jnp.where(scored, nll, 0.0))


@functools.partial(jax.jit, static_argnames=("config",))
def contribution_gradients(config: ModelConfig, params: ModelParams, ids: jax.Array,
                           mask: jax.Array, base: jax.Array | None = None) -> jax.Array:
    """[2, L, B, T, d]: the gradient of the windows' total next-token NLL with respect to
    each layer's attention (0) and MLP (1) contribution to the residual stream, the model
    running under thresholds `base` [L, len(SITES)] (None: dense)."""
    B, T = ids.shape
    zeros = jnp.zeros((2, config.n_layers, B, T, config.hidden), F32)
    base = jnp.zeros((config.n_layers, len(act.SITES)), F32) if base is None else base
    return jax.grad(lambda o: _next_token_nll(config, params, ids, mask, o, base))(zeros)


@functools.partial(jax.jit, static_argnames=("config", "levels"))
def calibration_stats(config: ModelConfig, params: ModelParams, ids: jax.Array,
                      mask: jax.Array, levels: tuple[float, ...],
                      grads: jax.Array | None = None, base: jax.Array | None = None) -> dict:
    """{"quantiles": [L, len(SITES), len(QUANTILES)] magnitude quantiles; "errors",
    "nll_first", "nll_second": [L, len(SITES), len(levels)] relative output errors and the
    first- and second-order terms of the NLL change per token} of the dense model over
    windows ids [B, T] (mask: 1 = token); grads are `contribution_gradients` of the same
    windows (None: computed here). Sites a model lacks (the gate of an ungated MLP) get
    zeros. With no levels only the quantiles are computed (no backward pass): what timing
    runs on random weights need.

    base [L, len(SITES)]: an operating point to calibrate around instead of the dense
    model. The layers run under these thresholds, the quantiles are those of the
    activations there, and each level's cost is that of raising one site's threshold to
    the level's quantile (never below its base) with the rest at base."""
    B, T = ids.shape
    base = jnp.zeros((config.n_layers, len(act.SITES)), F32) if base is None else base
    if grads is None:
        grads = (contribution_gradients(config, params, ids, mask, base) if levels else
                 jnp.zeros((2, config.n_layers, B, T, config.hidden), F32))
    positions = positions_from_mask(mask)
    valid = mask.astype(bool) & (jnp.arange(T) >= 1)[None]
    quantiles = jnp.asarray(QUANTILES, F32)
    level_q = [int(round(s * (len(QUANTILES) - 1))) for s in levels]

    def magnitude_quantiles(v):
        flat = jnp.where(valid[..., None], jnp.abs(v.reshape(B, T, -1)), jnp.nan)
        return jnp.nanquantile(flat.reshape(-1), quantiles).astype(F32)

    def post_norm(out, scale):
        return out if scale is None else ops.norm(out, scale, None, config.norm_eps)

    def layer(x, inputs):
        lp, index, grad, t0 = inputs
        eps = config.norm_eps
        q_rows, err_rows = [None] * len(act.SITES), [None] * len(act.SITES)
        y = ops.norm(x, lp.attn_norm_scale, lp.attn_norm_bias, eps) if config.pre_norm else x

        def raised(site, value):  # the base thresholds with one site's raised to `value`
            return t0.at[site].set(jnp.maximum(t0[site], value))

        def attention(t):
            mask_input, mask_heads = act.attention_hooks(t)
            out, heads, _, _ = sequence_attention(config, lp, mask_input(y), positions, mask,
                                                  index, mask_heads)
            return post_norm(out, lp.post_attn_norm_scale), mask_heads(heads)

        base_attn, heads = attention(t0)
        q_rows[act.QKV] = magnitude_quantiles(act.attention_hooks(t0)[0](y))
        q_rows[act.O] = magnitude_quantiles(heads)
        linear = lp.post_attn_norm_scale is None  # then a dropped part's effect is linear

        def attention_at(site, t):
            if site == act.O and linear:  # minus the out-projection of what is dropped
                dropped = jnp.where(jnp.abs(heads) > t, 0.0, heads)
                return base_attn - jnp.einsum("...hk,dhk->...d", dropped, lp.wo.astype(F32))
            return attention(raised(site, t))[0]

        for site in (act.QKV, act.O):
            if not levels:
                err_rows[site] = jnp.zeros((3, 0), F32)
                continue
            err_rows[site] = jnp.stack([jnp.stack(_sublayer_error(
                attention_at(site, q_rows[site][lq]), base_attn, x, grad[0], valid))
                for lq in level_q], -1)
        h = x + base_attn if config.pre_norm else ops.norm(
            x + base_attn, lp.attn_norm_scale, lp.attn_norm_bias, eps)
        ym = ops.norm(h, lp.mlp_norm_scale, lp.mlp_norm_bias, eps) if config.pre_norm else h

        def mlp(t):
            return post_norm(act.mlp(config, lp, ym, t)[0], lp.post_mlp_norm_scale)

        base_mlp = mlp(t0)
        ys = act.sparse_input(ym, t0[act.GATE_UP])
        up = ops.add_bias(ops.up_projection(lp, ys), lp.b_in)
        gate = ops.gate_projection(lp, ys)
        if gate is not None:
            gate = ops.activation(config.activation, gate)
            gate_mag = act.gate_magnitude(lp, gate)
            hidden = jnp.where(gate_mag > t0[act.GATE], gate * up, 0.0)
            q_rows[act.GATE] = magnitude_quantiles(gate_mag)
        else:
            hidden = ops.activation(config.activation, up)
            q_rows[act.GATE] = jnp.zeros(len(QUANTILES), F32)
        hidden = act.sparse_input(hidden, t0[act.DOWN])
        q_rows[act.GATE_UP], q_rows[act.DOWN] = magnitude_quantiles(ys), magnitude_quantiles(
            hidden)
        linear = lp.post_mlp_norm_scale is None

        def mlp_at(site, t):
            if site in (act.GATE, act.DOWN) and linear:  # minus the rows that are dropped
                by = gate_mag if site == act.GATE else hidden
                dropped = jnp.where(jnp.abs(by) > t, 0.0, hidden)
                return base_mlp - jnp.einsum("...f,fd->...d", dropped, lp.w_out_t.astype(F32))
            return mlp(raised(site, t))

        for site in (act.GATE_UP, act.GATE, act.DOWN):
            if (site == act.GATE and gate is None) or not levels:
                err_rows[site] = jnp.zeros((3, len(levels)), F32)
                continue
            err_rows[site] = jnp.stack([jnp.stack(_sublayer_error(
                mlp_at(site, q_rows[site][lq]), base_mlp, h, grad[1], valid))
                for lq in level_q], -1)
        out = h + base_mlp if config.pre_norm else ops.norm(
            h + base_mlp, lp.mlp_norm_scale, lp.mlp_norm_bias, eps)
        return out, (jnp.stack(q_rows), jnp.stack(err_rows))

    x = embed(config, params, ids, positions)
    n = config.n_layers
    _, (q, errors) = jax.lax.scan(layer, x, (params.layers, jnp.arange(n, dtype=jnp.int32),
                                             jnp.moveaxis(grads, 0, 1), base))
    return {"quantiles": q, "errors": errors[:, :, 0], "nll_first": errors[:, :, 1],
            "nll_second": errors[:, :, 2]}


def thresholds_at(quantiles: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Thresholds [L, len(SITES)] that drop fractions `levels` [L, len(SITES)] of each
    site's channels, interpolated in the quantile table [L, len(SITES), len(QUANTILES)];
    level 0 gives threshold 0 (the dense computation)."""
    quantiles, levels = np.asarray(quantiles, np.float64), np.asarray(levels, np.float64)
    out = np.zeros(levels.shape, np.float32)
    for l in range(levels.shape[0]):
        for s in range(levels.shape[1]):
            if levels[l, s] > 0:
                out[l, s] = np.interp(levels[l, s], QUANTILES, quantiles[l, s])
    return out


def merge_stats(parts: list[dict], weights: list[float]) -> dict:
    """Calibration stats of several batches as one: quantiles and errors averaged with
    `weights` (the batches' token counts)."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    return {k: sum(wi * np.asarray(p[k], np.float64) for wi, p in zip(w, parts))
            for k in parts[0]}


@functools.partial(jax.jit, static_argnames=("config",))
def up_magnitude_sums(config: ModelConfig, params: ModelParams, ids: jax.Array,
                      mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of |up_i| [L, F] over the valid positions of the windows [B, T], their count),
    the model running dense: the up projection's magnitudes the gate site's weights need."""
    B, T = ids.shape
    positions = positions_from_mask(mask)
    valid = (mask.astype(bool) & (jnp.arange(T) >= 1)[None]).astype(F32)

    def layer(x, inputs):
        lp, index = inputs
        sums = []

        def attn(y):
            return sequence_attention(config, lp, y, positions, mask, index)[0]

        def mlp(y):
            up = ops.add_bias(ops.up_projection(lp, y), lp.b_in)
            sums.append(jnp.einsum("bt,btf->f", valid, jnp.abs(up.astype(F32))))
            gate = ops.activation(config.activation, ops.gate_projection(lp, y))
            return ops.mlp_output(lp, gate * up)

        h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                         lp.post_attn_norm_scale)
        out = ops.residual(config, h, mlp, lp.mlp_norm_scale, lp.mlp_norm_bias,
                           lp.post_mlp_norm_scale)
        return out, sums[0]

    x = embed(config, params, ids, positions)
    index = jnp.arange(config.n_layers, dtype=jnp.int32)
    _, sums = jax.lax.scan(layer, x, (params.layers, index))
    return sums, jnp.sum(valid)


def gate_weights(config: ModelConfig, params: ModelParams, windows: np.ndarray,
                 rows: int = 4) -> np.ndarray:
    """The gate site's per-neuron weights [L, F] (float32): E|up_i| on the windows [n, T]
    (dense) times the norm of neuron i's down-projection row, scaled to a mean of 1 in each
    layer and kept within [1e-4, 1e4] of it (a profile stores them as float16).
    |act(gate_i)| times this estimates neuron i's contribution to the MLP output."""
    if not config.gated_mlp:
        raise ValueError(f"gate weights need a gated MLP; {config.name} has none")
    total, count = 0.0, 0.0
    for i in range(0, len(windows), rows):
        batch = jnp.asarray(windows[i:i + rows])
        s, n = up_magnitude_sums(config, params, batch, jnp.ones_like(batch))
        total, count = total + np.asarray(s, np.float64), count + float(n)
    down = np.linalg.norm(np.asarray(params.layers.w_out_t, np.float32), axis=-1)
    w = total / max(count, 1.0) * down
    w = w / np.maximum(w.mean(-1, keepdims=True), 1e-30)
    return np.clip(w, 1e-4, 1e4).astype(np.float32)
