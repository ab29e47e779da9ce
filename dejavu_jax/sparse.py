"""DejaVu sparse decoding: per-token neuron and head subsets, lookahead prediction, missing KV.

One decode step runs the layers in *segments*: consecutive layers that share the same
(neurons kept, query heads kept) form one `lax.scan`. Inside a sparse segment the carry
holds the hidden state and the index sets for the *next* layer, predicted from this
layer's input while this layer computes (DejaVu's lookahead).

Missing KV: a head that is skipped at token t has no K/V for t. Every layer keeps the
normed attention inputs of the last `kv_window` tokens in a ring ([B, W, d] per layer, row
slot % W) and a bitmap of written cache entries ([B, L, Hk, S]). At every token the
selected heads, plus `kv_refresh` KV groups taken round-robin, recompute their unwritten
entries in the window before attention. This rides on the projection launch that reads
those heads' K/V rows anyway and on the attention launch (`kernels.KVWindow`): no weight
is read twice, and there is no branch, so the step never waits on the host. Each group is refreshed at least once every W tokens, so no entry
leaves the window unwritten: every selected head attends over exactly the dense KV.

Attention is selected by query head: a layer's set is a static number of query-head ids,
and the KV groups holding one of them are the ones whose K/V are read and written
(`kernels.query_head_groups`); for multi-head models a group is one head. In a batch each
row may select its own heads ([B, k] ids): the weights are read for their union, and each
row reads and writes only its own heads' cache entries.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dejavu_jax import kernels, ops
from dejavu_jax.config import ModelConfig
from dejavu_jax.inputs import check_step_tokens
from dejavu_jax.kernels.batch_predictor_select import first_product_part
from dejavu_jax.kernels.sparse_mlp import Riders
from dejavu_jax.model import (DecodeState, cache_layer, check_cache_layout,
                              check_step_positions, decode_layer, dense_attention, embed,
                              head_output_norms, layer_valid, set_cache_layer, unembed)
from dejavu_jax.params import ModelParams, has_fused_qkv

F32 = jnp.float32

# select(selector_params, layer, x_prev_input [B, d], k_mlp, k_heads)
#   -> (neuron_idx [Km], query_head_idx [Kh]); selector_params is a pytree (e.g. predictor weights);
#   layer is a Python int with unrolled layers, an int32 scalar array otherwise
Selector = Callable[..., tuple[jax.Array, jax.Array]]


BATCH_POLICIES = ("dense", "union", "shared", "kernels")
BATCH_LAYER_MODES = ("sparse", "masked", "dense")


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Static sparsity settings.

    mlp_k[l]: neurons computed in layer l (F = dense). head_k[l]: query heads computed
    (n_heads = dense); a KV group's K/V are read when one of its query heads is.
    dense_layers: the first layers run the dense path (the others run the sparse path
    even when k covers every unit, which is how density-1.0 parity is tested; with several
    rows see `batch_policy`).
    oracle: take the true top-k of this layer's dense activations and head output norms
    instead of predicted sets (research mode: computes densely, then masks).
    kv_window: tokens of layer inputs kept for missing-KV recomputation.
    impl: kernel implementation (None: Pallas on GPU, jnp reference on CPU).
    kv_refresh: KV groups refreshed per token besides the selected ones (None: the fewest
    that keeps every entry exact, ceil(n_kv_heads / kv_window); fewer, 0 included, gives
    up exactness: entries missed for longer than the window stay missing). Under tensor
    parallelism both count per shard, over the shard's own KV groups.
    attn_config / mlp_config / threshold_blocks: block sizes and load layouts of the Pallas
    kernels (`kernels.AttnConfig`, `kernels.MLPConfig`, `kernels.ThresholdConfig` for the
    activation-sparse layers' input-sparse GEMVs; None: their defaults).
    batch_policy: how a step of several rows decodes. "dense" (the default): every layer
    runs dense, since a batch's union of per-row sets and its selection cost more than they
    save (eval/results/h200/: opt-13b at batch 4 with predictors ran at 0.64 of dense, fixed
    sets at 1.37: the selection is the cost). "union": the union of the rows' sets, with
    XLA's dense products where they beat the gather kernels' batch path: a union of every KV
    group runs dense attention (writing every group's K/V), one of at least
    `batch_dense_mlp` of F neurons the dense MLP with the other neurons masked to zero (the
    same result), and a union of everything the dense layer. "shared": the batch reads one
    set per layer at the batch-1 budget, the k units of largest summed predicted
    probability over its rows (`PredictorSelector.shared_batch`; predictors only): the
    bytes of a batch-1 step, each row's set less its own. "kernels": the union through
    the sparse kernels at every size (parity checks of the kernels' batch path).
    batch_dense_mlp: that fraction (policy "union"). On an H200 at batch 4 the masked dense
    MLP on a 40% set was slower than the gather kernels: the opt-30b step ran at x0.65 of
    its run's dense step against x0.73 (eval/results/h200/opt-30b-batch4/); the break-even
    is estimated near 45%.
    batch_layers: a per-layer plan for batches under policy "union" (one mode per layer,
    `BATCH_LAYER_MODES`: "sparse" runs the union through the kernels at
    any size, "masked" the union's attention with the masked dense MLP, "dense" the dense
    layer with no selection), as `batch_plan.measure_batch_plan` chooses from measured
    step times; () keeps the size rules above. Batch 1 ignores it.
    threshold_sites: activation sparsity by per-layer thresholds instead of index sets
    (`dejavu_jax.activation_sparsity`: TEAL's input channels, CATS' gate): the sites
    thresholded in the sparse layers; the engine's selector params are then the
    thresholds [L, len(SITES)] (`threshold_config`).
    layer_unroll: over stacked weights, the layers one `lax.scan` iteration runs (its
    `unroll`; True: every layer of a segment inlined, no device loop). None: 4 on a GPU,
    where it measured fastest (opt-13b's sparse step chained 4.46 ms against 4.68 at 1,
    4.50 at 2 and 4.66 inlined; docs/benchmarks.md), else 1.
    _kv_recompute: benchmark-only (`sparse_variants.without_kv_recompute`).
    """

    mlp_k: tuple[int, ...]
    head_k: tuple[int, ...]
    dense_layers: int = 0
    oracle: bool = False
    kv_window: int = 16
    impl: str | None = None
    _kv_recompute: bool = dataclasses.field(default=True, repr=False)
    kv_refresh: int | None = None
    attn_config: kernels.AttnConfig | None = None
    mlp_config: kernels.MLPConfig | None = None
    threshold_blocks: kernels.ThresholdConfig | None = None
    batch_policy: str = "dense"
    batch_dense_mlp: float = 0.5
    threshold_sites: tuple[str, ...] = ()
    batch_layers: tuple[str, ...] = ()
    layer_unroll: int | bool | None = None

    def __post_init__(self):
        if not (self.layer_unroll is None or self.layer_unroll is True
                or (isinstance(self.layer_unroll, int) and self.layer_unroll >= 1)):
            raise ValueError(f"layer_unroll must be True or an integer >= 1, got "
                             f"{self.layer_unroll!r}")
        if len(self.mlp_k) != len(self.head_k):
            raise ValueError("mlp_k and head_k must have one entry per layer")
        if not _is_whole(self.kv_window) or self.kv_window < 1:
            raise ValueError(f"kv_window must be a whole number >= 1, got {self.kv_window!r}")
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"batch_policy must be one of {BATCH_POLICIES}, got "
                             f"{self.batch_policy!r}")
        if not self.batch_dense_mlp > 0:
            raise ValueError(f"batch_dense_mlp must be > 0, got {self.batch_dense_mlp}")
        if self.kv_refresh is not None and self.kv_refresh < 0:
            raise ValueError(f"kv_refresh must be >= 0, got {self.kv_refresh}")
        if self.threshold_sites and self.oracle:
            raise ValueError("threshold_sites and oracle are two selection methods; pick one")
        if self.batch_policy == "shared" and (self.oracle or self.threshold_sites):
            raise ValueError("batch_policy 'shared' shares predicted sets; the oracle and "
                             "thresholds select per row")
        if self.batch_layers:
            bad = [m for m in self.batch_layers if m not in BATCH_LAYER_MODES]
            if bad:
                raise ValueError(f"batch_layers: unknown mode {bad[0]!r}; choose from "
                                 f"{BATCH_LAYER_MODES}")
            if len(self.batch_layers) != len(self.mlp_k):
                raise ValueError(f"batch_layers has {len(self.batch_layers)} modes for "
                                 f"{len(self.mlp_k)} layers")
            if self.batch_policy != "union":
                raise ValueError("batch_layers plans the union; set batch_policy 'union'")

    def scan_unroll(self) -> int | bool:
        """`layer_unroll` with None resolved for the default backend."""
        if self.layer_unroll is not None:
            return self.layer_unroll
        return 4 if jax.default_backend() == "gpu" else 1

    def refresh_groups(self, config: ModelConfig) -> int:
        """KV groups refreshed per token (see `kv_refresh`)."""
        if self.kv_refresh is not None:
            return min(self.kv_refresh, config.n_kv_heads)
        return -(-config.n_kv_heads // self.kv_window)

    def segments(self, config: ModelConfig) -> list[tuple[int, int, bool, int, int]]:
        """(start, stop, dense, k_mlp, k_heads) runs of consecutive layers run alike."""
        return [run[:5] for run in self.layer_runs(config)]

    def layer_runs(self, config: ModelConfig, batch: int = 1
                   ) -> list[tuple[int, int, bool, int, int, str | None]]:
        """`segments` with each run's `batch_layers` mode (None without a plan or at
        batch 1); a batch's "dense" layers are dense runs."""
        if len(self.mlp_k) != config.n_layers:
            raise ValueError(f"SparseConfig has {len(self.mlp_k)} layers, the model "
                             f"{config.n_layers}")
        runs = []
        for layer, (km, kh) in enumerate(zip(self.mlp_k, self.head_k)):
            if not (0 < km <= config.ffn and 0 < kh <= config.n_heads):
                raise ValueError(f"layer {layer}: k_mlp={km} / k_heads={kh} out of range")
            mode = self.batch_layers[layer] if batch > 1 and self.batch_layers else None
            ks = (layer < self.dense_layers or mode == "dense", km, kh, mode)
            if runs and runs[-1][2:] == ks:
                runs[-1] = (runs[-1][0], layer + 1, *ks)
            else:
                runs.append((layer, layer + 1, *ks))
        return runs

    def density(self, config: ModelConfig) -> dict[str, list[float]]:
        """Per-layer fraction of neurons and query heads computed (per shared index set)."""
        return {"mlp": [k / config.ffn for k in self.mlp_k],
                "heads": [k / config.n_heads for k in self.head_k]}


def _is_whole(value) -> bool:
    """Whether `value` is a Python or numpy integer (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _per_layer(value, n_layers: int, name: str) -> list[float]:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a number or one number per layer, got {value!r}")
    one = np.ndim(value) == 0
    values = [value] * n_layers if one else list(np.asarray(value).reshape(-1))
    if len(values) != n_layers:
        raise ValueError(f"{name} has {len(values)} entries for {n_layers} layers")
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise ValueError(f"{name} values must be numbers, got {v!r}")
        if not 0.0 < float(v) <= 1.0:
            raise ValueError(f"{name} values must be in (0, 1], got {v}")
    return [float(v) for v in values]


def default_dense_layers(n_layers: int) -> int:
    """The dense layers of a sparse decode when none are named: the first 2 (DejaVu's), or
    fewer so that at least one layer of a small model is sparse."""
    return max(0, min(2, n_layers - 1))


def sparse_config(config: ModelConfig, mlp_density=0.1, head_density=0.5,
                  dense_layers: int | None = None, oracle: bool = False,
                  kv_window: int = 16, impl: str | None = None) -> SparseConfig:
    """SparseConfig from densities (a float for all layers, or one per layer).

    The first `dense_layers` layers run dense (default `default_dense_layers`). k =
    ceil(density * units), at least 1; the head units are query heads.
    """
    L = config.n_layers
    dense_layers = default_dense_layers(L) if dense_layers is None else dense_layers
    if not _is_whole(dense_layers):
        raise ValueError(f"dense_layers must be a whole number of layers, got {dense_layers!r}")
    dense_layers = int(dense_layers)
    mlp = _per_layer(mlp_density, L, "mlp_density")
    heads = _per_layer(head_density, L, "head_density")
    if not 0 <= dense_layers <= L:
        raise ValueError(f"dense_layers={dense_layers} must be in 0..{L}")

    def count(d, n):
        return max(1, min(n, int(-(-round(d * n * 1e6) // 1_000_000))))

    mlp_k = tuple(config.ffn if l < dense_layers else count(mlp[l], config.ffn)
                  for l in range(L))
    head_k = tuple(config.n_heads if l < dense_layers else count(heads[l], config.n_heads)
                   for l in range(L))
    if _is_whole(kv_window):
        kv_window = int(kv_window)
    return SparseConfig(mlp_k, head_k, dense_layers, oracle, kv_window, impl)


def threshold_config(config: ModelConfig, sites, dense_layers: int = 0,
                     impl: str | None = None) -> SparseConfig:
    """A SparseConfig of activation sparsity at threshold `sites` (names of
    `activation_sparsity.SITES`) in every layer from `dense_layers` on; the engine's
    selector params are the thresholds [L, len(SITES)] (`activation_sparsity`)."""
    from dejavu_jax.activation_sparsity import check_sites
    sites = check_sites(config, sites)
    if not 0 <= dense_layers <= config.n_layers:
        raise ValueError(f"dense_layers={dense_layers} must be in 0..{config.n_layers}")
    L = config.n_layers
    return SparseConfig((config.ffn,) * L, (config.n_heads,) * L, dense_layers,
                        impl=impl, threshold_sites=sites)


@struct.dataclass
class SparseState:
    """The dense decode state plus what missing-KV recomputation needs.

    written: [B, L, Hk, S] whether a cache entry holds its K/V.
    history: [B, L, W, d] normed attention inputs of the last W tokens (ring by slot % W),
      or a tuple of per-layer [B, W, d] rings (with per-layer cache buffers).
    """

    dense: DecodeState
    written: jax.Array
    history: jax.Array


def init_sparse_state(config: ModelConfig, scfg: SparseConfig, batch: int, max_len: int,
                      dtype, per_layer: bool = False) -> SparseState:
    """An empty sparse decode state (per_layer: per-layer cache buffers, see DecodeState)."""
    from dejavu_jax.model import init_state
    ring = (batch, scfg.kv_window, config.hidden)
    history = (tuple(jnp.zeros(ring, dtype) for _ in range(config.n_layers)) if per_layer
               else jnp.zeros((batch, config.n_layers, *ring[1:]), dtype))
    return SparseState(
        dense=init_state(config, batch, max_len, dtype, per_layer),
        written=jnp.zeros((batch, config.n_layers, config.n_kv_heads, max_len), bool),
        history=history)


def sparse_prefill_fn(config: ModelConfig, params: tuple, input_ids, attention_mask,
                      state: SparseState):
    """Dense prefill (fills every head's KV); marks the prompt's entries written.

    params is (model params, selector params), as for `sparse_step_fn`. It does not depend
    on the SparseConfig (beyond the state's shapes), so sparse engines of one model share it.
    """
    from dejavu_jax.model import prefill_fn
    params = engine_params(params)[0]
    logits, dense = prefill_fn(config, params, input_ids, attention_mask, state.dense)
    T = input_ids.shape[1]
    mask = jnp.broadcast_to(attention_mask.astype(bool)[:, None, None, :],
                            (input_ids.shape[0], config.n_layers, config.n_kv_heads, T))
    written = jax.lax.dynamic_update_slice(jnp.zeros_like(state.written), mask, (0, 0, 0, 0))
    return logits, SparseState(dense=dense, written=written, history=state.history)


def _flat(w: jax.Array | None) -> jax.Array | None:
    """[L, n, ...] -> [L * n, ...]: a free reshape that lets kernels gather across layers."""
    return None if w is None else w.reshape(-1, *w.shape[2:])


class _LayerIO(struct.PyTreeNode):
    """The per-step arrays every layer body reads or writes."""

    k: jax.Array
    v: jax.Array
    written: jax.Array
    history: jax.Array


class _LayerView(struct.PyTreeNode):
    """One layer's weights: `lp` (LayerParams without the layer axis), `flat` (the weights
    kernels index: per-layer arrays when unrolled, all layers flattened when stacked) and
    `base`, the layer offset of unit ids into `flat` (0 when unrolled). `offset_ids`: the
    neuron and query-head ids the layer gets already hold that offset (its selection wrote
    them so, `PredictorSelector.finish`), and no XLA op adds it per layer."""

    lp: object
    flat: dict
    base: jax.Array | int
    unrolled: bool = struct.field(pytree_node=False, default=False)
    offset_ids: bool = struct.field(pytree_node=False, default=False)

    def flat_ids(self, ids: jax.Array, per_layer: int) -> jax.Array:
        """Unit ids of this layer (`per_layer` units each) as rows of `flat`."""
        return ids if self.offset_ids else self.base * per_layer + ids


def _offset_sets(sets, layer, n_neurons: int, n_heads: int):
    """(neuron ids, query-head ids) of `layer` offset into the weights flattened over
    layers: layer * n_neurons + neuron, layer * n_heads + head."""
    neurons, heads = sets
    return neurons + layer * n_neurons, heads + layer * n_heads


_KERNEL_WEIGHTS = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "w_in", "b_in", "w_gate", "w_out_t",
                   "wqkv_t", "wo_t", "w_gate_t", "w_in_t", "gate_weight")


def _layer_view(params: ModelParams, layer) -> _LayerView:
    if isinstance(params.layers, tuple):
        lp = params.layers[layer]
        return _LayerView(lp, {n: getattr(lp, n) for n in _KERNEL_WEIGHTS}, 0, True)
    lp = jax.tree.map(lambda w: w[layer], params.layers)
    flat = {n: _flat(getattr(params.layers, n)) for n in _KERNEL_WEIGHTS}
    return _LayerView(lp, flat, layer, False)


def _window_step(config: ModelConfig, scfg: SparseConfig, step: dict) -> dict:
    """Per-token window bookkeeping shared by every layer, in ring order (row j holds the
    token of the last W whose slot is j mod W): cache slots, validity, the current token's
    row, the round-robin refresh groups and the rows' positions (rotary models)."""
    W = scfg.kv_window
    slot, valid = step["slot"], step["valid"]
    back = (slot - jnp.arange(W, dtype=jnp.int32)) % W          # tokens before the current
    slots = slot - back
    slots_c = jnp.maximum(slots, 0)
    # the masks the kernels read are int32, converted here once per step, not per layer
    out = {"slots": slots_c,
           "row_valid": (valid[:, slots_c] & (slots >= 0)[None]).astype(jnp.int32),
           "valid_i32": valid.astype(jnp.int32),
           "current": slot % W, "refresh": None, "cos": None, "sin": None}
    n_refresh = scfg.refresh_groups(config)
    if n_refresh:
        out["refresh"] = ((slot * n_refresh + jnp.arange(n_refresh, dtype=jnp.int32))
                          % config.n_kv_heads).astype(jnp.int32)
    if config.rotary:  # the window rows' RoPE tables, each layer picking its own
        positions = jnp.maximum(step["positions"][:, None] - back[None], 0)
        # the step's length picks LongRoPE's factors
        out["rope"] = ops.step_rope_tables(config, positions,
                                           jnp.max(step["positions"]) + 1)
    return out


def _attended_slots(config: ModelConfig, layer, step: dict) -> jax.Array:
    """`layer_valid` as the int32 [B, S] mask the attention kernels take: a layer without a
    sliding window shares the step's, converted once per step."""
    if not config.has_sliding_layers and "window" in step:
        return step["window"]["valid_i32"]
    return layer_valid(config, layer, step).astype(jnp.int32)


def _missing_kv_window(config: ModelConfig, view, io: _LayerIO, layer, win: dict, ring,
                       ring_row0=None):
    """The KVWindow for this layer (selected + refresh groups, `ring` its [B, W, d] inputs,
    or with `ring_row0` every layer's rings [B, L * W, d], this layer's from that row).

    It carries the whole bitmap (`written` viewed as [B, L * Hk, S]): the attention finds
    the missing entries there and sets what it writes, so no XLA op runs around it."""
    B, L, Hk, S = io.written.shape
    base = view.base * Hk
    # the kernels' head ids are base + group (stacked) or the group (unrolled layers)
    rows0 = layer * Hk - base
    cos = sin = None
    if "rope" in win:  # this layer's RoPE (Gemma 3's sliding layers have their own)
        cos, sin = ops.pick_rope_tables(config, win["rope"], layer)
    return kernels.KVWindow(
        x=ring, x_row0=None if ring_row0 is None else jnp.asarray(ring_row0, jnp.int32),
        current=win["current"],
        extra_ids=None if win["refresh"] is None else base + win["refresh"],
        need=None, slots=win["slots"], cos=cos, sin=sin,
        written=io.written.reshape(B, L * Hk, S),
        written_base=jnp.asarray(rows0, jnp.int32), row_valid=win["row_valid"])


def _history_rows(io: _LayerIO, layer, slot, W: int):
    """(buffer [B, R, d], row): where this token's input goes in the layer's ring (per-layer
    rings: the layer's own; stacked history: viewed as [B, L * W, d])."""
    if isinstance(io.history, tuple):
        return io.history[layer], slot % W
    B, L, _, d = io.history.shape
    return io.history.reshape(B, L * W, d), layer * W + slot % W


def _with_history_rows(io: _LayerIO, layer, rows):
    """(io holding the updated buffer of `_history_rows`, the rings holding the layer's,
    the layer's first row in them): per-layer rings [B, W, d] and None, or stacked ones
    as the buffer [B, L * W, d] (read in place, no slice copied) and layer * W."""
    if isinstance(io.history, tuple):
        return (io.replace(history=io.history[:layer] + (rows,) + io.history[layer + 1:]),
                rows, None)
    W = io.history.shape[2]
    return io.replace(history=rows.reshape(io.history.shape)), rows, layer * W


def _kernel_caches(config, view, io: _LayerIO, layer, groups):
    """(k, v, group ids) as the attention kernels take them: this layer's cache buffers
    and `groups`, or with stacked layers every layer's groups viewed as [B, L * Hk, S, hd]
    (no copy) and the groups' ids among them."""
    if view.unrolled:
        return cache_layer(io.k, layer), cache_layer(io.v, layer), groups
    B, S, hd = io.written.shape[0], io.written.shape[-1], config.head_dim
    return (io.k.reshape(B, -1, S, hd), io.v.reshape(B, -1, S, hd),
            view.flat_ids(groups, config.n_kv_heads))


def _with_kernel_caches(view, io: _LayerIO, layer, k_out, v_out) -> _LayerIO:
    """io holding the caches a kernel returned in `_kernel_caches`' form."""
    if view.unrolled:
        return io.replace(k=set_cache_layer(io.k, layer, k_out),
                          v=set_cache_layer(io.v, layer, v_out))
    return io.replace(k=k_out.reshape(io.k.shape), v=v_out.reshape(io.v.shape))


def _sparse_attention(config, scfg, view, io: _LayerIO, layer, y, heads, step,
                      residual=None, extra_segments=(), history_rows=None):
    """Head-sparse attention for normed inputs y [B, d] over the selected query heads
    (the KV groups holding them read and write their K/V).

    `history_rows`: the `_history_rows` buffer with y already written (by the norm launch);
    None writes it here. Returns (out [B, d] fp32, io), out added to `residual` when
    given, and with `extra_segments` a third item, their products (see
    `kernels.head_sparse_attention`)."""
    W = scfg.kv_window
    slot = step["slot"]
    if history_rows is None:
        rows, row = _history_rows(io, layer, slot, W)
        history_rows = jax.lax.dynamic_update_slice(
            rows, y.astype(rows.dtype)[:, None, :], (0, row, 0))
    io, ring, ring_row0 = _with_history_rows(io, layer, history_rows)
    window = None
    if scfg._kv_recompute:
        window = _missing_kv_window(config, view, io, layer, step["window"], ring, ring_row0)
    rope = None
    if config.rotary:
        rope = ops.pick_rope_tables(config, step["rope"], layer)
    norms = {}
    if config.qk_norm:
        norms["qk_norm"] = (view.lp.q_norm_scale, view.lp.k_norm_scale)
        norms["norm_eps"] = config.norm_eps
    if config.query_scale is not None:
        norms["scale"] = config.attention_scale
    if config.attn_logit_softcap is not None:
        norms["softcap"] = config.attn_logit_softcap
    lp_flat = view.flat
    groups, head_mask = kernels.query_head_groups(heads, config.n_kv_heads, config.group_size)
    k_in, v_in, head_idx = _kernel_caches(config, view, io, layer, groups)
    if window is not None:  # the ring's row of this token holds y at the ring's precision
        y = y.astype(ring.dtype)
    res = kernels.head_sparse_attention(
        y.astype(lp_flat["wq"].dtype), lp_flat["wq"], lp_flat["bq"], lp_flat["wk"],
        lp_flat["bk"], lp_flat["wv"], lp_flat["bv"], lp_flat["wo"], view.lp.bo,
        k_in, v_in, slot, head_idx, head_mask=head_mask, rope=rope,
        kv_mask=_attended_slots(config, layer, step),
        impl=scfg.impl, window=window, residual=residual, extra_segments=extra_segments,
        config=scfg.attn_config, **norms)
    out, k_out, v_out = res[:3]
    if window is not None:
        io = io.replace(written=res[3].reshape(io.written.shape))
        res = res[:3] + res[4:]
    io = _with_kernel_caches(view, io, layer, k_out, v_out)
    return (out.astype(F32), io) + tuple(res[3:])


def _sparse_mlp(config, scfg, view, y, neurons, residual=None, riders=None, dense=False):
    """The MLP over the selected neurons for normed inputs y [B, d], fp32 (added to
    `residual` when given). With `riders` (see `kernels.sparse_mlp`): (output, the riders'
    outputs). `dense` (a batch's large set, `batch_dense_parts`): XLA's dense MLP, the
    other neurons masked."""
    F = config.ffn
    if dense:
        assert riders is None, "riders ride only in batch-1 steps"
        # a batch's large union (its static capacity min(F, k * B) often is every neuron):
        # XLA's dense products read the same rows faster than the gather kernels' batch path
        hidden = ops.mlp_hidden(config, view.lp, y)
        if neurons.shape[-1] < F:
            hidden = hidden * jnp.zeros((F,), hidden.dtype).at[neurons].set(1)
        out = ops.mlp_output(view.lp, hidden)
        return out if residual is None else residual + out
    lp_flat = view.flat
    out = kernels.sparse_mlp(
        y.astype(lp_flat["w_in"].dtype), lp_flat["w_in"], lp_flat["b_in"],
        lp_flat["w_out_t"], view.lp.b_out, view.flat_ids(neurons, F),
        activation=config.activation, w_gate=lp_flat["w_gate"],
        impl=scfg.impl, residual=residual, riders=riders, config=scfg.mlp_config)
    if riders is not None:
        return out[0].astype(F32), out[1]
    return out.astype(F32)


def _dense_layer(config, view, io: _LayerIO, layer, x, step, oracle_k=None, reduce=None):
    """A dense layer on the decode path (also the oracle: dense, then each row's own top-k
    masking)."""
    from dejavu_jax.train.predict import select_top_k

    def row_top_k_mask(scores, k):  # [B, n] -> bool [B, n]: each row's k largest
        return jnp.stack([jnp.zeros(scores.shape[1], bool).at[
            select_top_k(scores[b:b + 1], k)].set(True) for b in range(scores.shape[0])])

    def mask_heads(lp, heads):  # the query heads with the largest output norms
        keep = row_top_k_mask(head_output_norms(lp, heads), oracle_k[1])
        return heads * keep[:, :, None]

    def mask_neurons(hidden):
        return hidden * row_top_k_mask(jnp.abs(hidden), oracle_k[0]).astype(hidden.dtype)

    masks = (None, None) if oracle_k is None else (mask_heads, mask_neurons)
    x, k, v = decode_layer(config, view.lp, x, io.k, io.v, layer, step, *masks, reduce)
    return x, _all_written(config, io.replace(k=k, v=v), layer, step)


def _threshold_layer(config, scfg, view, io: _LayerIO, layer, x, step, table, reduce=None):
    """A layer under its row of the activation thresholds `table` [L, len(SITES)]
    (`activation_sparsity`): every head computes, from the kept input channels, so every
    K/V entry is written. On the Pallas paths with input-major weights
    (`params.input_major`) the kernels of `kernels.threshold_matvec` read only the kept
    channels' rows; elsewhere the jnp computation masks the activations (the same
    result)."""
    from dejavu_jax import activation_sparsity
    from dejavu_jax.kernels._common import resolve_impl
    lp = view.lp
    if (lp.wqkv_t is not None and resolve_impl(scfg.impl) != "reference"
            and reduce is None and config.pre_norm):
        return _threshold_layer_kernels(config, scfg, view, io, layer, x, step, table)
    thresholds = table[layer]
    mask_input, mask_heads = activation_sparsity.attention_hooks(thresholds)
    box = {}

    def attn(y):
        out, k, v = dense_attention(config, lp, mask_input(y), io.k, io.v, layer, step,
                                    lambda _, heads: mask_heads(heads))
        box["io"] = io.replace(k=k, v=v)
        return _reduced(reduce, out)

    def mlp(y):
        return _reduced(reduce, activation_sparsity.mlp(config, lp, y, thresholds)[0])

    h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                     lp.post_attn_norm_scale)
    x = ops.residual(config, h, mlp, lp.mlp_norm_scale, lp.mlp_norm_bias,
                     lp.post_mlp_norm_scale)
    return x, box["io"]


def _threshold_layer_kernels(config, scfg, view, io: _LayerIO, layer, x, step, table):
    """`_threshold_layer` of a pre-norm model through the activation-sparse kernels: q/k/v
    and the out-projection, the gate (and without the gate site the up projection) read
    the kept input channels' rows of their input-major weights, the up projection under
    the gate site the rows of the neurons that pass it, fc2 the rows of nonzero
    activations; the out-projection and fc2 add into the residual rows in their launches
    unless a post-norm comes between. The kernels read their thresholds from the table in
    place, and over stacked weights each layer's rows among every layer's (a slice of
    either would be a copy per launch); the input-sparse GEMVs' block settings come from
    `scfg.threshold_blocks`."""
    from dejavu_jax import activation_sparsity as act
    from dejavu_jax.kernels.gated_hidden import gated_hidden
    from dejavu_jax.kernels.gated_rows import gated_rows
    from dejavu_jax.kernels.threshold_matvec import (ThresholdConfig, row_masked_matvec,
                                                     threshold_matvec, threshold_matvecs)
    from dejavu_jax.model import cached_attention, write_kv
    impl, eps = scfg.impl, config.norm_eps
    blocks = scfg.threshold_blocks or ThresholdConfig()
    by_site = {act.QKV: blocks.qkv, act.O: blocks.o, act.GATE_UP: blocks.gate_up,
               act.DOWN: blocks.down}
    B = x.shape[0]
    t = table[layer]
    lp, stacked = view.lp, not view.unrolled

    def weight(name):  # stacked: every layer's rows, this layer's read in place
        return view.flat[name] if stacked else getattr(lp, name)

    def index_at(site):  # the site's threshold as the kernels index the table
        return site if stacked else int(layer) * table.shape[1] + site

    def table_at(site):
        return dict(threshold=table, threshold_index=index_at(site),
                    **({"layer": layer} if stacked else {}))

    def at(site):
        return dict(table_at(site), **by_site[site].kwargs())
    x = x.astype(F32)
    y = ops.norm_input(x, lp.attn_norm_scale, lp.attn_norm_bias, eps)
    if blocks.attention_kernel:
        if blocks.qkv_atomics:  # one partial: the chunks' sums added in the launch
            w = weight("wqkv_t")
            qkv_parts = threshold_matvec(y, w, **at(act.QKV), impl=impl,
                                         residual=jnp.zeros((B, w.shape[1]), F32))[None]
        else:
            qkv_parts, = threshold_matvecs(y, [weight("wqkv_t")], **at(act.QKV),
                                           partials=True, impl=impl)
        heads, splits, io = _every_head_attention(config, scfg, view, io, layer, qkv_parts,
                                                  step)
    else:
        splits = None
        qkv = threshold_matvec(y, weight("wqkv_t"), **at(act.QKV), impl=impl)
        q, k, v = ops.finish_qkv(config, lp, qkv, step["positions"], layer)
        io = io.replace(k=write_kv(io.k, layer, step["slot"], k),
                        v=write_kv(io.v, layer, step["slot"], v))
        heads = cached_attention(config, q, cache_layer(io.k, layer), cache_layer(io.v, layer),
                                 layer_valid(config, layer, step)).reshape(B, -1)
    if lp.post_attn_norm_scale is None:
        h = threshold_matvec(heads, weight("wo_t"), **at(act.O), residual=x, bias=lp.bo,
                             splits=splits, impl=impl)
    else:
        out = threshold_matvec(heads, weight("wo_t"), **at(act.O), bias=lp.bo, splits=splits,
                               impl=impl)
        h = x + ops.norm(out, lp.post_attn_norm_scale, None, eps)
    ym = ops.norm_input(h, lp.mlp_norm_scale, lp.mlp_norm_bias, eps)
    # both input-sparse: the gate and up in one launch, and under `gated_kernel` their
    # partials summed and the units finished in one more; under the gate site's layout
    # (up rows) and `gate_rows_kernel`, the gate's partials, the up rows and the units in
    # one more
    gated_kernel = (blocks.gated_kernel and lp.w_in_t is not None
                    and lp.w_gate_t is not None)
    gate_rows = blocks.gate_rows_kernel and lp.w_in_t is None and lp.w_gate_t is not None
    if lp.w_in_t is not None and lp.w_gate_t is not None:
        gate, up = threshold_matvecs(ym, [weight("w_gate_t"), weight("w_in_t")],
                                     **at(act.GATE_UP), partials=gated_kernel, impl=impl)
        if not gated_kernel:
            gate = ops.activation(config.activation, gate)
            up = ops.add_bias(up, lp.b_in)
    elif lp.w_in_t is not None:
        up = ops.add_bias(threshold_matvec(ym, weight("w_in_t"), **at(act.GATE_UP),
                                           impl=impl), lp.b_in)
    elif gate_rows:
        gate_parts, = threshold_matvecs(ym, [weight("w_gate_t")], **at(act.GATE_UP),
                                        partials=True, impl=impl)
    elif lp.w_gate_t is not None:
        gate = ops.activation(config.activation,
                              threshold_matvec(ym, weight("w_gate_t"), **at(act.GATE_UP),
                                               impl=impl))
    if gated_kernel:
        hidden = gated_hidden(gate, up, **table_at(act.GATE), activation=config.activation,
                              b_in=weight("b_in"), gate_weight=weight("gate_weight"),
                              impl=impl)
    elif gate_rows:
        hidden = gated_rows(gate_parts, ym, weight("w_in"), table,
                            input_index=index_at(act.GATE_UP), gate_index=index_at(act.GATE),
                            layer=layer if stacked else None, activation=config.activation,
                            b_in=weight("b_in"), gate_weight=weight("gate_weight"), impl=impl)
    elif lp.w_gate_t is not None:
        neurons = act.gate_magnitude(lp, gate) > t[act.GATE]
        if lp.w_in_t is None:  # the gate site's layout: whole rows of the kept neurons
            up = ops.add_bias(row_masked_matvec(
                act.sparse_input(ym, t[act.GATE_UP]), weight("w_in"), neurons,
                layer=layer if stacked else None, impl=impl), lp.b_in)
        hidden = jnp.where(neurons, gate * up, 0.0)
    else:
        hidden = ops.activation(config.activation, up)
    if lp.post_mlp_norm_scale is None:
        out = threshold_matvec(hidden, weight("w_out_t"), **at(act.DOWN), residual=h,
                               bias=lp.b_out, impl=impl)
    else:
        mlp_out = threshold_matvec(hidden, weight("w_out_t"), **at(act.DOWN), bias=lp.b_out,
                                   impl=impl)
        out = h + ops.norm(mlp_out, lp.post_mlp_norm_scale, None, eps)
    return out, io


# split-k partials of q/k/v up to which the attention programs sum them (more: one XLA sum)
_ATTENTION_PARTS = 16
# flash-decoding splits up to which the out-projection merges them as it loads its input
# (more: one XLA merge first)
_MERGED_SPLITS = 16


def _every_head_attention(config, scfg, view, io: _LayerIO, layer, qkv_parts, step):
    """(every head's attention output, splits, io) from the raw q/k/v projections' fp32
    split-k partials `qkv_parts` [n, B, (H + 2 Hk) * hd], through the decode-attention
    kernel over every KV group: each program sums and finishes its group's q/k/v in place
    (biases, rotary embedding; q/k norms first finish in XLA), attends to the cache and
    writes this token's k/v, so no XLA op slices, rotates or writes per layer. More than
    `_ATTENTION_PARTS` partials are summed first. The output is the flash-decoding splits'
    [S, B, H * hd] with `splits` their maxima and sums (m, l) [S, B, H], for the
    out-projection to merge as it loads them (`threshold_matvec`'s `splits`); past
    `_MERGED_SPLITS` splits, or with `scfg.threshold_blocks.o_merges_splits` off, the
    merged [B, H * hd] with `splits` None."""
    from dejavu_jax.kernels._common import resolve_impl, sm_count
    from dejavu_jax.kernels.head_attention import decode_attention, merge_splits
    B = qkv_parts.shape[1]
    H, Hk, hd = config.n_heads, config.n_kv_heads, config.head_dim
    if config.qk_norm or qkv_parts.shape[0] > _ATTENTION_PARTS:
        qkv_parts = jnp.sum(qkv_parts, axis=0, keepdims=True)
    k_in, v_in, head_idx = _kernel_caches(config, view, io, layer,
                                          jnp.arange(Hk, dtype=jnp.int32))
    cfg = scfg.attn_config or kernels.AttnConfig()
    if config.qk_norm:  # finished (and q scaled) before the kernel
        q, k, v = ops.finish_qkv(config, view.lp, qkv_parts[0], step["positions"], layer)
        parts = tuple(t.reshape(1, B, -1) for t in (q, k, v))
        opts = dict(scale=1.0)
    else:
        parts = (qkv_parts,) * 3

        def flat(name):  # the biases over every layer when stacked (ids hold the layer)
            w = view.flat[name]
            return None if w is None else w.reshape(-1)
        opts = dict(bq=flat("bq"), bk=flat("bk"), bv=flat("bv"),
                    scale=config.attention_scale, columns=(0, H * hd, (H + Hk) * hd))
        if config.rotary:
            opts.update(zip(("cos", "sin"), (
                jnp.broadcast_to(t.astype(F32), (B, hd))
                for t in ops.pick_rope_tables(config, step["rope"], layer))))
    o, m, l, k_out, v_out = decode_attention(
        *parts, head_idx, jnp.asarray(step["slot"], jnp.int32).reshape(1), k_in, v_in,
        group=config.group_size, kv_mask=_attended_slots(config, layer, step),
        block_s=cfg.block_s, seq_splits=cfg.seq_splits,
        target_programs=cfg.attn_target_programs or 4 * sm_count(),
        num_warps=cfg.attn_num_warps, interpret=resolve_impl(scfg.impl) == "interpret",
        softcap=config.attn_logit_softcap, **opts)
    io = _with_kernel_caches(view, io, layer, k_out, v_out)
    blocks = scfg.threshold_blocks or kernels.ThresholdConfig()
    if blocks.o_merges_splits and o.shape[0] <= _MERGED_SPLITS:
        return o.reshape(o.shape[0], B, H * hd), (m, l), io
    return merge_splits(o, m, l).reshape(B, H * hd), None, io


def _all_written(config, io: _LayerIO, layer, step, stop=None) -> _LayerIO:
    """io with every KV group's entry of this layer (of layers `layer` up to `stop`) at this
    token marked written."""
    n = 1 if stop is None else stop - layer
    all_written = jnp.ones((io.written.shape[0], n, config.n_kv_heads, 1), bool)
    return io.replace(written=jax.lax.dynamic_update_slice(
        io.written, all_written, (0, layer, 0, step["slot"])))



def _dense_batch_attention(config, view, io: _LayerIO, layer, y, step):
    """(output [B, d] fp32, io): XLA's dense attention, for a batch whose union holds every
    query head (it writes and marks every group's K/V of this token, so no later token needs
    this token's row of the missing-KV ring, which it may leave unwritten)."""
    out, k, v = dense_attention(config, view.lp, y, io.k, io.v, layer, step)
    return out.astype(F32), _all_written(config, io.replace(k=k, v=v), layer, step)


def _row_heads_attention(config, scfg, view, io: _LayerIO, layer, y, heads, step):
    """(output [B, d] fp32, io): a batch whose rows select their own heads [B, k] and whose
    union's capacity min(H, B k) is every head: XLA's dense projections (the weights all
    rows read anyway), every group's K/V of this token written and marked, and each row's
    attention core over its own heads only (`kernels.row_head_attention`: the KV reads,
    which grow with batch x context, shrink to each row's groups)."""
    from dejavu_jax.model import write_kv
    lp = view.lp
    q, k, v = ops.project_qkv(config, lp, y, step["positions"], layer)
    io = io.replace(k=write_kv(io.k, layer, step["slot"], k),
                    v=write_kv(io.v, layer, step["slot"], v))
    groups, mask = kernels.query_head_groups(heads, config.n_kv_heads, config.group_size,
                                             n_groups=config.n_kv_heads)
    k_in, v_in, ids = _kernel_caches(config, view, io, layer, groups)
    heads_out, k_out, v_out = kernels.row_head_attention(
        q, k_in, v_in, step["slot"], mask, kv_mask=_attended_slots(config, layer, step),
        group_ids=ids, softcap=config.attn_logit_softcap, impl=scfg.impl,
        config=scfg.attn_config)
    io = _with_kernel_caches(view, io, layer, k_out, v_out)
    out = ops.out_project(lp, heads_out)
    return out.astype(F32), _all_written(config, io, layer, step)


def _row_heads_project_densely(config, heads) -> bool:
    """Whether a batch's per-row heads [B, k] run `_row_heads_attention`: their union's
    capacity is every head, though each row's set is not."""
    if heads.ndim != 2:
        return False
    B, k = heads.shape
    return k < config.n_heads <= B * k


def batch_runs_dense(scfg: SparseConfig, batch: int) -> bool:
    """Whether a step of `batch` rows runs every layer dense (`SparseConfig.batch_policy`
    "dense"; the oracle, which computes densely anyway, keeps its masks)."""
    return batch > 1 and scfg.batch_policy == "dense" and not scfg.oracle


def batch_dense_parts(config: ModelConfig, scfg: SparseConfig, n_neurons: int,
                      n_heads: int, batch: int) -> tuple[bool, bool, bool]:
    """(attention, mlp, layer): which parts of a sparse layer run XLA's dense products for
    a batch whose (static-size) sets hold n_neurons neurons and n_heads query heads, as a
    union's capacity min(n, k * B) often makes them (`SparseConfig.batch_policy`): under
    "dense", everything; under "union", every head, the attention; at least
    `batch_dense_mlp` of F, the MLP (masked unless every neuron); every head and every
    neuron, the whole dense layer."""
    if batch == 1 or scfg.batch_policy == "kernels":
        return False, False, False
    if batch_runs_dense(scfg, batch):
        return True, True, True
    attention = n_heads == config.n_heads
    return (attention, n_neurons >= scfg.batch_dense_mlp * config.ffn,
            attention and n_neurons == config.ffn)


def _dense_parts(config, scfg, x: jax.Array, neurons, heads) -> tuple[bool, bool, bool]:
    """`batch_dense_parts` of a layer's rows x [B, d] and index sets."""
    return batch_dense_parts(config, scfg, neurons.shape[-1], heads.shape[-1], x.shape[0])


def _sparse_layer(config, scfg, view, io, layer, x, neurons, heads, step, reduce=None):
    """One DejaVu layer: head-sparse attention, then the sparse MLP. A batch whose set
    holds every query head runs XLA's dense attention; one whose sets hold every neuron too
    runs `_dense_layer`."""
    dense_attention_part, dense_mlp, dense_layer = _dense_parts(config, scfg, x, neurons,
                                                                 heads)
    if dense_layer:
        return _dense_layer(config, view, io, layer, x, step, reduce=reduce)
    box = {}

    def attn(y):
        if dense_attention_part:
            out, box["io"] = _dense_batch_attention(config, view, io, layer, y, step)
        elif _row_heads_project_densely(config, heads):
            out, box["io"] = _row_heads_attention(config, scfg, view, io, layer, y, heads,
                                                  step)
        else:
            out, box["io"] = _sparse_attention(config, scfg, view, io, layer, y, heads, step)
        return _reduced(reduce, out)

    lp = view.lp
    h = ops.residual(config, x, attn, lp.attn_norm_scale, lp.attn_norm_bias,
                     lp.post_attn_norm_scale)
    x = ops.residual(config, h,
                     lambda y: _reduced(reduce, _sparse_mlp(config, scfg, view, y, neurons,
                                                            dense=dense_mlp)),
                     lp.mlp_norm_scale, lp.mlp_norm_bias, lp.post_mlp_norm_scale)
    return x, box["io"]


def _fused_sparse_layer(config, scfg, view, io, layer, x, neurons, heads, step, lookahead,
                        rms_dtype=None):
    """One DejaVu layer of a pre-norm model on one device, its residual adds done by the
    out-projection and fc2 launches (`residual=`), which add into the residual rows.

    `lookahead(x, x_rms, mlp_kernels)` returns the next layer's sets, or a pair (Segment,
    finish) whose first product rides in the attention's q/k/v projection launch (where
    the attention projects densely, in the MLP norm's launch) and whose
    `finish(partials)` gives the sets or, only where `mlp_kernels` (this layer's MLP runs
    through the kernels), the `Riders` that select inside the MLP's two launches.
    x_rms (x over its RMS, in `rms_dtype`) is None unless `rms_dtype` is given. Returns
    (output rows, the layer's input rows, io, next sets). A batch whose set holds every
    query head runs XLA's dense attention; one whose sets hold every neuron too runs
    `_dense_layer`.
    """
    lp = view.lp
    eps = config.norm_eps
    x = x.astype(F32)
    dense_attention_part, dense_mlp, dense_layer = _dense_parts(config, scfg, x, neurons,
                                                                 heads)
    if dense_layer:
        nxt = lookahead(x, None)
        out, io = _dense_layer(config, view, io, layer, x, step)
        return out.astype(F32), x, io, nxt
    def norm(rows, scale, bias, **kw):
        return kernels.layer_norm(rows, scale, bias, eps, out_dtype=scale.dtype,
                                  impl=scfg.impl, **kw)

    # the attention norm's launch also writes the ring row of this token's input
    ring, ring_row = _history_rows(io, layer, step["slot"], scfg.kv_window)
    y, *rest = norm(x, lp.attn_norm_scale, lp.attn_norm_bias, rms_dtype=rms_dtype,
                    ring=ring, ring_row=ring_row)
    rms = rest[0] if rms_dtype is not None else None
    dense_projection = dense_attention_part or _row_heads_project_densely(config, heads)
    nxt = lookahead(x, rms, not dense_mlp)
    split = isinstance(nxt, tuple) and callable(nxt[1])
    if dense_projection:  # batches only
        io = _with_history_rows(io, layer, rest[-1])[0]  # keep the norm's ring write
        if dense_attention_part:
            out, io = _dense_batch_attention(config, view, io, layer, y, step)
        else:
            out, io = _row_heads_attention(config, scfg, view, io, layer, y, heads, step)
        h = x + out
    else:
        h, io, *extra_parts = _sparse_attention(
            config, scfg, view, io, layer, y, heads, step, residual=x,
            extra_segments=(nxt[0],) if split else (), history_rows=rest[-1])
    if split and dense_projection:  # no projection launch: it rides in the MLP norm's
        y, ((parts,),) = norm(h, lp.mlp_norm_scale, lp.mlp_norm_bias,
                              riders=[first_product_part(nxt[0])])
        nxt = nxt[1](parts)
    else:
        if split:
            nxt = nxt[1](extra_parts[0][0])
        y = norm(h, lp.mlp_norm_scale, lp.mlp_norm_bias)
    if not isinstance(nxt, Riders):
        out = _sparse_mlp(config, scfg, view, y, neurons, residual=h, dense=dense_mlp)
        return out, x, io, nxt
    out, (nxt,) = _sparse_mlp(config, scfg, view, y, neurons, residual=h, riders=nxt)
    return out, x, io, nxt


def _reduced(reduce, out: jax.Array) -> jax.Array:
    """`reduce(out)`, or out when there is no reduce hook (one device)."""
    return out if reduce is None else reduce(out)


def _next_layer(layer, n_layers: int):
    """The layer the lookahead predicts: layer + 1 (the last layer predicts itself, unused);
    a Python int for a static layer id (unrolled layers), else traced."""
    if isinstance(layer, int):
        return min(layer + 1, n_layers - 1)
    return jnp.minimum(jnp.asarray(layer, jnp.int32) + 1, n_layers - 1)


def _layer_loop(body, carry, start: int, stop: int, unrolled: bool, unroll: int | bool = 1):
    """lax.scan over traced layer ids start..stop-1 (`unroll` layers per iteration), or a
    Python loop over static ids (per-layer weights, or `unroll` True).

    A segment of no more layers than `unroll` still loops one layer per iteration: inlined,
    it would join the step's first command buffer, whose launch the device waits for when
    the host synchronises every step (docs/benchmarks.md)."""
    if unrolled or unroll is True:
        for layer in range(start, stop):
            carry, _ = body(carry, layer)
        return carry
    return jax.lax.scan(body, carry, jnp.arange(start, stop, dtype=jnp.int32),
                        unroll=unroll if stop - start > unroll else 1)[0]


def sparse_layers(config: ModelConfig, scfg: SparseConfig, params: ModelParams,
                  select: Selector, selector_params, x: jax.Array, io: _LayerIO, step: dict,
                  reduce=None):
    """Run every layer for one token per row; returns (x, io).

    reduce: applied to each attention and MLP output before the residual add (tensor
    parallelism passes a psum over the mesh axis, see `dejavu_jax.tp_decode`).
    """
    unrolled = isinstance(params.layers, tuple)
    if batch_runs_dense(scfg, x.shape[0]):
        scfg = dataclasses.replace(scfg, dense_layers=config.n_layers)
    if scfg.batch_policy == "shared" and x.shape[0] > 1 and hasattr(select, "shared_batch"):
        select = select.shared_batch(step.get("live"))
    step = {**step, "window": _window_step(config, scfg, step)}  # this (shard's) config
    if config.rotary:  # every kind of layer's RoPE tables, once per step
        step["rope"] = ops.step_rope_tables(config, step["positions"])
    prev_input = x  # the input of the layer before the segment (lookahead source)
    planned = scfg
    for start, stop, dense, k_mlp, k_heads, mode in planned.layer_runs(config, x.shape[0]):
        scfg = planned_config(planned, mode)
        if dense and _dense_in_place(config, scfg, params, x.shape[0], reduce):
            x, prev_input, io = _fused_segment(
                config, in_place_dense_config(scfg), params, _every_unit, None, x, io, step,
                _every_unit(None, start, x, config.ffn, config.n_heads), start, stop,
                config.ffn, config.n_heads, unrolled)
            continue
        if dense or scfg.oracle:
            oracle_k = None if dense else (k_mlp, k_heads)

            def dense_body(carry, layer, oracle_k=oracle_k):
                x, io, _ = carry
                x_next, io = _dense_layer(config, _layer_view(params, layer), io, layer, x,
                                          step, oracle_k, reduce)
                return (x_next, io, x), None

            x, io, prev_input = _layer_loop(dense_body, (x, io, prev_input), start, stop,
                                            unrolled, scfg.scan_unroll())
            continue
        if scfg.threshold_sites:
            def threshold_body(carry, layer):
                x, io, _ = carry
                x_next, io = _threshold_layer(config, scfg, _layer_view(params, layer), io,
                                              layer, x, step, selector_params, reduce)
                return (x_next, io, x), None

            x, io, prev_input = _layer_loop(threshold_body, (x, io, prev_input), start, stop,
                                            unrolled, scfg.scan_unroll())
            # every head of these layers wrote this token's K/V: one update, not one a layer
            io = _all_written(config, io, start, step, stop)
            continue

        first = start if unrolled else jnp.asarray(start, jnp.int32)
        idx = select(selector_params, first, prev_input if start > 0 else x, k_mlp, k_heads)
        if config.pre_norm and reduce is None and not config.post_norms:
            # the fused layer adds each sublayer's output inside its last launch, so a
            # sublayer output that is normed first (Gemma's post-norms) runs unfused
            x, prev_input, io = _fused_segment(config, scfg, params, select, selector_params,
                                               x, io, step, idx, start, stop, k_mlp, k_heads,
                                               unrolled)
            continue

        def sparse_body(carry, layer, k_mlp=k_mlp, k_heads=k_heads):
            x, io, (neurons, heads), _ = carry
            nxt = _next_layer(layer, config.n_layers)
            idx_next = select(selector_params, nxt, x, k_mlp, k_heads)  # lookahead
            x_next, io = _sparse_layer(config, scfg, _layer_view(params, layer), io, layer, x,
                                       neurons, heads, step, reduce)
            return (x_next, io, idx_next, x), None

        x, io, _, prev_input = _layer_loop(sparse_body, (x, io, idx, prev_input), start, stop,
                                           unrolled, scfg.scan_unroll())
    return x, io


def _every_unit(params, layer, x, k_mlp: int, k_heads: int):
    """A Selector of every neuron and query head (`k_mlp`, `k_heads` of them)."""
    return jnp.arange(k_mlp, dtype=jnp.int32), jnp.arange(k_heads, dtype=jnp.int32)


IN_PLACE_DENSE_FC2_BLOCK_D = 256


def in_place_dense_config(scfg: SparseConfig) -> SparseConfig:
    """scfg for a dense segment run through the kernels (`_dense_in_place`): fc2's
    columns in blocks of `IN_PLACE_DENSE_FC2_BLOCK_D` unless `mlp_config` sets them. With
    every neuron read, narrower column blocks give fc2 more programs to stream with (opt-6.7b
    dense over stacked weights, H100: 6.20 ms a synchronised step against 6.59 at 512,
    eval/results/h100/in-place-dense-mlp-blocks); the sparse layers keep 512."""
    mlp = scfg.mlp_config or kernels.MLPConfig()
    if mlp.fc2_block_d is None:
        mlp = dataclasses.replace(mlp, fc2_block_d=IN_PLACE_DENSE_FC2_BLOCK_D)
    return dataclasses.replace(scfg, mlp_config=mlp)


def _dense_in_place(config: ModelConfig, scfg: SparseConfig, params: ModelParams,
                    batch: int, reduce) -> bool:
    """Whether a dense segment runs through the sparse kernels with every unit selected:
    over stacked weights at batch 1 on the Pallas paths, where the kernels read each layer
    in place and XLA's dense products would copy its slice of the stack first."""
    from dejavu_jax.kernels._common import resolve_impl
    return (not isinstance(params.layers, tuple) and batch == 1 and reduce is None
            and config.pre_norm and not config.post_norms and params.layers.wq is not None
            and resolve_impl(scfg.impl) != "reference")


def planned_config(scfg: SparseConfig, mode: str | None) -> SparseConfig:
    """scfg with a planned layer mode's MLP rule: "masked" runs the union's MLP as the
    masked dense product at any size, "sparse" through the kernels at any size."""
    if mode == "masked":
        return dataclasses.replace(scfg, batch_dense_mlp=1e-12)
    if mode == "sparse":
        return dataclasses.replace(scfg, batch_dense_mlp=math.inf)
    return scfg


def _fused_segment(config, scfg, params, select, selector_params, x, io, step, idx, start,
                   stop, k_mlp, k_heads, unrolled):
    """A sparse segment of a pre-norm model on one device (`_fused_sparse_layer`).
    Returns (x, the last layer's input, io)."""
    split = (hasattr(select, "splits") and select.splits(selector_params, x.shape[0])
             and k_mlp < config.ffn)   # every neuron: nothing to rank (`PredictorSelector._top`)
    ride = (not split and hasattr(select, "rides_batch")
            and select.rides_batch(selector_params, x.shape[0], k_mlp, scfg.impl))
    # over stacked weights the split selection writes the ids offset into the flattened
    # weights, sparing the scan two XLA launches per layer
    offset_ids = split and not unrolled
    if offset_ids:
        idx = _offset_sets(idx, start, config.ffn, config.n_heads)

    def sparse_body(carry, layer):
        x, io, (neurons, heads), _ = carry
        nxt = _next_layer(layer, config.n_layers)

        def lookahead(x_in, x_rms, mlp_kernels=False):
            if split:
                return (select.first_segment(selector_params, nxt, x_rms),
                        lambda parts: select.finish(selector_params, nxt, parts, k_mlp,
                                                    k_heads, scfg.impl, offset_ids))
            if ride and x_rms is not None and mlp_kernels:
                return (select.first_segment(selector_params, nxt, x_rms),
                        lambda parts: select.batch_riders(selector_params, nxt, parts,
                                                                k_mlp, k_heads))
            return select(selector_params, nxt, x_in, k_mlp, k_heads)

        view = _layer_view(params, layer).replace(offset_ids=offset_ids)
        x_next, x_in, io, idx_next = _fused_sparse_layer(
            config, scfg, view, io, layer, x, neurons, heads, step,
            lookahead, selector_params.w1t.dtype if split or ride else None)
        return (x_next, io, idx_next, x_in), None

    x, io, _, last_input = _layer_loop(sparse_body, (x.astype(F32), io, idx, x.astype(F32)),
                                       start, stop, unrolled, scfg.scan_unroll())
    return x, last_input, io


def sparse_step_fn(config: ModelConfig, scfg: SparseConfig, select: Selector,
                   params: tuple, state: SparseState, tokens: jax.Array, layers_fn=None):
    """One sparse decode step for tokens [B]: returns (logits [B, V] fp32, new state).

    params is (model params, selector params). layers_fn replaces `sparse_layers` (same
    signature; `dejavu_jax.tp_decode` runs it per shard under shard_map). Tokens must lie in
    [0, vocab_size): concrete ones are checked, traced ones are the caller's contract.
    """
    check_step_tokens(tokens, config.vocab_size, state.dense)
    check_step_positions(config, state.dense)
    params, selector_params = engine_params(params)
    check_selector_params(config, scfg, select, selector_params)
    check_cache_layout(params, state.dense)
    if has_fused_qkv(params):
        raise ValueError("the sparse step gathers heads from wq/wk/wv: pass params without "
                         "params.fuse_qkv (it is for the dense engine)")
    dense = state.dense
    valid = jax.lax.dynamic_update_slice(
        dense.valid, jnp.ones((dense.valid.shape[0], 1), bool), (0, dense.slot))
    step = {"slot": dense.slot, "valid": valid, "positions": dense.positions,
            "live": dense.live}
    x = embed(config, params, tokens, dense.positions)
    io = _LayerIO(k=dense.k, v=dense.v, written=state.written, history=state.history)
    x, io = (layers_fn or sparse_layers)(config, scfg, params, select, selector_params, x, io,
                                         step)
    new_dense = DecodeState(k=io.k, v=io.v, valid=valid, slot=dense.slot + 1,
                            positions=dense.positions + 1, live=dense.live)
    return unembed(config, params, x), SparseState(dense=new_dense, written=io.written,
                                                   history=io.history)


def engine_params(params) -> tuple:
    """(model params, selector params) of a sparse engine's params; ValueError for others
    (model params alone)."""
    if not (isinstance(params, (tuple, list)) and len(params) == 2
            and isinstance(params[0], ModelParams)):
        raise ValueError(f"a sparse engine's params are (model params, selector params): "
                         f"(params, predictors), (params, None) for the oracle; got "
                         f"{type(params).__name__}")
    return tuple(params)


def check_predictors(config: ModelConfig, pred_params) -> None:
    """ValueError unless trained predictors (either form, `train.predictor_model`) score
    every layer's neurons and query heads of `config` from its hidden size."""
    from dejavu_jax.train.predictor_model import DecodePredictors, PredictorParams
    if not isinstance(pred_params, (DecodePredictors, PredictorParams)):
        raise ValueError(f"the predictor selector needs predictors (train.predict."
                         f"load_predictors), got {type(pred_params).__name__}")
    got = pred_params.dims
    want = (config.n_layers, config.hidden, config.ffn, config.n_heads)
    if got != want:
        raise ValueError(f"the predictors score {got[0]} layers of {got[2]} neurons and "
                         f"{got[3]} heads from {got[1]} inputs; {config.name} has "
                         f"{want[0]}, {want[2]}, {want[3]} and {want[1]}")


# the measured-best top-k methods (docs/kernels.md); the slower ones the benchmarks compare
# against are `sparse_variants.TOP_K_VARIANTS`
SELECT_METHODS = ("exact", "local")
# the most rows `kernels.union_select` holds in one program; a larger batch's "local"
# union counts passes (`topk.union_top_k`) instead
LOCAL_UNION_ROWS = 64


class PredictorSelector:
    """The Selector of trained predictors (see `predictor_selector`).

    With decode-form predictors (`train.predictor_model.DecodePredictors`), batch 1, the
    "local" method and one query head per KV group, a pre-norm decode step splits it
    across the layer (`splits`): the first product is one more segment of the attention's
    projection launch (`first_segment`); on the Pallas paths `finish` then has the score
    product ride in the fc1 launch and the selection in the fc2 launch, else it selects
    in two launches of its own (`kernels.predictor_select.predictor_select`). The sets are
    those of calling it.
    """

    def __init__(self, group_size: int, union_capacity=None, method: str = "exact",
                 impl: str | None = None, ride_mlp_launches: bool = True,
                 row_heads: bool = True, batch_kernels: bool = True,
                 batch_heads_in_fc1: bool = False):
        from dejavu_jax.sparse_variants import TOP_K_VARIANTS
        if method not in SELECT_METHODS + TOP_K_VARIANTS:
            raise ValueError(f"unknown selection method {method!r}; choose from "
                             f"{SELECT_METHODS}")
        self.group_size, self.method, self.impl = group_size, method, impl
        self.union_capacity = union_capacity or (None, None)
        self.ride_mlp_launches = ride_mlp_launches
        self.row_heads = row_heads
        self.batch_kernels = batch_kernels
        self.batch_heads_in_fc1 = batch_heads_in_fc1
        self.shared = False   # one set for a whole batch: `shared_batch`
        self.live_rows = None   # the rows whose scores make a shared set ([B] bool; None: all)

    def shared_batch(self, live: jax.Array | None = None) -> "PredictorSelector":
        """This selector with one set per layer for a whole batch (`SparseConfig.batch_policy`
        "shared"): the top-k of `shared_scores`, selected as for one row, over the rows
        `live` [B] bool (every row when None; finished rows do not weigh in)."""
        import copy
        out = copy.copy(self)
        out.shared, out.live_rows = True, live
        return out

    def _top(self, scores, k, capacity):
        from dejavu_jax.kernels.top_k import top_k_indices_local
        from dejavu_jax.kernels.union_select import union_top_k_local
        from dejavu_jax.topk import union_top_k
        from dejavu_jax.train.predict import default_union_size, select_top_k
        method, impl = self.method, self.impl
        if k >= scores.shape[1] and capacity in (None, k):   # every unit: nothing to rank
            return jnp.arange(scores.shape[1], dtype=jnp.int32)
        if scores.shape[0] == 1 and capacity in (None, k):
            if method == "local":
                return top_k_indices_local(scores[0], k, impl=impl)
            if method != "exact":  # a benchmark variant (`sparse_variants`)
                from dejavu_jax.sparse_variants import variant_top_k
                ids = variant_top_k(method, scores[0], k, impl)
                if ids is not None:
                    return ids
        if scores.shape[0] > 1 and method == "local" and capacity is None:
            if k * scores.shape[0] >= scores.shape[1]:   # every unit: nothing to rank
                return jnp.arange(scores.shape[1], dtype=jnp.int32)
            if scores.shape[0] <= LOCAL_UNION_ROWS:
                return union_top_k_local(scores, k, impl=impl)
        if scores.shape[0] > 1 and method != "exact":
            capacity = capacity or default_union_size(scores.shape[1], k, scores.shape[0])
            return union_top_k(scores, k, capacity)
        return select_top_k(scores, k, capacity)

    def selects_batch_in_kernels(self, pred_params, batch: int, k_mlp: int) -> bool:
        """Whether a batch of `batch` rows selects through
        `kernels.batch_predictor_select` (decode-form predictors, the "local" method, the
        union of the rows' neurons at its default size short of every neuron, per-row
        heads)."""
        from dejavu_jax.kernels.batch_predictor_select import MAX_HEADS
        from dejavu_jax.train.predictor_model import DecodePredictors
        return (self.batch_kernels and isinstance(pred_params, DecodePredictors)
                and 2 <= batch <= 64 and self.method == "local" and not self.shared
                and self.row_heads and self.union_capacity == (None, None)
                and k_mlp * batch < pred_params.w2_mlp.shape[-1]
                and pred_params.w2_heads.shape[-1] <= MAX_HEADS)

    def __call__(self, pred_params, layer, x, k_mlp, k_heads):
        from dejavu_jax.train.predict import predictor_scores
        if self.selects_batch_in_kernels(pred_params, x.shape[0], k_mlp):
            from dejavu_jax.kernels.batch_predictor_select import batch_predictor_select
            from dejavu_jax.train.predictor_model import rms_normalise
            p = pred_params
            return batch_predictor_select(
                rms_normalise(x).astype(p.w1t.dtype), p.w1t, p.b1, p.w2_mlp, p.b2_mlp,
                p.w2_heads, p.b2_heads, jnp.asarray(layer, jnp.int32), k_mlp, k_heads,
                activation=p.activation, impl=self.impl)
        mlp, heads = predictor_scores(pred_params, layer, x)   # heads: per query head
        if self.shared and x.shape[0] > 1:
            rows = self.live_rows
            return (self._top(shared_scores(mlp, rows), k_mlp, None),
                    self._top(shared_scores(heads, rows), k_heads, None))
        cap_mlp, cap_heads = self.union_capacity
        if heads.shape[0] > 1 and cap_heads is None and self.row_heads:   # each row its own
            return (self._top(mlp, k_mlp, cap_mlp), row_top_k(heads, k_heads))
        return (self._top(mlp, k_mlp, cap_mlp), self._top(heads, k_heads, cap_heads))

    def rides_batch(self, pred_params, batch: int, k_mlp: int, impl=None) -> bool:
        """Whether a batch's selection (`selects_batch_in_kernels`) may ride in the sparse
        MLP's launches (`batch_riders`): with `ride_mlp_launches`, where both the MLP (the
        step's `impl`) and the selection run on the Pallas paths."""
        return (self.ride_mlp_launches and self._both_pallas(impl)
                and self.selects_batch_in_kernels(pred_params, batch, k_mlp))

    def _both_pallas(self, step_impl) -> bool:
        """Whether the step's kernels (`step_impl`) and this selector's run on the Pallas
        paths, so that the selection can ride in the MLP's launches."""
        from dejavu_jax.kernels._common import resolve_impl
        own = self.impl if self.impl is not None else step_impl
        return resolve_impl(step_impl) != "reference" and resolve_impl(own) != "reference"

    def batch_riders(self, pred_params, layer, h_parts, k_mlp, k_heads) -> Riders:
        """The `kernels.sparse_mlp.Riders` of a batch's selection from the first product's
        partials [P, B, >= R] (`first_segment`, riding in another launch): the score
        product rides in the fc1 launch and the selection in the fc2 launch, whose outputs
        are the sets of calling the selector."""
        from dejavu_jax.kernels.batch_predictor_select import batch_selection_parts_after
        p = pred_params
        first, then_of = batch_selection_parts_after(
            h_parts, p.b1, p.w2_mlp, p.b2_mlp, p.w2_heads, p.b2_heads,
            jnp.asarray(layer, jnp.int32), k_mlp, k_heads, activation=p.activation,
            heads_first=self.batch_heads_in_fc1)
        return Riders(first, lambda outs: [then_of(outs)])

    def splits(self, pred_params, batch: int) -> bool:
        """Whether a decode step may run this selector split across the layer."""
        from dejavu_jax.train.predictor_model import DecodePredictors
        return (isinstance(pred_params, DecodePredictors) and batch == 1
                and self.method == "local" and self.group_size == 1
                and self.union_capacity == (None, None))

    def first_segment(self, pred_params, layer, x_rms):
        """The first product as a `kernels.gather_matvec.Segment` of layer `layer`'s rows,
        on inputs x_rms [B, d] (x over its RMS, in the predictors' dtype)."""
        from dejavu_jax.kernels.gather_matvec import Segment
        L, r, d = pred_params.w1t.shape
        return Segment(pred_params.w1t.reshape(L * r, d),
                       jnp.asarray(layer, jnp.int32).reshape(1), r, x=x_rms)

    def finish(self, pred_params, layer, h_parts, k_mlp, k_heads, impl=None,
               offset_ids: bool = False):
        """(neuron ids, query-head ids) from the first product's partials, or where the
        step's kernels (`impl`) and the selector's run on the Pallas paths, with
        `ride_mlp_launches`, the `kernels.sparse_mlp.Riders` that select inside the MLP's
        launches: the score product beside fc1, the selection ahead of fc2, whose outputs
        are those ids. `offset_ids`: the ids offset by the layer's rows in the stacked
        weights flattened over layers (layer * F + neuron, layer * H + head)."""
        from dejavu_jax.kernels.predictor_select import predictor_select, selection_parts
        p = pred_params
        args = (h_parts, p.b1, p.w2_mlp, p.b2_mlp, p.w2_heads, p.b2_heads, layer, k_mlp,
                k_heads)
        if self.ride_mlp_launches and self._both_pallas(impl):
            score, select_of = selection_parts(*args, activation=p.activation,
                                               offset_ids=offset_ids)
            return Riders((score,), lambda outs: [select_of(outs[0][0])])
        sets = predictor_select(*args, activation=p.activation, impl=self.impl)
        if offset_ids:
            sets = _offset_sets(sets, layer, p.b2_mlp.shape[1], p.b2_heads.shape[1])
        return sets


def shared_scores(logits: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """A batch's scores [1, n] for one shared set, from its rows' predictor logits [B, n]:
    the expected number of rows that need each unit, the sum of the rows' predicted
    probabilities (rows weighted by `weights` [B] when given)."""
    p = jax.nn.sigmoid(logits.astype(F32))
    if weights is not None:
        p = p * weights.astype(F32)[:, None]
    return p.sum(0, keepdims=True)


def row_top_k(scores: jax.Array, k: int) -> jax.Array:
    """Each row's top-k unit ids of scores [B, n], ascending: [B, k] int32."""
    return jnp.sort(jax.lax.top_k(scores, k)[1], axis=-1).astype(jnp.int32)


def predictor_selector(group_size: int,
                       union_capacity: tuple[int | None, int | None] | None = None,
                       method: str = "exact", impl: str | None = None) -> PredictorSelector:
    """A Selector whose parameters are trained predictors (`dejavu_jax.train.predict`).

    Batches select the union of their rows' neuron sets, of static size min(n, k * B) by
    default (`union_capacity` sets it): "exact" through `train.predict.select_top_k`
    (per-row `lax.top_k` and a sort), "local" through `kernels.union_select` (the union
    of the rows' local top-k sets, chunk by chunk, in one launch; about min(n, k * B)
    ids; past `LOCAL_UNION_ROWS` rows as below), or with a `union_capacity` through
    `topk.union_top_k` (counting passes, no sort). A union of every unit needs no ranking
    at all. Heads are per row ([B, k] ids: each row attends with its own,
    `kernels.head_sparse_attention`'s per-row masks), unless `union_capacity` gives their
    union a size.
    method (`SELECT_METHODS`), for a single row: "exact" (`lax.top_k`, a sort on the GPU;
    the default, the true top-k) or "local" (`kernels.top_k.top_k_indices_local`: the top
    round(k/P) of each of P chunks of 2048 scores in one launch of parallel programs, impl
    picking its kernel path; approximate, and the set size rounds to a multiple of P; the
    fastest on the GPU, and with decode-form predictors at batch 1 the step runs it split
    across the layer, riding in the MLP's launches, see `PredictorSelector`). The slower
    methods the benchmarks compare are `dejavu_jax.sparse_variants.variant_selector`'s.
    """
    if method not in SELECT_METHODS:
        raise ValueError(f"unknown selection method {method!r}; choose from {SELECT_METHODS}")
    return PredictorSelector(group_size, union_capacity, method, impl)


def fixed_selector(sets, layer, x, k_mlp, k_heads):
    """A Selector whose parameters are precomputed sets: (neuron_idx [L, K], head_idx [L, Kh])
    (head ids: query heads; [L, B, Kh]: each batch row its own heads),
    or tuples of per-layer arrays ([K] and [Kh] each; unrolled layers only, whose layer ids
    are static). Per-layer arrays of exactly k ids reach the kernels as they are; a row of
    the stacked arrays is a slice that XLA copies before every kernel that reads it.

    For benchmarks that exclude predictor time, and for tests.
    """
    neuron_idx, head_idx = sets
    if isinstance(neuron_idx, (tuple, list)):
        if not isinstance(layer, int):
            raise TypeError("per-layer index sets need static layer ids (unrolled layers)")
        return neuron_idx[layer][:k_mlp], head_idx[layer][..., :k_heads]
    return neuron_idx[layer, :k_mlp], head_idx[layer][..., :k_heads]


def check_fixed_sets(config: ModelConfig, scfg: SparseConfig, sets) -> None:
    """ValueError unless `fixed_selector`'s sets hold, for every sparse layer, at least its
    k ids, and (when concrete) distinct in-range ids among the k it reads: an id past the
    weights is clamped by the gathers, and a repeated one counts its unit twice. Oracle and
    threshold configs select inside the layer and read no sets."""
    if scfg.oracle or scfg.threshold_sites:
        return
    neuron_idx, head_idx = sets
    for layer in range(scfg.dense_layers, config.n_layers):
        for name, idx, k, n in (("neuron", neuron_idx, scfg.mlp_k[layer], config.ffn),
                                ("head", head_idx, scfg.head_k[layer], config.n_heads)):
            row = idx[layer]
            if np.shape(row)[-1] < k:
                raise ValueError(f"fixed {name} sets: layer {layer} has {np.shape(row)[-1]} "
                                 f"ids, the SparseConfig reads {k}")
            if isinstance(row, jax.core.Tracer):
                continue
            ids = np.asarray(row)[..., :k].reshape(-1, k)
            bad = ids[(ids < 0) | (ids >= n)]
            if bad.size:
                raise ValueError(f"fixed {name} sets: layer {layer} holds id {int(bad[0])}, "
                                 f"outside [0, {n})")
            if any(len(set(r.tolist())) < k for r in ids):
                raise ValueError(f"fixed {name} sets: layer {layer} repeats an id among "
                                 f"its first {k}")


def check_thresholds(config: ModelConfig, thresholds) -> None:
    """ValueError unless a threshold config's selector params are [L, len(SITES)] and (when
    concrete) finite numbers >= 0, as a sparsity profile's are."""
    from dejavu_jax.activation_sparsity import SITES
    want = (config.n_layers, len(SITES))
    got = None if thresholds is None else np.shape(thresholds)
    if got != want:
        raise ValueError(f"thresholds must be [layers, sites] = {list(want)} (sites "
                         f"{', '.join(SITES)}), got {got}")
    if not isinstance(thresholds, jax.core.Tracer):
        table = np.asarray(thresholds, np.float32)
        if not np.all(np.isfinite(table)) or np.any(table < 0):
            raise ValueError("thresholds must be finite numbers >= 0")


def no_selector(params, layer, x, k_mlp, k_heads):
    """The Selector of all-dense, oracle and threshold configs, which select inside the
    layer; a config with predicted layers raises ValueError when its step calls it."""
    raise ValueError("this SparseConfig predicts its sets: build the engine with "
                     "predictor_selector(...) and (params, predictors), or use "
                     "sparse_config(..., oracle=True) with no_selector")


def sparse_engine(config: ModelConfig, scfg: SparseConfig, select: Selector):
    """A generation Engine for sparse decoding; its params are (model, selector params)."""
    import functools

    from dejavu_jax.generation import Engine
    return Engine(
        config=config,
        prefill=functools.partial(sparse_prefill_fn, config),
        step=functools.partial(sparse_step_fn, config, scfg, select),
        init_state=functools.partial(init_sparse_state, config, scfg),
        name="oracle" if scfg.oracle else "sparse",
        check_params=lambda params: check_selector_params(config, scfg, select,
                                                          engine_params(params)[1]))


def check_selector_params(config: ModelConfig, scfg: SparseConfig, select,
                          selector_params) -> None:
    """ValueError unless the selector params fit `select` and the model: predictors of its
    shapes, fixed sets of in-range distinct ids, a threshold table of finite values >= 0
    (values checked when concrete)."""
    if isinstance(select, PredictorSelector):
        check_predictors(config, selector_params)
    if select is fixed_selector:
        check_fixed_sets(config, scfg, selector_params)
    if scfg.threshold_sites:
        check_thresholds(config, selector_params)
