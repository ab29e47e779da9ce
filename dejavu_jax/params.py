"""Weight pytrees in sparse-friendly layouts, stacked on a leading layer axis.

Layouts (L layers, H query heads, Hk KV heads, hd head dim, d hidden, F ffn):
  wq: [L, H, hd, d]       per-head rows
  wk, wv: [L, Hk, hd, d]
  wqkv: [L, H + 2 Hk, hd, d]   q, k and v rows in one array (`fuse_qkv`; dense decoding
                               only, wq/wk/wv are then None)
  wo: [L, d, H, hd]       out_proj.weight as stored ([d, H*hd]), its columns per head
  w_in, w_gate, w_out_t: [L, F, d]   one contiguous row per neuron (fc1, gate, fc2ᵀ)
Absent parts (biases of Llama, OPT's projections, a tied LM head) are None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dejavu_jax.config import ModelConfig


@struct.dataclass
class LayerParams:
    """One transformer block's weights; every leaf has a leading layer axis."""

    attn_norm_scale: jax.Array
    attn_norm_bias: jax.Array | None
    wq: jax.Array
    bq: jax.Array | None
    wk: jax.Array
    bk: jax.Array | None
    wv: jax.Array
    bv: jax.Array | None
    wo: jax.Array
    bo: jax.Array | None
    mlp_norm_scale: jax.Array
    mlp_norm_bias: jax.Array | None
    w_in: jax.Array
    b_in: jax.Array | None
    w_gate: jax.Array | None
    w_out_t: jax.Array
    b_out: jax.Array | None
    wqkv: jax.Array | None = None


@struct.dataclass
class ModelParams:
    """All weights of a model. `lm_head` is None when tied to `embed`."""

    embed: jax.Array
    pos_embed: jax.Array | None
    project_in: jax.Array | None
    project_out: jax.Array | None
    final_norm_scale: jax.Array | None
    final_norm_bias: jax.Array | None
    lm_head: jax.Array | None
    layers: LayerParams


OPT_POSITION_OFFSET = 2


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every LayerParams leaf (with the layer axis), None for absent leaves."""
    c = config
    L, H, Hk, hd, d, F = c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden, c.ffn
    layer_norm = c.family == "opt"
    return {
        "attn_norm_scale": (L, d),
        "attn_norm_bias": (L, d) if layer_norm else None,
        "wq": (L, H, hd, d),
        "bq": (L, H, hd) if c.attention_bias else None,
        "wk": (L, Hk, hd, d),
        "bk": (L, Hk, hd) if c.attention_bias else None,
        "wv": (L, Hk, hd, d),
        "bv": (L, Hk, hd) if c.attention_bias else None,
        "wo": (L, d, H, hd),
        "bo": (L, d) if c.attention_bias else None,
        "mlp_norm_scale": (L, d),
        "mlp_norm_bias": (L, d) if layer_norm else None,
        "w_in": (L, F, d),
        "b_in": (L, F) if c.mlp_bias else None,
        "w_gate": (L, F, d) if c.gated_mlp else None,
        "w_out_t": (L, F, d),
        "b_out": (L, d) if c.mlp_bias else None,
    }


def model_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every top-level ModelParams leaf, None for absent leaves."""
    c = config
    layer_norm = c.family == "opt"
    return {
        "embed": (c.vocab_size, c.embed_dim),
        "pos_embed": (c.max_positions + OPT_POSITION_OFFSET, c.hidden)
        if c.family == "opt" else None,
        "project_in": (c.hidden, c.embed_dim) if c.has_projections else None,
        "project_out": (c.embed_dim, c.hidden) if c.has_projections else None,
        "final_norm_scale": (c.hidden,) if c.final_norm else None,
        "final_norm_bias": (c.hidden,) if c.final_norm and layer_norm else None,
        "lm_head": None if c.tie_embeddings else (c.vocab_size, c.embed_dim),
    }


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16,
                std: float = 0.02) -> ModelParams:
    """Random weights for `config`: normal(0, std) matrices, norms near 1, small biases.

    Built under jit so that large presets are created on the device directly.
    """

    @jax.jit
    def build(key):
        leaves = {**model_shapes(config), **layer_shapes(config)}
        keys = dict(zip(leaves, jax.random.split(key, len(leaves))))
        out = {}
        for name, shape in leaves.items():
            if shape is None:
                out[name] = None
            elif "norm_scale" in name:
                out[name] = (1.0 + 0.1 * jax.random.normal(keys[name], shape)).astype(dtype)
            else:
                scale = std if len(shape) >= 2 and "norm" not in name else 0.1 * std
                if name in ("b_in",):
                    scale = std
                out[name] = (scale * jax.random.normal(keys[name], shape)).astype(dtype)
        layer_keys = layer_shapes(config).keys()
        layers = LayerParams(**{k: out.pop(k) for k in layer_keys})
        return ModelParams(layers=layers, **out)

    return build(key)


def param_count(params: ModelParams) -> int:
    """Number of scalars in a params pytree."""
    return sum(x.size for x in jax.tree.leaves(params))


def param_bytes(params: ModelParams) -> int:
    """Bytes of all weights in a params pytree."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def cast_params(params: ModelParams, dtype) -> ModelParams:
    """All floating weights converted to `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype), params)


def unstack_layers(params: ModelParams, free_stacked: bool = False) -> ModelParams:
    """The same weights with `layers` as a tuple of per-layer LayerParams.

    Layer loops then unroll in Python and every kernel reads a layer's own buffer;
    stacked weights run under `lax.scan`, whose per-layer slices XLA may copy.
    free_stacked: delete each stacked array once it is split, so the peak memory is the
    model plus one weight kind rather than two models (the caller's stacked params are
    unusable afterwards).
    """
    fields = [f.name for f in dataclasses.fields(LayerParams)]
    n = jax.tree.leaves(params.layers)[0].shape[0]
    per_layer = [dict() for _ in range(n)]
    for name in fields:
        stacked = getattr(params.layers, name)
        for i in range(n):
            per_layer[i][name] = None if stacked is None else stacked[i]
        if free_stacked and stacked is not None:
            jax.block_until_ready([d[name] for d in per_layer])
            stacked.delete()
    return params.replace(layers=tuple(LayerParams(**d) for d in per_layer))


def fuse_qkv(params: ModelParams, free_originals: bool = False) -> ModelParams:
    """The same model with each layer's q, k and v rows in one array (`wqkv`), so a dense
    decode step projects them in one GEMV instead of three; wq, wk and wv become None.

    For the dense paths only (the sparse kernels gather heads from wq/wk/wv, and
    tensor-parallel sharding splits them by head). The fused arrays are copies: while the
    caller keeps `params`, the q/k/v weights are held twice. free_originals: delete each
    layer's wq/wk/wv once its copy exists (the caller's `params` are unusable afterwards),
    so per-layer params grow the peak memory by one layer's q/k/v, stacked ones by all.
    """
    def fused(lp: LayerParams) -> LayerParams:
        if lp.wqkv is not None:
            return lp
        w = jnp.concatenate([lp.wq, lp.wk, lp.wv], axis=-3)
        if free_originals:
            jax.block_until_ready(w)
            for original in (lp.wq, lp.wk, lp.wv):
                original.delete()
        return lp.replace(wqkv=w, wq=None, wk=None, wv=None)

    if not isinstance(params.layers, tuple):
        return params.replace(layers=fused(params.layers))
    return params.replace(layers=tuple(fused(lp) for lp in params.layers))


def has_fused_qkv(params: ModelParams) -> bool:
    """Whether `fuse_qkv` has merged the q/k/v weights of these params."""
    layers = params.layers if isinstance(params.layers, tuple) else (params.layers,)
    return any(lp.wqkv is not None for lp in layers)


def scan_layers(body, carry, layers, with_index: bool = False):
    """`lax.scan(body, carry, layers)` over stacked layers, or a Python loop over a tuple
    of per-layer params (see `unstack_layers`); returns (carry, stacked ys).

    with_index: the body receives (layer params, layer index); the index is a traced int32
    under scan and a Python int in the loop, so per-layer tuples can be indexed with it.
    """
    if not isinstance(layers, tuple):
        if with_index:
            n = jax.tree.leaves(layers)[0].shape[0]
            return jax.lax.scan(body, carry, (layers, jnp.arange(n, dtype=jnp.int32)))
        return jax.lax.scan(body, carry, layers)
    ys = []
    for i, lp in enumerate(layers):
        carry, y = body(carry, (lp, i) if with_index else lp)
        ys.append(y)
    stacked = None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys)
    return carry, stacked


def layer_count(params: ModelParams) -> int:
    """Number of layers, stacked or unstacked."""
    if isinstance(params.layers, tuple):
        return len(params.layers)
    return jax.tree.leaves(params.layers)[0].shape[0]
