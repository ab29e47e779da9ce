"""Per-layer plans for sparse decoding of a batch, chosen from measured step times.

A batch of several rows reads the union of its rows' sets, and its selection costs launch
time, so a sparse layer may run slower than the dense one; which of three ways a layer
is fastest depends on the union's size, the batch, the context and the device. A plan
(`sparse.SparseConfig.batch_layers`) names one mode per layer:

* "sparse": the union through the sparse kernels (each row attends with its own heads);
* "masked": the same attention, and the MLP as XLA's dense product with the neurons
  outside the union masked to zero (no gathers);
* "dense": the dense layer, with no selection for it.

`measure_batch_plan` times whole chained steps on the device the batch will run on: every
sparse layer dense, then each class of sparse layers (layers of equal k) in each sparse
mode with the others dense, and keeps for each class the fastest mode. A class whose
sparse modes save nothing stays dense, so the chosen step is never slower than dense by
more than the timing noise; the combined plan is timed once more and replaced by the
all-dense one where it is slower.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax.config import ModelConfig
from dejavu_jax.host_choice import host_chosen
from dejavu_jax.sparse import BATCH_LAYER_MODES as LAYER_MODES


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """A measured plan: `layers` (one mode per layer), its chained step time `ms`, the
    all-dense step's `dense_ms` (both per step, the same engine) and every timing taken
    (`trials`: [(plan label, ms)])."""
    layers: tuple[str, ...]
    ms: float
    dense_ms: float
    trials: tuple[tuple[str, float], ...]

    @property
    def all_dense(self) -> bool:
        return all(m == "dense" for m in self.layers)

    def summary(self) -> str:
        """One line: the modes' layer counts and the step time against dense."""
        counts = {m: self.layers.count(m) for m in LAYER_MODES if m in self.layers}
        modes = ", ".join(f"{n} {m}" for m, n in counts.items())
        return (f"batch plan: {modes} layers; measured {self.ms:.3f} ms/step against "
                f"{self.dense_ms:.3f} dense (x{self.dense_ms / self.ms:.2f})")


def layer_classes(config: ModelConfig, scfg, max_classes: int = 4) -> list[tuple[int, ...]]:
    """The sparse layers grouped by (k_mlp, k_heads), in order of first layer; more than
    `max_classes` groups are merged into one (each class costs two timed compiles)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for layer in range(scfg.dense_layers, config.n_layers):
        groups.setdefault((scfg.mlp_k[layer], scfg.head_k[layer]), []).append(layer)
    classes = [tuple(g) for g in groups.values()]
    if len(classes) > max_classes:
        classes = [tuple(range(scfg.dense_layers, config.n_layers))]
    return classes


def plan_layers(config: ModelConfig, classes, modes) -> tuple[str, ...]:
    """Per-layer modes: class i's layers in modes[i], every other layer dense."""
    layers = ["dense"] * config.n_layers
    for cls, mode in zip(classes, modes):
        for layer in cls:
            layers[layer] = mode
    return tuple(layers)


def chained_loop(step, steps: int, choose=None):
    """`(params, state, tokens) -> (state, tokens)`: `steps` decode steps in one
    `lax.fori_loop`, each fed the argmax of the last one's logits (no host round trip), or
    with `choose` the ids it picks on the host from them (`host_choice.host_chosen`)."""
    def loop(params, state, tokens):
        def body(_, carry):
            state, tok = carry
            logits, state = step(params, state, tok)
            if choose is not None:
                return state, host_chosen(choose, logits).astype(tok.dtype)
            return state, jnp.argmax(logits, -1).astype(tok.dtype)
        return jax.lax.fori_loop(0, steps, body, (state, tokens))
    return loop


def chained_ms(step, params, state, tokens, steps: int, repeats: int):
    """(median ms per step of `repeats` runs of `steps` chained steps, state): one jitted
    `chained_loop` with the state donated, run once first to compile and warm."""
    run = jax.jit(chained_loop(step, steps), donate_argnums=1)
    state, _ = run(params, state, tokens)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        state, out = run(params, state, tokens)
        jax.block_until_ready((state, out))
        times.append((time.perf_counter() - t) * 1e3 / steps)
    return float(np.median(times)), state


def held_context(state, context: int):
    """A decode state whose first `context` cache slots count as held tokens (slot,
    validity, positions, and a sparse state's written bitmap), whatever was written
    there: a step then reads the bytes of that context (unwritten entries are zeros)."""
    dense = state.dense if hasattr(state, "dense") else state
    held = jnp.arange(dense.valid.shape[1]) < context
    dense = dense.replace(valid=jnp.broadcast_to(held, dense.valid.shape),
                          slot=jnp.asarray(context, jnp.int32),
                          positions=jnp.full_like(dense.positions, context))
    if not hasattr(state, "dense"):
        return dense
    return state.replace(dense=dense, written=state.written | held)


def steps_needed(n_classes: int, steps: int, repeats: int) -> int:
    """Cache slots `measure_batch_plan` advances the state by, at most."""
    trials = 2 + 2 * n_classes
    return trials * steps * (repeats + 1)


def plan_for(config: ModelConfig, scfg, select, params, batch: int, context: int, *,
             log=None) -> BatchPlan:
    """`measure_batch_plan` for `batch` rows at `context` tokens, on a cache of zeros made
    for the measurement and freed after it (params: (model params in the decode layout,
    selector params))."""
    from dejavu_jax import sparse
    union = dataclasses.replace(scfg, batch_policy="union", batch_layers=())
    engine = sparse.sparse_engine(config, union, select)
    slots = context + 1 + steps_needed(len(layer_classes(config, union)), 8, 3)
    model_params = params[0]
    state = engine.init_state(batch, -(-slots // 64) * 64,
                              jax.tree.leaves(model_params)[0].dtype,
                              per_layer=isinstance(model_params.layers, tuple))
    tokens = jnp.full((batch,), config.padding_id, jnp.int32)
    plan, state = measure_batch_plan(config, union, select, params,
                                     held_context(state, context), tokens, log=log)
    del state
    return plan


def measure_batch_plan(config: ModelConfig, scfg, select, params, state, tokens, *,
                       steps: int = 8, repeats: int = 3, max_classes: int = 4,
                       log=None) -> tuple[BatchPlan, object]:
    """The fastest per-layer plan for this batch (`tokens [B]`, B > 1) and state's context.

    scfg: the sparse config to plan (its policy becomes "union"); select: its selector;
    params: (model params, selector params); state: a sparse state at the context to
    plan for, with room for `steps_needed` more tokens (it is donated and advanced: the
    measurement writes its cache, so pass one made for it). Returns (plan, state).
    """
    from dejavu_jax import sparse
    B = int(tokens.shape[0])
    if B < 2:
        raise ValueError(f"a batch plan is for batches of several rows, got batch {B}")
    base = dataclasses.replace(scfg, batch_policy="union", batch_layers=())
    classes = layer_classes(config, base, max_classes)
    say = log or (lambda _: None)
    trials = []

    def timed(label, layers):
        nonlocal state
        cfg = dataclasses.replace(base, batch_layers=layers)
        step = sparse.sparse_engine(config, cfg, select).step
        ms, state = chained_ms(step, params, state, tokens, steps, repeats)
        trials.append((label, ms))
        say(f"  {label}: {ms:.3f} ms/step")
        return ms

    say(f"measuring a plan for batch {B}: {len(classes)} class(es) of sparse layers")
    dense_layers = plan_layers(config, [], [])
    dense_ms = timed("all dense", dense_layers)
    chosen = []
    for cls in classes:
        label = f"layers {cls[0]}-{cls[-1]}" if len(cls) > 1 else f"layer {cls[0]}"
        best, best_ms = "dense", dense_ms
        for mode in ("sparse", "masked"):
            ms = timed(f"{label} {mode}", plan_layers(config, [cls], [mode]))
            if ms < best_ms:
                best, best_ms = mode, ms
        chosen.append(best)
    layers = plan_layers(config, classes, chosen)
    if len(classes) == 1:   # the one class's best trial is the whole plan's
        ms = best_ms
    elif all(m == "dense" for m in chosen):
        ms = dense_ms
    else:
        ms = timed("combined", layers)
        if ms > dense_ms:
            layers, ms = dense_layers, dense_ms
    return BatchPlan(layers, ms, dense_ms, tuple(trials)), state
