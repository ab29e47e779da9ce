"""Activation sparsity from per-layer thresholds: TEAL's input sparsity and CATS' gate
thresholding, one computation shared by the decode step, the scorer and calibration.

A *site* is the input of a group of matmuls. At each site a channel is kept when its
magnitude exceeds the layer's threshold for that site, and only the kept channels' weight
rows need to be read:

  qkv      attention norm output [d]          input channels of the q, k, v projections
  o        per-head attention outputs [H*hd]  input channels of the out-projection
  gate_up  MLP norm output [d]                input channels of the gate and up (fc1)
  gate     |act(gate)| [F] (gated MLPs)       a neuron below it skips its up and down rows
  down     neuron activations [F]             rows of the down projection (fc2)

Thresholds are an array [L, len(SITES)]; one layer's [..., len(SITES)] may carry leading
axes that broadcast against the activations' (per position). A threshold of 0 keeps every
channel: only exact zeros drop, and they change nothing, so 0 is the dense computation. Which sites a configuration uses is static
(`SparseConfig.threshold_sites`): it decides the weight layouts a GPU kernel reads, and so
which bytes a token skips (`read_fraction`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dejavu_jax import ops
from dejavu_jax.config import ModelConfig

F32 = jnp.float32
SITES = ("qkv", "o", "gate_up", "gate", "down")
QKV, O, GATE_UP, GATE, DOWN = range(len(SITES))
MATMULS = ("qkv", "o", "gate", "up", "down")


def check_sites(config: ModelConfig, sites) -> tuple[str, ...]:
    """`sites` as a tuple in SITES order; ValueError for unknown sites, or "gate" on a
    model without a gated MLP."""
    sites = tuple(sites)
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise ValueError(f"unknown activation sites {unknown}; known: {', '.join(SITES)}")
    if "gate" in sites and not config.gated_mlp:
        raise ValueError(f"the gate site needs a gated MLP; {config.name} has none")
    if not sites:
        raise ValueError("give at least one activation site")
    return tuple(s for s in SITES if s in sites)


def sparse_input(x: jax.Array, threshold) -> jax.Array:
    """x with the channels of magnitude at most `threshold` set to zero."""
    return jnp.where(jnp.abs(x) > threshold, x, jnp.zeros((), x.dtype))


def gate_magnitude(lp, gate: jax.Array) -> jax.Array:
    """What the gate site compares with its threshold: |act(gate)| [..., F], times the
    layer's per-neuron `gate_weight` when a profile set one (E|up_i| · ‖down_i‖, so that
    a neuron ranks by its expected contribution, not by its gate alone)."""
    mag = jnp.abs(gate)
    return mag if lp.gate_weight is None else mag * lp.gate_weight.astype(mag.dtype)


def _at(thresholds: jax.Array, site: int, channel_axes: int = 1) -> jax.Array:
    """One site's thresholds [...] with `channel_axes` trailing axes to broadcast."""
    return thresholds[(..., site) + (None,) * channel_axes]


def attention_hooks(thresholds: jax.Array):
    """(input mask, per-head output mask) of one layer's attention, from its thresholds
    [..., len(SITES)]: functions of the normed input y [..., d] and of per-head outputs
    [..., H, hd]."""
    return (lambda y: sparse_input(y, _at(thresholds, QKV)),
            lambda heads: sparse_input(heads, _at(thresholds, O, 2)))


def mlp(config: ModelConfig, lp, y: jax.Array, thresholds: jax.Array):
    """The MLP of normed inputs y [..., d] under one layer's thresholds [..., len(SITES)]:
    (output [..., d] fp32, kept fractions [..., 3] of the gate_up channels, of the
    neurons passing the gate and of the down projection's rows)."""
    y = sparse_input(y, _at(thresholds, GATE_UP))
    up = ops.add_bias(ops.up_projection(lp, y), lp.b_in)
    gate = ops.gate_projection(lp, y)
    if gate is not None:
        gate = ops.activation(config.activation, gate)
        neurons = gate_magnitude(lp, gate) > _at(thresholds, GATE)
        hidden = jnp.where(neurons, gate * up, 0.0)
    else:
        hidden = ops.activation(config.activation, up)
        neurons = jnp.ones(hidden.shape, bool)
    hidden = sparse_input(hidden, _at(thresholds, DOWN))
    kept = jnp.stack([jnp.mean(y != 0, axis=-1, dtype=F32),
                      jnp.mean(neurons, axis=-1, dtype=F32),
                      jnp.mean(hidden != 0, axis=-1, dtype=F32)], axis=-1)
    return ops.mlp_output(lp, hidden), kept


def matmul_elements(config: ModelConfig) -> dict[str, int]:
    """Weight elements of one layer's matmuls: q/k/v, o, gate (0 without one), up (fc1)
    and down (fc2)."""
    c = config
    d, F, hd = c.hidden, c.ffn, c.head_dim
    return {"qkv": (c.n_heads + 2 * c.n_kv_heads) * hd * d, "o": c.n_heads * hd * d,
            "gate": F * d if c.gated_mlp else 0, "up": F * d, "down": F * d}


def layer_elements(config: ModelConfig) -> int:
    """Weight elements of one decoder layer's matmuls (norms and biases are negligible)."""
    return sum(matmul_elements(config).values())


def threshold_reads(config: ModelConfig, sites, kept: dict) -> dict:
    """The fraction of each matmul's rows a token reads under threshold `sites`, from the
    kept fractions of `kept` (keys "qkv", "o", "gate_up", "gate", "down"; arrays that
    broadcast, e.g. per layer). With the gate site the up projection reads whole rows of
    the neurons that pass it; without, the gate_up site's input channels, like the gate.
    The down projection reads the rows of nonzero activations when the down or the gate
    site is thresholded (`mlp`'s down fraction), else every row."""
    get = {s: (kept[s] if s in sites else 1.0) for s in SITES}
    gate_site = "gate" in sites
    down = kept["down"] if ("down" in sites or gate_site) else 1.0
    return {"qkv": get["qkv"], "o": get["o"], "gate": get["gate_up"],
            "up": get["gate"] if gate_site else get["gate_up"], "down": down}


def unit_reads(config: ModelConfig, mlp_density, head_density, group_density=None) -> dict:
    """The fraction of each matmul's rows a token reads when it keeps `mlp_density` of the
    neurons (gate, up and down rows), `head_density` of the query heads (their q and o
    rows) and `group_density` of the KV groups (their k and v rows; default
    `head_density`, exact for multi-head models): DejaVu's and the oracle's sets."""
    c = config
    group_density = head_density if group_density is None else group_density
    qkv = ((c.n_heads * head_density + 2 * c.n_kv_heads * group_density)
           / (c.n_heads + 2 * c.n_kv_heads))
    return {"qkv": qkv, "o": head_density, "gate": mlp_density, "up": mlp_density,
            "down": mlp_density}


def skipped_fraction(config: ModelConfig, reads: dict, extra_elements=0.0):
    """The fraction of the decoder layers' matmul weight bytes not read per token, from
    per-matmul read fractions `reads` (scalars or per-layer arrays [L]; averaged over the
    layers) and `extra_elements` read per token besides (e.g. predictors), in elements
    of all layers together."""
    sizes = matmul_elements(config)
    per_layer = sum(sizes[m] * jnp.asarray(reads[m], F32) for m in MATMULS)
    read = jnp.mean(jnp.broadcast_to(per_layer, (config.n_layers,)))
    total = layer_elements(config)
    return float(1.0 - (read + extra_elements / config.n_layers) / total)
