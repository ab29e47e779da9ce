"""Tensor-parallel layouts: a ("data", "tp") device mesh and logical-axis sharding rules.

Megatron layout over the "tp" axis:
  * attention split by head: wq, wo and their biases by query head, wk, wv by KV head,
    and the KV cache by KV head (a shard holds whole GQA groups);
  * MLP split by neuron: w_in, w_gate, w_out_t rows and b_in;
  * embeddings and the LM head split on the vocabulary (replicated when the vocabulary
    does not divide): the LM head is the largest matrix a decode step reads once per
    token, so splitting it divides its read time by tp for the cost of gathering
    [B, V] logits;
  * norms, residual-width biases (bo, b_out), OPT's position table and projections
    replicated (a few rows per token, or tiny).
The batch goes on "data". Each device then holds 1/tp of every large weight.

  mesh = make_mesh(tp=2)
  params = init_params_sharded(config, jax.random.key(0), jnp.bfloat16, mesh)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dejavu_jax.config import ModelConfig
from dejavu_jax.params import LayerParams, ModelParams, init_params

AXES = ("data", "tp")

# logical axis -> mesh axis; unlisted logical axes are replicated
RULES = {"batch": "data", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp"}
# logical axes that must divide evenly (the others fall back to replication)
STRICT = ("heads", "kv_heads", "mlp")

LAYER_AXES = {
    "attn_norm_scale": ("hidden",), "attn_norm_bias": ("hidden",),
    "wq": ("heads", "head_dim", "hidden"), "bq": ("heads", "head_dim"),
    "wk": ("kv_heads", "head_dim", "hidden"), "bk": ("kv_heads", "head_dim"),
    "wv": ("kv_heads", "head_dim", "hidden"), "bv": ("kv_heads", "head_dim"),
    "wo": ("hidden", "heads", "head_dim"), "bo": ("hidden",),
    "mlp_norm_scale": ("hidden",), "mlp_norm_bias": ("hidden",),
    "w_in": ("mlp", "hidden"), "b_in": ("mlp",), "w_gate": ("mlp", "hidden"),
    "w_out_t": ("mlp", "hidden"), "b_out": ("hidden",),
    "wqkv": None,  # fused q/k/v rows are not sharded (see _layer_specs)
    "wqkv_t": None, "wo_t": None,  # input-major copies run on one device (see _layer_specs)
    "w_gate_t": ("hidden", "mlp"), "w_in_t": ("hidden", "mlp"),
    "q_norm_scale": ("head_dim",), "k_norm_scale": ("head_dim",),
    "post_attn_norm_scale": ("hidden",), "post_mlp_norm_scale": ("hidden",),
    "gate_weight": ("mlp",),
}
TOP_AXES = {
    "embed": ("vocab", "embed_dim"), "lm_head": ("vocab", "embed_dim"),
    "pos_embed": ("position", "hidden"), "project_in": ("hidden", "embed_dim"),
    "project_out": ("embed_dim", "hidden"), "final_norm_scale": ("hidden",),
    "final_norm_bias": ("hidden",),
}
# decode state leaves; the cache is stacked [B, L, Hk, S, hd] or per layer [B, Hk, S, hd]
STATE_AXES = {
    "k": ("batch", "layer", "kv_heads", "seq", "head_dim"),
    "v": ("batch", "layer", "kv_heads", "seq", "head_dim"),
    "valid": ("batch", "seq"), "slot": (), "positions": ("batch",), "live": ("batch",),
    "written": ("batch", "layer", "kv_heads", "seq"),
    "history": ("batch", "layer", "window", "hidden"),
}


class ShardingError(ValueError):
    """A model does not split over the requested devices."""


def make_mesh(tp: int | None = None, data: int = 1, devices=None) -> Mesh:
    """A ("data", "tp") mesh over `devices` (default: all, tp = device count / data)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp is None:
        tp = len(devices) // data
    if tp < 1 or data < 1 or tp * data > len(devices):
        raise ShardingError(f"a mesh of data={data} x tp={tp} needs {data * tp} devices; "
                            f"{len(devices)} available")
    grid = np.array(devices[:data * tp], dtype=object).reshape(data, tp)
    return Mesh(grid, AXES)


def parse_mesh(text: str) -> dict[str, int]:
    """'tp=2' or 'data=2,tp=4' -> {'data': .., 'tp': ..} (a missing axis is 1)."""
    sizes = {"data": 1, "tp": 1}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad mesh {text!r}: expected e.g. 'tp=2' or 'data=2,tp=4'")
        sizes[name] = int(value)
    return sizes


def tp_size(mesh: Mesh) -> int:
    """Devices on the tensor-parallel axis."""
    return mesh.shape["tp"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise ShardingError unless `tp` divides the KV heads (hence the heads) and neurons."""
    for what, n in (("KV heads (n_kv_heads)", config.n_kv_heads),
                    ("attention heads (n_heads)", config.n_heads),
                    ("MLP neurons (ffn)", config.ffn)):
        if n % tp:
            ok = [k for k in _divisors(config.n_kv_heads) if config.ffn % k == 0]
            raise ShardingError(
                f"cannot split {config.name!r} over tp={tp} devices: its {what} = {n} is not "
                f"divisible by {tp}. Tensor parallelism gives every device whole KV-head "
                f"groups and an equal share of neurons; device counts that work: {ok}")


def _spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    out = []
    for axis, n in zip(axes, shape):
        target = RULES.get(axis)
        size = mesh.shape[target] if target else 1
        if target is None or size == 1:
            out.append(None)
        elif n % size == 0:
            out.append(target)
        elif axis in STRICT:
            raise ShardingError(f"axis {axis!r} of size {n} does not divide over "
                                f"{target}={size}")
        else:
            out.append(None)
    return P(*out)


def _leaf_spec(axes, leaf, mesh, stacked_axis="layer"):
    """Spec of one leaf; a leaf with one more dimension than `axes` has a leading layer axis,
    one with one fewer (a per-layer cache buffer) lacks the `stacked_axis`."""
    if leaf is None:
        return None
    shape = tuple(leaf.shape)
    if len(shape) == len(axes) + 1:
        axes = ("layer",) + tuple(axes)
    elif len(shape) == len(axes) - 1 and stacked_axis in axes:
        axes = tuple(a for a in axes if a != stacked_axis)
    return _spec(tuple(axes), shape, mesh)


def _layer_specs(lp: LayerParams, mesh: Mesh) -> LayerParams:
    if lp.wqkv is not None:
        raise ValueError("fused q/k/v weights (params.fuse_qkv) cannot be split by head; "
                         "shard the unfused params")
    if lp.wqkv_t is not None:
        raise ValueError("input-major weights (params.input_major, activation sparsity) run "
                         "on one device; shard the row-major params")
    return LayerParams(**{f.name: _leaf_spec(LAYER_AXES[f.name], getattr(lp, f.name), mesh)
                          for f in dataclasses.fields(LayerParams)})


def param_specs(params: ModelParams, mesh: Mesh) -> ModelParams:
    """A ModelParams of PartitionSpecs (None for absent leaves), stacked or unstacked layers.

    `params` may hold arrays or jax.ShapeDtypeStructs.
    """
    layers = params.layers
    layer_specs = (tuple(_layer_specs(lp, mesh) for lp in layers) if isinstance(layers, tuple)
                   else _layer_specs(layers, mesh))
    top = {name: _leaf_spec(axes, getattr(params, name), mesh) for name, axes in TOP_AXES.items()}
    return ModelParams(layers=layer_specs, **top)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def named(specs, mesh: Mesh):
    """PartitionSpecs -> NamedShardings on `mesh` (same tree)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def param_shardings(params: ModelParams, mesh: Mesh) -> ModelParams:
    """A ModelParams of NamedShardings for `params` (arrays or shape structs)."""
    return named(param_specs(params, mesh), mesh)


def shard_params(params: ModelParams, mesh: Mesh) -> ModelParams:
    """Place existing weights into the tensor-parallel layout."""
    return jax.device_put(params, param_shardings(params, mesh))


def init_params_sharded(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16,
                        mesh: Mesh | None = None, std: float = 0.02) -> ModelParams:
    """`init_params`, built under jit with out_shardings: every device creates only its own
    shard (the full model is never materialised on one device). The values equal
    `init_params(config, key, dtype, std)` (partitionable threefry)."""
    mesh = mesh or make_mesh()
    check_tp(config, tp_size(mesh))

    def build(key):
        return init_params(config, key, dtype, std)

    shapes = jax.eval_shape(build, key)
    return jax.jit(build, out_shardings=param_shardings(shapes, mesh))(key)


def state_specs(state, mesh: Mesh):
    """PartitionSpecs for a DecodeState or SparseState (cache split by KV head, batch on
    "data"); tuples of per-layer cache buffers are handled."""

    def spec(path, leaf):
        name = next((k.name for k in reversed(path) if hasattr(k, "name")), None)
        if name not in STATE_AXES:
            raise ValueError(f"no sharding rule for decode-state leaf {jax.tree_util.keystr(path)}")
        return _leaf_spec(STATE_AXES[name], leaf, mesh)

    return jax.tree_util.tree_map_with_path(spec, state)


def state_shardings(state, mesh: Mesh):
    """NamedShardings for a decode state (see `state_specs`)."""
    return named(state_specs(state, mesh), mesh)


def constrain_state(state, mesh: Mesh):
    """`with_sharding_constraint` of a decode state to its layout (inside jit)."""
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


def predictor_specs(pred_params, mesh: Mesh):
    """Specs for PredictorParams (or DecodePredictors): the output layer (w2 columns, b2) split by neuron / head
    like the model, the input normalisation and w1 replicated. Then each device scores its
    own units with no communication."""
    from dejavu_jax.train.predictor_model import DecodePredictors, Predictor
    if isinstance(pred_params, DecodePredictors):
        return DecodePredictors(
            w1t=P(), b1=P(),
            w2_mlp=_spec(("layer", "rank", "mlp"), pred_params.w2_mlp.shape, mesh),
            b2_mlp=_spec(("layer", "mlp"), pred_params.b2_mlp.shape, mesh),
            w2_heads=_spec(("layer", "rank", "mlp"), pred_params.w2_heads.shape, mesh),
            b2_heads=_spec(("layer", "mlp"), pred_params.b2_heads.shape, mesh),
            activation=pred_params.activation)

    def one(p: Predictor) -> Predictor:
        return Predictor(mean=P(), inv_std=P(), w1=P(),
                         w2=_spec(("layer", "rank", "mlp"), p.w2.shape, mesh),
                         b2=_spec(("layer", "mlp"), p.b2.shape, mesh))

    return pred_params.replace(mlp=one(pred_params.mlp), heads=one(pred_params.heads))


def replicated_leaves(tree, min_size: int = 0) -> list[str]:
    """Paths of array leaves with at least `min_size` elements stored whole on every device
    (for checks that no large weight is replicated by accident)."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if leaf.size >= min_size and leaf.sharding.is_fully_replicated:
            out.append(jax.tree_util.keystr(path))
    return out
