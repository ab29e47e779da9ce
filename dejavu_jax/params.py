"""Weight pytrees in sparse-friendly layouts, stacked on a leading layer axis.

Layouts (L layers, H query heads, Hk KV heads, hd head dim, d hidden, F ffn):
  wq: [L, H, hd, d]       per-head rows
  wk, wv: [L, Hk, hd, d]
  wqkv: [L, H + 2 Hk, hd, d]   q, k and v rows in one array (`fuse_qkv`; dense decoding
                               only, wq/wk/wv are then None)
  wo: [L, d, H, hd]       out_proj.weight as stored ([d, H*hd]), its columns per head
  w_in, w_gate, w_out_t: [L, F, d]   one contiguous row per neuron (fc1, gate, fc2ᵀ)
  wqkv_t: [L, d, (H + 2 Hk) hd], wo_t: [L, H hd, d], w_gate_t, w_in_t: [L, d, F]
                          input-major copies for activation sparsity (`input_major`): one
                          contiguous row per input channel; the row-major arrays they
                          replace are then None
  q_norm_scale, k_norm_scale: [L, hd]   per-head RMSNorm weights (`config.qk_norm`)
  post_attn_norm_scale, post_mlp_norm_scale: [L, d]   sublayer output norms
                                                      (`config.post_norms`)
  gate_weight: [L, F]     a sparsity profile's per-neuron factors of the gate site's
                          ranking (`activation_sparsity.gate_magnitude`); None: |act(gate)|
Absent parts (biases of Llama, OPT's projections, a tied LM head) are None.
Norm scales are the factors the norms multiply by: Gemma's checkpoints store w for a
factor of 1 + w, and the loaders add the 1.
"""

from __future__ import annotations

import dataclasses
import functools

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
    wqkv_t: jax.Array | None = None
    wo_t: jax.Array | None = None
    w_gate_t: jax.Array | None = None
    w_in_t: jax.Array | None = None
    q_norm_scale: jax.Array | None = None
    k_norm_scale: jax.Array | None = None
    post_attn_norm_scale: jax.Array | None = None
    post_mlp_norm_scale: jax.Array | None = None
    gate_weight: jax.Array | None = None


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
    layer_norm = c.layer_norm
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
        "bo": (L, d) if c.out_bias else None,
        "mlp_norm_scale": (L, d),
        "mlp_norm_bias": (L, d) if layer_norm else None,
        "w_in": (L, F, d),
        "b_in": (L, F) if c.mlp_bias else None,
        "w_gate": (L, F, d) if c.gated_mlp else None,
        "w_out_t": (L, F, d),
        "b_out": (L, d) if c.mlp_bias else None,
        "q_norm_scale": (L, hd) if c.qk_norm else None,
        "k_norm_scale": (L, hd) if c.qk_norm else None,
        "post_attn_norm_scale": (L, d) if c.post_norms else None,
        "post_mlp_norm_scale": (L, d) if c.post_norms else None,
    }


def model_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every top-level ModelParams leaf, None for absent leaves."""
    c = config
    layer_norm = c.layer_norm
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


def check_fits(config: ModelConfig, params: ModelParams) -> None:
    """ValueError naming the first weight whose shape is not `config`'s (the embedding, the
    layer count, each layer's weights, stacked or per layer): params made for another
    model are refused here, not deep inside the forward."""
    def refuse(what, got, want):
        raise ValueError(f"the params do not fit {config.name}: {what} has shape {got}, "
                         f"the config gives {want}")

    for name, shape in model_shapes(config).items():
        got = getattr(params, name)
        if shape is not None and got is not None and tuple(got.shape) != shape:
            refuse(name, tuple(got.shape), shape)
    layers = params.layers
    per_layer = isinstance(layers, tuple)
    n = len(layers) if per_layer else jax.tree.leaves(layers)[0].shape[0]
    if n != config.n_layers:
        raise ValueError(f"the params do not fit {config.name}: {n} layers, the config "
                         f"gives {config.n_layers}")
    first = layers[0] if per_layer else layers
    for name, shape in layer_shapes(config).items():
        got = getattr(first, name)
        want = None if shape is None else shape[1:] if per_layer else shape
        if want is not None and got is not None and tuple(got.shape) != want:
            refuse(f"layer weight {name}", tuple(got.shape), want)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale", "norm_scale"))
def _random_leaf(key: jax.Array, shape: tuple[int, ...], dtype, scale: float,
                 norm_scale: bool) -> jax.Array:
    """normal(0, scale) of `shape`, or 1 + normal(0, 0.1) for a norm scale, as `dtype`; one
    compile per shape, dtype and scale, shared by every config."""
    x = jax.random.normal(key, shape)
    return ((1.0 + 0.1 * x) if norm_scale else (scale * x)).astype(dtype)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16,
                std: float = 0.02) -> ModelParams:
    """Random weights for `config`: normal(0, std) matrices, norms near 1, small biases.

    Each leaf is built under jit, so that large presets are created on the device directly.
    """
    leaves = {**model_shapes(config), **layer_shapes(config)}
    keys = dict(zip(leaves, jax.random.split(key, len(leaves))))
    out = {}
    for name, shape in leaves.items():
        if shape is None:
            out[name] = None
            continue
        scale = std if len(shape) >= 2 and "norm" not in name else 0.1 * std
        if name in ("b_in",):
            scale = std
        out[name] = _random_leaf(keys[name], shape, jnp.dtype(dtype), float(scale),
                                 "norm_scale" in name)
    layers = LayerParams(**{k: out.pop(k) for k in layer_shapes(config).keys()})
    return ModelParams(layers=layers, **out)


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


def decode_layout(params: ModelParams, free_stacked: bool = False) -> ModelParams:
    """The weights in the layout whose decode step runs fastest on the default backend:
    per-layer buffers (`unstack_layers`) on a GPU, where the `lax.scan` over stacked
    weights hands each layer's kernels copied slices (docs/benchmarks.md gives the
    measured cost); unchanged on other backends. Already unstacked weights pass through."""
    import jax
    if jax.default_backend() != "gpu" or isinstance(params.layers, tuple):
        return params
    return unstack_layers(params, free_stacked=free_stacked)


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


def input_major(params: ModelParams, up_rows: bool = False,
                free_originals: bool = False) -> ModelParams:
    """The same model with the q/k/v, out-projection, gate and up weights stored input-
    major (`wqkv_t`, `wo_t`, `w_gate_t`, `w_in_t`), so that an input channel's weights are
    one contiguous row: the layout activation sparsity reads (`kernels.threshold_matvec`).
    The row-major arrays become None; with `up_rows` the up projection keeps its row-major
    `w_in` (the gate site reads whole rows of the neurons that pass it). fc2ᵀ is input-
    major already. free_originals: delete each replaced array once its copy exists."""
    def moved(lp: LayerParams) -> LayerParams:
        if lp.wqkv_t is not None:
            return lp
        if lp.wq is None:
            raise ValueError("input_major needs wq/wk/wv (not params.fuse_qkv's wqkv)")
        lead = lp.wq.shape[:-3]  # the layer axis, when stacked
        d = lp.wq.shape[-1]
        qkv = jnp.concatenate([lp.wq, lp.wk, lp.wv], axis=-3).reshape(*lead, -1, d)
        new = {"wqkv_t": jnp.swapaxes(qkv, -1, -2),
               "wo_t": jnp.swapaxes(lp.wo.reshape(*lead, d, -1), -1, -2),
               "w_gate_t": None if lp.w_gate is None else jnp.swapaxes(lp.w_gate, -1, -2),
               "w_in_t": None if up_rows else jnp.swapaxes(lp.w_in, -1, -2)}
        gone = ["wq", "wk", "wv", "wo", "w_gate"] + ([] if up_rows else ["w_in"])
        if free_originals:
            jax.block_until_ready([w for w in new.values() if w is not None])
            for name in gone:
                if getattr(lp, name) is not None:
                    getattr(lp, name).delete()
        return lp.replace(**new, **{name: None for name in gone})

    if not isinstance(params.layers, tuple):
        return params.replace(layers=moved(params.layers))
    return params.replace(layers=tuple(moved(lp) for lp in params.layers))


def with_gate_weights(params: ModelParams, weights) -> ModelParams:
    """`params` with the gate site's per-neuron weights [L, F] in their layers (stacked or
    per layer); None removes them."""
    w = None if weights is None else jnp.asarray(weights)
    if isinstance(params.layers, tuple):
        return params.replace(layers=tuple(
            lp.replace(gate_weight=None if w is None else w[i])
            for i, lp in enumerate(params.layers)))
    return params.replace(layers=params.layers.replace(gate_weight=w))


def is_input_major(params: ModelParams) -> bool:
    """Whether `input_major` has moved these params' weights."""
    layers = params.layers if isinstance(params.layers, tuple) else (params.layers,)
    return any(lp.wqkv_t is not None for lp in layers)


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
