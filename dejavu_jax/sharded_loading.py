"""Loading checkpoints straight into the tensor-parallel layout.

Every weight is built with `jax.make_array_from_callback`: for each device the callback
reads the tensor from the checkpoint, takes that device's slice (the layout changes of
`loading.py` are views), converts it and hands it to the device. The full model is never
assembled on one device (nor in host memory beyond one tensor at a time; figures for the
cost of reading whole tensors are in `checkpoint_files`). Works with several processes
(`jax.distributed.initialize()`): each process fills only its addressable devices.

  mesh = sharding.make_mesh(tp=2)
  config, params = load_pretrained_sharded("path/to/opt-30b", mesh)
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dejavu_jax import loading, sharding
from dejavu_jax.checkpoint_files import CheckpointError, TensorSource
from dejavu_jax.config import ModelConfig
from dejavu_jax.params import LayerParams, ModelParams, layer_shapes, model_shapes


def _name_maps(config: ModelConfig, source: TensorSource):
    return (loading.canonical_names(config, source), *loading.NAME_SPECS[config.family])


def params_from_tensors_sharded(config: ModelConfig, source: TensorSource, mesh: Mesh,
                                dtype=jnp.bfloat16) -> ModelParams:
    """Like `loading.params_from_tensors`, but each device receives only its shard.

    Raises CheckpointError for missing tensors, layer tensors the config has no place for
    or shapes that do not fit the config, and
    sharding.ShardingError when the mesh does not divide the heads and neurons.
    """
    sharding.check_tp(config, sharding.tp_size(mesh))
    names, top_spec, layer_spec = _name_maps(config, source)
    np_dtype = loading._numpy_dtype(dtype)
    origin = next(iter(source.keys()), None)
    origin_file = source.file_of(origin) if origin else "<empty checkpoint>"
    loading.refuse_unused_layer_tensors(config, names, origin_file)

    def view(canon, transform, want):
        """The tensor in our layout, as a (memory-mapped) view; checked against `want`."""
        key = names.get(canon)
        if key is None:
            raise CheckpointError(f"{origin_file}: missing tensor {canon!r} for "
                                  f"{config.family} model {config.name!r}")
        raw = source.get(key)
        arr = transform(raw, config)
        if tuple(arr.shape) != tuple(want):
            raise CheckpointError(
                f"{source.file_of(key)}: tensor {key!r} has shape {tuple(raw.shape)}, which "
                f"does not fit the config (expected {want} after layout change)")
        return arr

    shapes = {**model_shapes(config), **layer_shapes(config)}
    structs = {n: None if s is None else jax.ShapeDtypeStruct(s, dtype) for n, s in shapes.items()}
    layer_names = list(layer_shapes(config))
    template = ModelParams(layers=LayerParams(**{n: structs[n] for n in layer_names}),
                           **{n: structs[n] for n in model_shapes(config)})
    shards = sharding.param_shardings(template, mesh)
    prefix = loading.LAYER_PREFIX[config.family]

    def top_leaf(name, shape):
        canon, transform = top_spec[name]
        view(canon, transform, shape)  # check before any device work

        def read(index):
            return np.asarray(view(canon, transform, shape)[index], dtype=np_dtype)

        return jax.make_array_from_callback(shape, getattr(shards, name), read, dtype=dtype)

    def layer_leaf(name, shape):
        suffix, transform = layer_spec[name]
        for i in range(config.n_layers):
            view(prefix.format(i=i) + suffix, transform, shape[1:])

        def read(index):
            layers = range(config.n_layers)[index[0]]
            return np.stack([np.asarray(view(prefix.format(i=i) + suffix, transform,
                                             shape[1:])[index[1:]], dtype=np_dtype)
                             for i in layers])

        return jax.make_array_from_callback(shape, getattr(shards.layers, name), read,
                                            dtype=dtype)

    top = {n: None if s is None else top_leaf(n, s) for n, s in model_shapes(config).items()}
    layers = {n: None if s is None else layer_leaf(n, s) for n, s in layer_shapes(config).items()}
    return ModelParams(layers=LayerParams(**layers), **top)


def load_pretrained_sharded(path: str | os.PathLike, mesh: Mesh,
                            dtype=None) -> tuple[ModelConfig, ModelParams]:
    """`loading.load_pretrained` into the tensor-parallel layout of `mesh`.

    A HF directory (config.json + safetensors / pytorch_model.bin), a hub id or a .gguf
    file (GGUF tensors are dequantised in host memory first, then placed per shard).
    """
    config, tensors = loading.open_checkpoint(path)
    return config, params_from_tensors_sharded(config, tensors, mesh,
                                               dtype or loading.default_dtype())
