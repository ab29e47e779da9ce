"""Small numerical building blocks shared by the dense and sparse paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    raise ValueError(f"unknown activation {name!r}")


def rows_matmul(x: jax.Array, w_rows: jax.Array) -> jax.Array:
    """x [..., d] times a row-major weight [n, d] (a torch Linear weight): [..., n] fp32."""
    return jnp.einsum("...d,nd->...n", x.astype(w_rows.dtype), w_rows,
                      preferred_element_type=F32)


def add_bias(x: jax.Array, b: jax.Array | None) -> jax.Array:
    """x + b, or x when there is no bias."""
    return x if b is None else x + b.astype(F32)


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos and sin tables [..., head_dim] for integer positions (HF Llama convention)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim))
    angles = positions.astype(F32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [..., heads, head_dim] by tables [..., head_dim] (rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def project_qkv(config: ModelConfig, lp, y: jax.Array, positions: jax.Array):
    """Queries, keys and values for inputs y [..., d] at `positions` [...].

    Returns q [..., H, hd] already scaled by hd^-0.5, and k, v [..., Hk, hd], fp32.
    """
    def project(w):
        return jnp.einsum("...d,hkd->...hk", y.astype(w.dtype), w, preferred_element_type=F32)

    if lp.wqkv is not None:  # `params.fuse_qkv`: one GEMV
        H, Hk = config.n_heads, config.n_kv_heads
        q, k, v = jnp.split(project(lp.wqkv), [H, H + Hk], axis=-2)
    else:
        q, k, v = project(lp.wq), project(lp.wk), project(lp.wv)
    q, k, v = add_bias(q, lp.bq), add_bias(k, lp.bk), add_bias(v, lp.bv)
    if config.family == "llama":
        cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
    return q * (config.head_dim ** -0.5), k, v


def out_project(lp, heads_out: jax.Array) -> jax.Array:
    """Attention heads' outputs [..., H, hd] through the per-head out-projection: [..., d]."""
    out = jnp.einsum("...hk,dhk->...d", heads_out.astype(lp.wo.dtype), lp.wo,
                     preferred_element_type=F32)
    return add_bias(out, lp.bo)


def mlp_hidden(config: ModelConfig, lp, y: jax.Array) -> jax.Array:
    """The MLP's neuron activations [..., F] in fp32 (after the nonlinearity and gate)."""
    h = add_bias(rows_matmul(y, lp.w_in), lp.b_in)
    if lp.w_gate is not None:
        return activation(config.activation, rows_matmul(y, lp.w_gate)) * h
    return activation(config.activation, h)


def mlp_output(lp, hidden: jax.Array) -> jax.Array:
    """Neuron activations [..., F] through fc2 (stored transposed, [F, d]): [..., d]."""
    out = jnp.einsum("...f,fd->...d", hidden.astype(lp.w_out_t.dtype), lp.w_out_t,
                     preferred_element_type=F32)
    return add_bias(out, lp.b_out)


def mlp(config: ModelConfig, lp, y: jax.Array) -> jax.Array:
    """The dense MLP block on normed inputs y [..., d]."""
    return mlp_output(lp, mlp_hidden(config, lp, y))


def residual(config: ModelConfig, x: jax.Array, sublayer, scale, bias) -> jax.Array:
    """Pre-norm `x + f(norm(x))` or post-norm `norm(x + f(x))`, per the config."""
    if config.pre_norm:
        return x + sublayer(norm_input(x, scale, bias, config.norm_eps))
    return norm(x + sublayer(x), scale, bias, config.norm_eps)


def attention_weights(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis of fp32 scores, with masked entries excluded."""
    scores = jnp.where(mask, scores, MASK_VALUE)
    return jax.nn.softmax(scores, axis=-1)
