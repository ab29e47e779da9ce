"""Tensor-parallel decode engines over a ("data", "tp") mesh (see `dejavu_jax.sharding`).

* Dense: the single-device `model` functions jitted with sharded weights and state; XLA's
  SPMD partitioner (GSPMD) inserts the collectives. Logits equal one device's.
* Sparse (DejaVu): embeddings and the LM head run under GSPMD as in the dense engine; the
  layers run under `jax.shard_map`, each device executing the single-device sparse layer
  code (`sparse.sparse_layers`) on its shard with a *local* config (n_heads / tp,
  n_kv_heads / tp, ffn / tp) and local k = ceil(global k / tp). Each device predicts and
  selects the top-k among its own heads and neurons (its predictor output columns are
  split like the model), so selection needs no communication. One psum per block: after
  the attention out-projection and after the MLP down-projection; the residual-width
  biases (bo, b_out) are added by the first shard only.

  mesh = sharding.make_mesh(tp=2)
  params = sharding.init_params_sharded(config, key, jnp.bfloat16, mesh)
  engine = tp_sparse_engine(config, scfg, sparse.predictor_selector(config.group_size), mesh)
  generate_tokens(engine, (params, shard_predictors(preds, mesh)), prompts)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dejavu_jax import model, sharding, sparse
from dejavu_jax.config import ModelConfig
from dejavu_jax.generation import Engine
from dejavu_jax.params import LayerParams, ModelParams

TP = "tp"


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one device of a tp-way split sees: heads, KV heads and neurons / tp."""
    sharding.check_tp(config, tp)
    return config.replace(n_heads=config.n_heads // tp, n_kv_heads=config.n_kv_heads // tp,
                          ffn=config.ffn // tp)


def local_k(k: int, tp: int) -> int:
    """Units each device selects for a global budget k: ceil(k / tp) (DejaVu's k / devices)."""
    return -(-k // tp)


def local_sparse_config(scfg: sparse.SparseConfig, tp: int) -> sparse.SparseConfig:
    """The SparseConfig of one shard: every layer's k divided over the devices."""
    return dataclasses.replace(scfg, mlp_k=tuple(local_k(k, tp) for k in scfg.mlp_k),
                               head_k=tuple(local_k(k, tp) for k in scfg.head_k))


def _bias_once(lp: LayerParams, axis: str) -> LayerParams:
    """Zero the residual-width biases on all but the first shard, so that the psum of the
    shards' partial outputs adds each bias exactly once."""
    first = jax.lax.axis_index(axis) == 0

    def once(b):
        return None if b is None else jnp.where(first, b, jnp.zeros_like(b))

    return lp.replace(bo=once(lp.bo), b_out=once(lp.b_out))


def selector_specs(selector_params, mesh: Mesh):
    """PartitionSpecs of selector parameters: predictors split by unit (see
    `sharding.predictor_specs`); fixed index sets [L, tp * k_local] split on their
    columns (each shard's block holds local unit ids); None stays None."""
    from dejavu_jax.train.predictor_model import DecodePredictors, PredictorParams
    if selector_params is None:
        return None
    if isinstance(selector_params, (PredictorParams, DecodePredictors)):
        return sharding.predictor_specs(selector_params, mesh)
    if isinstance(selector_params, tuple) and len(selector_params) == 2:
        return (P(None, TP), P(None, TP))
    raise TypeError(f"no sharding rule for selector params of type "
                    f"{type(selector_params).__name__}")


def shard_predictors(pred_params, mesh: Mesh):
    """Place predictors into the tensor-parallel layout (output columns split by unit)."""
    return jax.device_put(pred_params, sharding.named(sharding.predictor_specs(pred_params,
                                                                               mesh), mesh))


def select_per_shard(config: ModelConfig, select, selector_params, mesh: Mesh, layer,
                     x: jax.Array, k_mlp: int, k_heads: int):
    """The sets the sharded engine selects for one layer, as global unit ids:
    (neurons [tp * ceil(k_mlp / tp)], query heads [tp * ceil(k_heads / tp)]), shard by shard.

    Runs `select` per shard exactly as `tp_sparse_engine` does (for tests and inspection).
    """
    tp = sharding.tp_size(mesh)
    lconfig = local_config(config, tp)
    km, kh = local_k(k_mlp, tp), local_k(k_heads, tp)

    def body(sel, x):
        neurons, heads = select(sel, jnp.asarray(layer, jnp.int32), x, km, kh)
        shard = jax.lax.axis_index(TP)
        # per-row heads [B, kh] go out as [kh, B], so that shards stack their own heads
        return neurons + shard * lconfig.ffn, (heads + shard * lconfig.n_heads).T

    neurons, heads = jax.shard_map(body, mesh=mesh, check_vma=False,
                                   in_specs=(selector_specs(selector_params, mesh), P()),
                                   out_specs=(P(TP), P(TP)))(selector_params, x)
    return neurons, heads.T


def _step_specs(step: dict, mesh: Mesh) -> dict:
    axes = {"slot": (), "valid": ("batch", "seq"), "positions": ("batch",),
            "live": ("batch",)}
    unknown = set(step) - set(axes)
    if unknown:
        raise ValueError(f"no sharding rule for decode-step inputs {sorted(unknown)}")
    return {k: sharding._spec(axes[k], jnp.shape(v), mesh) for k, v in step.items()}


def sharded_layers_fn(mesh: Mesh):
    """A `layers_fn` for `sparse.sparse_step_fn` that runs `sparse.sparse_layers` per shard
    under shard_map, with a psum over "tp" after each attention and MLP block."""
    tp = sharding.tp_size(mesh)

    def layers_fn(config, scfg, params, select, selector_params, x, io, step):
        lconfig, lscfg = local_config(config, tp), local_sparse_config(scfg, tp)
        layer_specs = sharding.param_specs(params, mesh).layers
        io_specs = sharding.state_specs(io, mesh)
        x_spec = sharding._spec(("batch", "hidden"), x.shape, mesh)
        empty = {f.name: None for f in dataclasses.fields(ModelParams) if f.name != "layers"}

        def body(layers, sel, x, io, step):
            if isinstance(layers, tuple):
                layers = tuple(_bias_once(lp, TP) for lp in layers)
            else:
                layers = _bias_once(layers, TP)
            local = ModelParams(layers=layers, **empty)
            return sparse.sparse_layers(lconfig, lscfg, local, select, sel, x, io, step,
                                        reduce=lambda y: jax.lax.psum(y, TP))

        # check_vma=False: per-shard index sets and missing-KV bookkeeping would mark the
        # (truly replicated) hidden state and history as varying over "tp".
        run = jax.shard_map(
            body, mesh=mesh, check_vma=False,
            in_specs=(layer_specs, selector_specs(selector_params, mesh), x_spec, io_specs,
                      _step_specs(step, mesh)),
            out_specs=(x_spec, io_specs))
        return run(params.layers, selector_params, x, io, step)

    return layers_fn


def _init_fn(init, mesh: Mesh):
    """init_state(batch, max_len, dtype, **kw) built under jit straight into its shardings."""

    def init_state(batch, max_len, dtype, **kw):
        build = functools.partial(init, batch, max_len, dtype, **kw)
        shapes = jax.eval_shape(build)
        return jax.jit(build, out_shardings=sharding.state_shardings(shapes, mesh))()

    return init_state


def _constrained(fn, mesh: Mesh):
    """fn(...) -> (logits, state), with the state kept in its tensor-parallel layout."""

    def wrapped(*args):
        logits, state = fn(*args)
        return logits, sharding.constrain_state(state, mesh)

    return wrapped


@functools.lru_cache(maxsize=None)
def tp_dense_engine(config: ModelConfig, mesh: Mesh) -> Engine:
    """The dense engine on `mesh`: the single-device decode under GSPMD, with the cache
    split by KV head. Pass weights from `sharding.init_params_sharded` / `shard_params`."""
    sharding.check_tp(config, sharding.tp_size(mesh))
    return Engine(
        config=config,
        prefill=_constrained(functools.partial(model.prefill_fn, config), mesh),
        step=_constrained(functools.partial(model.decode_step_fn, config), mesh),
        init_state=_init_fn(functools.partial(model.init_state, config), mesh),
        name=f"dense tp={sharding.tp_size(mesh)}")


def tp_sparse_engine(config: ModelConfig, scfg: sparse.SparseConfig, select, mesh: Mesh
                     ) -> Engine:
    """The DejaVu sparse engine on `mesh`; params are (model params, selector params),
    placed with `sharding.shard_params` and `shard_predictors` (or fixed per-shard sets).

    `scfg` holds global k; each shard selects ceil(k / tp) of its own units.
    """
    tp = sharding.tp_size(mesh)
    local_sparse_config(scfg, tp).segments(local_config(config, tp))  # validate early
    step = functools.partial(sparse.sparse_step_fn, config, scfg, select,
                             layers_fn=sharded_layers_fn(mesh))
    return Engine(
        config=config,
        prefill=_constrained(functools.partial(sparse.sparse_prefill_fn, config), mesh),
        step=_constrained(step, mesh),
        init_state=_init_fn(functools.partial(sparse.init_sparse_state, config, scfg), mesh),
        name=f"{'oracle' if scfg.oracle else 'sparse'} tp={tp}")
