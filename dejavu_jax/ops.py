"""Small numerical building blocks shared by the dense and sparse paths."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax.config import ModelConfig

F32 = jnp.float32
MASK_VALUE = -1e30


def norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    """LayerNorm when `bias` is given, RMSNorm when it is None. Computed in fp32."""
    from dejavu_jax.kernels.layer_norm import layer_norm_reference
    return layer_norm_reference(x, scale, bias, eps)


def norm_input(x: jax.Array, scale: jax.Array, bias: jax.Array | None,
               eps: float) -> jax.Array:
    """`norm(x)` as a sublayer's input. On GPU one fused launch (`kernels.layer_norm`)
    whose result is already in the norm weights' dtype, the dtype every consumer casts
    it to; elsewhere `norm` in fp32."""
    from dejavu_jax.kernels._common import resolve_impl
    from dejavu_jax.kernels.layer_norm import layer_norm
    if resolve_impl(None) != "pallas":
        return norm(x, scale, bias, eps)
    return layer_norm(x, scale, bias, eps, out_dtype=scale.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    """The named elementwise nonlinearity."""
    if name == "relu":
        return jax.nn.relu(x)
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"unknown activation {name!r}")


def rows_matmul(x: jax.Array, w_rows: jax.Array) -> jax.Array:
    """x [..., d] times a row-major weight [n, d] (a torch Linear weight): [..., n] fp32."""
    return jnp.einsum("...d,nd->...n", x.astype(w_rows.dtype), w_rows,
                      preferred_element_type=F32)


def add_bias(x: jax.Array, b: jax.Array | None) -> jax.Array:
    """x + b, or x when there is no bias."""
    return x if b is None else x + b.astype(F32)


def llama3_inverse_frequencies(inv_freq: jax.Array, factor: float, low_freq_factor: float,
                               high_freq_factor: float, original_positions: float):
    """Llama 3's RoPE scaling: wavelengths longer than original_positions / low_freq_factor
    are stretched by `factor`, those shorter than original_positions / high_freq_factor kept,
    and those between interpolated."""
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original_positions / wavelength - low_freq_factor)
              / (high_freq_factor - low_freq_factor))
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelength > original_positions / low_freq_factor, inv_freq / factor,
                     jnp.where(wavelength < original_positions / high_freq_factor, inv_freq,
                               between))


def yarn_inverse_frequencies(inv_freq: jax.Array, head_dim: int, theta: float, factor: float,
                             beta_fast: float, beta_slow: float, original_positions: float,
                             truncate: float) -> jax.Array:
    """YaRN's frequencies: a frequency turning more than beta_fast times over
    original_positions is kept, one turning fewer than beta_slow times divided by
    `factor`, and a linear ramp over the frequency index between the two."""
    def index_of(turns: float) -> float:   # the frequency index turning `turns` times
        return (head_dim * math.log(original_positions / (turns * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = index_of(beta_fast), index_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=F32) - low) / (high - low), 0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Where each of our head dimensions comes from in the checkpoint's head for RoPE on
    its first `rotary_dim` dimensions: (first rotary half, first pass half, second rotary
    half, second pass half), so that the rotary pairs (i, i + rotary_dim / 2) sit
    head_dim / 2 apart, as rotating halves of the whole head pairs them."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate([np.arange(r), 2 * r + np.arange(p), r + np.arange(r),
                           2 * r + p + np.arange(p)])


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                linear_factor: float = 1.0, llama3=None, yarn=None, longrope=None,
                long_factors=False, rotary_dim=None):
    """cos and sin tables [..., head_dim] for integer positions (HF Llama convention);
    linear_factor > 1 divides the positions (linear RoPE scaling); llama3, Llama 3's
    scaling settings (`ModelConfig.rope_llama3`), rescales the frequencies; yarn
    (`ModelConfig.rope_yarn`) rescales them and multiplies both tables by its
    attention factor; longrope (`ModelConfig.rope_longrope`) divides each frequency by
    its short factor, or its long one where `long_factors` (a bool, may be traced), and
    multiplies both tables by its attention factor. rotary_dim < head_dim: the
    frequencies of a rotary_dim-wide RoPE, laid out as `rotary_order` orders the head,
    with cos 1 and sin 0 on the dimensions that pass unrotated."""
    full_width = head_dim
    head_dim = rotary_dim or head_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim))
    attention_factor = None
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    if llama3 is not None:
        inv_freq = llama3_inverse_frequencies(inv_freq, *llama3)
    if yarn is not None:
        factor, attention_factor, *ramp = yarn
        inv_freq = yarn_inverse_frequencies(inv_freq, head_dim, theta, factor, *ramp)
    if longrope is not None:
        attention_factor, _, *factors = longrope
        half = head_dim // 2
        inv_freq = inv_freq / jnp.where(long_factors, jnp.asarray(factors[half:], F32),
                                        jnp.asarray(factors[:half], F32))
    angles = positions.astype(F32)[..., None] * inv_freq
    scale = 1.0 if attention_factor is None else attention_factor
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    if head_dim < full_width:   # the pass dimensions: cos 1, sin 0 (unscaled)
        rest = (full_width - head_dim) // 2
        cos = jnp.concatenate([cos, jnp.ones(cos.shape[:-1] + (rest,), F32)], axis=-1)
        sin = jnp.concatenate([sin, jnp.zeros(sin.shape[:-1] + (rest,), F32)], axis=-1)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [..., heads, head_dim] by tables [..., head_dim] (rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def is_sliding(config: ModelConfig, layer):
    """Whether `layer` attends over a sliding window: a Python bool for a Python int layer,
    a traced bool for a traced one."""
    if not config.has_sliding_layers:
        return False
    if isinstance(layer, int):
        return config.sliding_layers[layer]
    if layer is None:
        raise ValueError(f"model {config.name!r} has sliding layers: pass the layer index")
    return jnp.asarray(config.sliding_layers)[layer]


def step_rope_tables(config: ModelConfig, positions: jax.Array, length=None):
    """(full-attention layers' cos and sin tables, sliding layers' or None), each
    [..., head_dim]: every kind of layer's tables at `positions`, for a step to compute
    once and each layer to pick from (`pick_rope_tables`). Sliding layers use
    `rope_local_theta`, full-attention layers `rope_theta` and `rope_linear_factor`.
    length: the sequence length (may be traced) that picks LongRoPE's factors, the long
    ones past the original context (default: the largest position + 1, as transformers
    takes it)."""
    long_factors = False
    if config.rope_longrope is not None:
        if length is None:
            length = jnp.max(positions) + 1
        long_factors = length > config.rope_longrope[1]
    full = rope_tables(positions, config.head_dim, config.rope_theta, config.rope_linear_factor,
                       config.rope_llama3, config.rope_yarn, config.rope_longrope,
                       long_factors, config.rotary_dim)
    if config.rope_local_theta is None or not config.has_sliding_layers:
        return full, None
    return full, rope_tables(positions, config.head_dim, config.rope_local_theta,
                             rotary_dim=config.rotary_dim)


def pick_rope_tables(config: ModelConfig, tables, layer=None):
    """`layer`'s cos and sin tables out of `step_rope_tables`' pair (a traced layer
    selects between them on the device)."""
    full, local = tables
    if local is None:
        return full
    sliding = is_sliding(config, layer)
    if sliding is False:
        return full
    if sliding is True:
        return local
    return tuple(jnp.where(sliding, lo, fu) for lo, fu in zip(local, full))


def layer_rope_tables(config: ModelConfig, positions: jax.Array, layer=None, length=None):
    """cos and sin tables [..., head_dim] of `layer` at `positions` (`step_rope_tables`,
    `pick_rope_tables`)."""
    return pick_rope_tables(config, step_rope_tables(config, positions, length), layer)


def window_mask(config: ModelConfig, layer, query_pos: jax.Array, key_pos: jax.Array):
    """Which keys a query may see under `layer`'s sliding window (those fewer than
    `sliding_window` positions back), broadcast as query_pos[..., None] against key_pos;
    None when the model has no sliding layer. Full-attention layers allow every key."""
    if not config.has_sliding_layers:
        return None
    within = (query_pos[..., None] - key_pos) < config.sliding_window
    sliding = is_sliding(config, layer)
    if sliding is True or sliding is False:
        return within if sliding else jnp.ones_like(within)
    return within | jnp.logical_not(sliding)


def project_qkv(config: ModelConfig, lp, y: jax.Array, positions: jax.Array, layer=None):
    """Queries, keys and values for inputs y [..., d] at `positions` [...].

    Returns q [..., H, hd] already scaled by `config.attention_scale`, and k, v
    [..., Hk, hd], fp32. `layer` (an int or a traced index) picks the RoPE base of models
    with sliding layers.
    """
    def project(w):
        return jnp.einsum("...d,hkd->...hk", y.astype(w.dtype), w, preferred_element_type=F32)

    H, Hk = config.n_heads, config.n_kv_heads
    if lp.wqkv_t is not None:  # `params.input_major`
        qkv = jnp.einsum("...d,dn->...n", y.astype(lp.wqkv_t.dtype), lp.wqkv_t,
                         preferred_element_type=F32)
        return finish_qkv(config, lp, qkv, positions, layer)
    if lp.wqkv is not None:  # `params.fuse_qkv`: one GEMV
        q, k, v = jnp.split(project(lp.wqkv), [H, H + Hk], axis=-2)
    else:
        q, k, v = project(lp.wq), project(lp.wk), project(lp.wv)
    return _finish(config, lp, q, k, v, positions, layer)


def finish_qkv(config: ModelConfig, lp, qkv: jax.Array, positions: jax.Array, layer=None):
    """`project_qkv` from the raw projections qkv [..., (H + 2 Hk) * hd] fp32 (q's heads,
    then k's, then v's): biases, q/k norms, RoPE and the query scale."""
    H, Hk, hd = config.n_heads, config.n_kv_heads, config.head_dim
    qkv = qkv.reshape(*qkv.shape[:-1], H + 2 * Hk, hd)
    q, k, v = jnp.split(qkv, [H, H + Hk], axis=-2)
    return _finish(config, lp, q, k, v, positions, layer)


def _finish(config, lp, q, k, v, positions, layer):
    q, k, v = add_bias(q, lp.bq), add_bias(k, lp.bk), add_bias(v, lp.bv)
    if config.qk_norm:
        q = norm(q, lp.q_norm_scale, None, config.norm_eps)
        k = norm(k, lp.k_norm_scale, None, config.norm_eps)
    if config.rotary:
        cos, sin = layer_rope_tables(config, positions, layer)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
    return q * config.attention_scale, k, v


def out_project(lp, heads_out: jax.Array) -> jax.Array:
    """Attention heads' outputs [..., H, hd] through the per-head out-projection: [..., d]."""
    if lp.wo_t is not None:  # `params.input_major`
        flat = heads_out.reshape(*heads_out.shape[:-2], -1)
        out = jnp.einsum("...n,nd->...d", flat.astype(lp.wo_t.dtype), lp.wo_t,
                         preferred_element_type=F32)
    else:
        out = jnp.einsum("...hk,dhk->...d", heads_out.astype(lp.wo.dtype), lp.wo,
                         preferred_element_type=F32)
    return add_bias(out, lp.bo)


def columns_matmul(x: jax.Array, w_cols: jax.Array) -> jax.Array:
    """x [..., d] times an input-major weight [d, n]: [..., n] fp32."""
    return jnp.einsum("...d,dn->...n", x.astype(w_cols.dtype), w_cols,
                      preferred_element_type=F32)


def up_projection(lp, y: jax.Array) -> jax.Array:
    """fc1 / the up projection of y [..., d], before any bias: [..., F] fp32."""
    return rows_matmul(y, lp.w_in) if lp.w_in is not None else columns_matmul(y, lp.w_in_t)


def gate_projection(lp, y: jax.Array) -> jax.Array | None:
    """The gate projection of y [..., d] before its activation, or None (ungated MLPs)."""
    if lp.w_gate is not None:
        return rows_matmul(y, lp.w_gate)
    return None if lp.w_gate_t is None else columns_matmul(y, lp.w_gate_t)


def mlp_hidden(config: ModelConfig, lp, y: jax.Array) -> jax.Array:
    """The MLP's neuron activations [..., F] in fp32 (after the nonlinearity and gate)."""
    h = add_bias(up_projection(lp, y), lp.b_in)
    gate = gate_projection(lp, y)
    if gate is not None:
        return activation(config.activation, gate) * h
    return activation(config.activation, h)


def mlp_output(lp, hidden: jax.Array) -> jax.Array:
    """Neuron activations [..., F] through fc2 (stored transposed, [F, d]): [..., d]."""
    out = jnp.einsum("...f,fd->...d", hidden.astype(lp.w_out_t.dtype), lp.w_out_t,
                     preferred_element_type=F32)
    return add_bias(out, lp.b_out)


def mlp(config: ModelConfig, lp, y: jax.Array) -> jax.Array:
    """The dense MLP block on normed inputs y [..., d]."""
    return mlp_output(lp, mlp_hidden(config, lp, y))


def residual(config: ModelConfig, x: jax.Array, sublayer, scale, bias,
             post_scale=None) -> jax.Array:
    """Pre-norm `x + f(norm(x))` or post-norm `norm(x + f(x))`, per the config; with
    `post_scale` (Gemma's post-norms) `x + norm'(f(norm(x)))`."""
    if config.pre_norm:
        out = sublayer(norm_input(x, scale, bias, config.norm_eps))
        if post_scale is not None:
            out = norm(out, post_scale, None, config.norm_eps)
        return x + out
    return norm(x + sublayer(x), scale, bias, config.norm_eps)


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap), or the logits when cap is None."""
    from dejavu_jax.kernels._common import soft_cap
    return soft_cap(logits, cap)


def attention_weights(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis of fp32 scores, with masked entries excluded."""
    scores = jnp.where(mask, scores, MASK_VALUE)
    return jax.nn.softmax(scores, axis=-1)
