"""Per-layer weights with their small arrays packed: fewer buffers to hand over per call.

The per-layer layout the decode runs fastest with has 12-20 weight buffers a layer, most
of them norm scales and biases of a few kilobytes. `pack_small` moves each per-layer
array of at most `max_bytes` into one stacked array per field; `unpack_small`, called
inside the jitted step, gives the per-layer params back by static slices, so the step
reads its large weights in place as before. `eval.dispatch_overhead --packed` times it:
on an H200 it did not shorten a host-synchronised step's hand-over (qwen2.5-1.5b, 147
buffers against 282: eval/results/h200/dispatch-overhead/packed), so the decode does not
use it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dejavu_jax.params import LayerParams, ModelParams


def pack_small(params: ModelParams, max_bytes: int = 1 << 20
               ) -> tuple[ModelParams, dict[str, jax.Array]]:
    """(params with each per-layer field whose arrays hold at most `max_bytes` set to None,
    {field: its layers' arrays stacked [L, ...]}). `params.layers` must be per layer (a
    tuple, `params.unstack_layers`); ValueError otherwise."""
    layers = params.layers
    if not isinstance(layers, tuple):
        raise ValueError("pack_small needs per-layer params (params.unstack_layers)")
    small = {}
    for field in dataclasses.fields(LayerParams):
        arrays = [getattr(layer, field.name) for layer in layers]
        if any(a is None for a in arrays):
            continue
        if max(a.size * a.dtype.itemsize for a in arrays) <= max_bytes:
            small[field.name] = jnp.stack(arrays)
    big = tuple(layer.replace(**{name: None for name in small}) for layer in layers)
    return params.replace(layers=big), small


def unpack_small(packed: tuple[ModelParams, dict[str, jax.Array]]) -> ModelParams:
    """The per-layer params `pack_small` packed, each layer's small arrays sliced back in
    (static slices: call it inside the jitted function that takes `packed`)."""
    params, small = packed
    layers = tuple(layer.replace(**{name: stacked[i] for name, stacked in small.items()})
                   for i, layer in enumerate(params.layers))
    return params.replace(layers=layers)
