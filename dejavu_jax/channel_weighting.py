"""Weight-informed channel magnitudes for activation sparsity, as an exact change of
variables.

A threshold site keeps input channel i of a matmul W when |x_i| passes the threshold. The
error of dropping it is x_i times W's i-th input column, so |x_i| · ||W[:, i]|| ranks
channels by what dropping them costs (WINA's criterion) where |x_i| alone ignores the
weights. Rather than carrying per-channel factors into every kernel, `weight_informed`
rescales the model so that the factors are part of the activations: x_i is multiplied by
n_i = ||W[:, i]|| and W's column divided by it, which leaves every product, and so the
dense model, unchanged. Thresholding the new activations is the weighted criterion.

Per site (channels and where the factor goes):
  qkv      normed input [d]: the attention norm's scale (and bias) times n, the q/k/v
           columns divided (pre-norm models only: otherwise the input is the residual)
  o        per-head outputs [H, hd]: the v rows (and bias) times n, the out-projection's
           columns divided; with grouped-query attention a KV group's channel serves G
           query heads, so n is the root mean square of their columns' norms
  gate_up  MLP norm output [d]: as qkv, for the gate and up columns (pre-norm only)
  down     neuron activations [F]: the up rows (and bias) times n, the down rows divided
           (gated MLPs, and ReLU, which commutes with a positive factor)
The gate site (|act(gate)|) passes through a nonlinearity and is left as it is. Each n
is divided by its root mean square, so activations keep their scale.
"""

from __future__ import annotations

import jax.numpy as jnp

from dejavu_jax.config import ModelConfig
from dejavu_jax.params import ModelParams

F32 = jnp.float32
WEIGHTINGS = ("none", "weight-norm")


def _unit_rms(n: jnp.ndarray) -> jnp.ndarray:
    n = jnp.maximum(n, 1e-12)
    return n / jnp.sqrt(jnp.mean(n ** 2, axis=-1, keepdims=True))


def channel_norms(config: ModelConfig, params: ModelParams) -> dict[str, jnp.ndarray | None]:
    """The factors n of each site (module docstring), fp32, normalised to unit RMS:
    {"qkv": [L, d], "o": [L, Hk, hd], "gate_up": [L, d], "down": [L, F]}; None where the
    site cannot be rescaled exactly."""
    lp = params.layers
    if isinstance(lp, tuple):
        raise ValueError("channel_norms needs stacked layers (before unstack_layers)")
    if lp.wq is None or lp.w_in is None:
        raise ValueError("channel_norms needs the row-major q/k/v and up weights (before "
                         "fuse_qkv or input_major)")
    L, Hk, hd = config.n_layers, config.n_kv_heads, config.head_dim
    G = config.n_heads // Hk

    def sq(w, axes):
        return jnp.sum(jnp.square(w.astype(F32)), axis=axes)

    out: dict[str, jnp.ndarray | None] = {"qkv": None, "gate_up": None, "down": None}
    if config.pre_norm:
        out["qkv"] = _unit_rms(jnp.sqrt(sq(lp.wq, (1, 2)) + sq(lp.wk, (1, 2))
                                        + sq(lp.wv, (1, 2))))
        gate = 0.0 if lp.w_gate is None else sq(lp.w_gate, 1)
        out["gate_up"] = _unit_rms(jnp.sqrt(sq(lp.w_in, 1) + gate))
    per_head = sq(lp.wo, 1).reshape(L, Hk, G, hd)  # ||wo[:, h, k]||^2
    o = jnp.sqrt(jnp.mean(per_head, axis=2))
    out["o"] = _unit_rms(o.reshape(L, Hk * hd)).reshape(L, Hk, hd)
    if config.gated_mlp or config.activation == "relu":
        out["down"] = _unit_rms(jnp.sqrt(sq(lp.w_out_t, 2)))
    return out


def weight_informed(config: ModelConfig, params: ModelParams) -> ModelParams:
    """The same model (equal outputs up to rounding) with each threshold site's channels
    scaled by their weights' norms (`channel_norms`), so that thresholds on magnitudes
    rank channels by |x_i| · ||W[:, i]||. Each weight keeps its dtype; the arithmetic is
    fp32. Needs stacked, row-major params as loaded."""
    n = channel_norms(config, params)
    lp = params.layers
    G = config.n_heads // config.n_kv_heads

    def scaled(w, factor):
        return None if w is None else (w.astype(F32) * factor).astype(w.dtype)

    new = {}
    attn_scale, attn_bias = lp.attn_norm_scale, lp.attn_norm_bias
    wq, wk, wv, bv, wo = lp.wq, lp.wk, lp.wv, lp.bv, lp.wo
    mlp_scale, mlp_bias = lp.mlp_norm_scale, lp.mlp_norm_bias
    w_in, b_in, w_gate, w_out_t = lp.w_in, lp.b_in, lp.w_gate, lp.w_out_t
    if n["qkv"] is not None:
        q = n["qkv"]
        attn_scale, attn_bias = scaled(attn_scale, q), scaled(attn_bias, q)
        inv = (1.0 / q)[:, None, None, :]
        wq, wk, wv = scaled(wq, inv), scaled(wk, inv), scaled(wv, inv)
    o = n["o"]  # [L, Hk, hd]
    wv, bv = scaled(wv, o[..., None]), scaled(bv, o)
    wo = scaled(wo, (1.0 / jnp.repeat(o, G, axis=1))[:, None])
    if n["gate_up"] is not None:
        g = n["gate_up"]
        mlp_scale, mlp_bias = scaled(mlp_scale, g), scaled(mlp_bias, g)
        w_in, w_gate = scaled(w_in, (1.0 / g)[:, None, :]), scaled(w_gate, (1.0 / g)[:, None, :])
    if n["down"] is not None:
        dn = n["down"]
        w_in, b_in = scaled(w_in, dn[..., None]), scaled(b_in, dn)
        w_out_t = scaled(w_out_t, (1.0 / dn)[..., None])
    new.update(attn_norm_scale=attn_scale, attn_norm_bias=attn_bias, wq=wq, wk=wk, wv=wv,
               bv=bv, wo=wo, mlp_norm_scale=mlp_scale, mlp_norm_bias=mlp_bias, w_in=w_in,
               b_in=b_in, w_gate=w_gate, w_out_t=w_out_t)
    return params.replace(layers=lp.replace(**new))


def apply_weighting(config: ModelConfig, params: ModelParams, weighting: str) -> ModelParams:
    """params under a profile's `weighting` (WEIGHTINGS): unchanged for "none"."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown channel weighting {weighting!r}; known: "
                         f"{', '.join(WEIGHTINGS)}")
    return params if weighting == "none" else weight_informed(config, params)
