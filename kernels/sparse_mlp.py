"""Contextually-sparse MLP: only the selected neurons' rows of fc1 and fc2ᵀ are read.

``sparse_mlp(x, w1, b1, w2t, b2, idx)`` = ``act(x @ w1[idx].T + b1[idx]) @ w2t[idx] + b2``
(DESIGN.md's contract), with an optional SwiGLU gate: ``act(x @ w_gate[idx].T) *
(x @ w1[idx].T + b1[idx])``.  The batch shares one index set (the union across the
batch).  Two Pallas launches plus one tiny XLA reduction:

1. :func:`~.gather_matvec.gather_matvec` -- fc1 (and gate) rows, split over d, fp32 partials;
2. :func:`~.gather_matvec.gather_matvec_t` -- finishes fc1 in its loader (sum partials,
   bias, activation, gate product), then split-k over the selected fc2ᵀ rows;
3. XLA: sum the split-k partials, add b2, cast to ``x.dtype`` -- or, given a ``residual``,
   nothing: the fc2 launch adds its chunks and b2 into the residual rows.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ._common import (activation_fn, balanced_chunks, cdiv, check_array, check_bias,
                      check_indices, resolve_impl, sm_count)
from .gather_matvec import (Segment, batch_pad, gather_matvec_part, gather_matvec_t_part,
                            partials_loader)
from .launch import launch



@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Block sizes for the two MLP kernels (None = pick from the problem size)."""
    fc1_block_rows: int | None = None  # None: 16 at batch 1, 32 for a batch (measured best)
    fc1_block_d: int = 512
    fc1_d_chunks: int | None = None
    fc2_block_rows: int = 16
    fc2_block_d: int | None = None  # None: 512 at batch 1, 256 for a batch (measured best)
    fc2_row_blocks: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int | None = None  # fc2 programs to aim for (None: 8 per SM)
    fc2_masked_atomics: bool = True  # a batch's rows added by one masked atomic
    evict_first: bool = False  # weight rows loaded with L2's evict-first hint

    def resolve(self, K: int, d: int, B: int) -> "MLPConfig":
        """Fill the automatic fields for ``K`` selected rows, width ``d`` and batch ``B``."""
        bd1 = min(self.fc1_block_d, max(16, _pow2_floor(d)))
        bd2 = min(self.fc2_block_d or (512 if B == 1 else 256), max(16, _pow2_floor(d)))
        bk1 = self.fc1_block_rows or (16 if B == 1 else 32)
        bk1 = bk1 if B == 1 else max(16, bk1)
        bk2 = self.fc2_block_rows if B == 1 else max(16, self.fc2_block_rows)
        c1 = self.fc1_d_chunks
        if c1 is None:
            # at least two d-splits; more only while the row blocks alone leave SMs idle
            n_chunks = cdiv(d, bd1)
            splits = max(2, cdiv(2 * sm_count(), cdiv(K, bk1)))
            c1 = balanced_chunks(n_chunks, cdiv(n_chunks, splits))
        r2 = self.fc2_row_blocks
        if r2 is None:
            tiles = cdiv(K, bk2) * cdiv(d, bd2)
            target = self.target_programs or 8 * sm_count()
            r2 = max(min(4, cdiv(K, bk2)), min(64, tiles // target))
        return dataclasses.replace(self, fc1_block_d=bd1, fc2_block_d=bd2, fc1_d_chunks=c1,
                                   fc2_row_blocks=r2, fc1_block_rows=bk1, fc2_block_rows=bk2)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _validate(x, w1, b1, w2t, b2, idx, activation, w_gate):
    check_array("x", x, ndim=2, floating=True)
    check_array("w1", w1, ndim=2, floating=True)
    F, d = w1.shape
    if x.shape[1] != d:
        raise ValueError(f"x has width {x.shape[1]} but w1 rows have width {d} (w1 is [F, d])")
    check_array("w2t", w2t, shape=(F, d), floating=True)
    if w_gate is not None:
        check_array("w_gate", w_gate, shape=(F, d), floating=True)
    check_bias("b1", b1, (F,))
    check_bias("b2", b2, (d,))
    check_indices("idx", idx, F)
    activation_fn(activation)  # raises on an unknown name


def sparse_mlp_reference(x, w1, b1, w2t, b2, idx, *, activation="relu", w_gate=None):
    """Pure-jnp reference: gathers the rows, fp32 math, output in ``x.dtype``."""
    f32 = jnp.float32
    hi = lax.Precision.HIGHEST
    act = activation_fn(activation)
    xf = x.astype(f32)
    h = jnp.dot(xf, w1[idx].astype(f32).T, precision=hi)
    if b1 is not None:
        h = h + b1[idx].astype(f32)
    if w_gate is not None:
        a = act(jnp.dot(xf, w_gate[idx].astype(f32).T, precision=hi)) * h
    else:
        a = act(h)
    out = jnp.dot(a, w2t[idx].astype(f32), precision=hi)
    if b2 is not None:
        out = out + b2.astype(f32)
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Riders:
    """Other kernels' :class:`~.launch.LaunchPart` s that run inside the sparse MLP's two
    launches, ahead of its own programs: ``fc1`` in the fc1 launch, and ``fc2_of(their
    outputs)`` (a list of tuples) in the fc2 launch. The predictor's score product and
    selection ride here (see ``dejavu_jax.sparse``)."""
    fc1: tuple
    fc2_of: Callable


def sparse_mlp_pallas(x, w1, b1, w2t, b2, idx, *, activation="relu", w_gate=None,
                      interpret=False, config: MLPConfig | None = None, residual=None,
                      riders: Riders | None = None):
    """Pallas path of :func:`sparse_mlp` (no validation; see there for the contract).
    With ``riders``: ``(output, the fc2 riders' outputs)``."""
    B, d = x.shape
    K = int(idx.shape[0])
    cfg = (config or MLPConfig()).resolve(K, d, B)
    fc1_riders = riders.fc1 if riders is not None else ()
    idx = idx.astype(jnp.int32)
    segs = [Segment(w1, idx)] + ([Segment(w_gate, idx)] if w_gate is not None else [])
    fc1 = gather_matvec_part(x, segs, block_rows=cfg.fc1_block_rows, block_d=cfg.fc1_block_d,
                             d_chunks=cfg.fc1_d_chunks, evict_first=cfg.evict_first)
    *rider_outs, parts = launch([*fc1_riders, fc1], num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages, interpret=interpret)
    act_args = list(parts) + ([b1] if b1 is not None else [])
    load_act = functools.partial(partials_loader, nds=parts[0].shape[0], B=B, Bp=batch_pad(B),
                                 has_b1=b1 is not None, gated=w_gate is not None,
                                 activation=activation)
    fc2 = gather_matvec_t_part(act_args, load_act, w2t, idx, B=B,
                               block_rows=cfg.fc2_block_rows, block_d=cfg.fc2_block_d,
                               row_blocks_per_program=cfg.fc2_row_blocks, residual=residual,
                               bias=None if residual is None else b2,
                               masked_atomics=cfg.fc2_masked_atomics,
                               evict_first=cfg.evict_first)
    fc2_riders = riders.fc2_of(rider_outs) if riders is not None else ()
    *rider_outs, (out,) = launch([*fc2_riders, fc2], num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages, interpret=interpret)
    if residual is None:
        out = out.sum(axis=0)
        if b2 is not None:
            out = out + b2.astype(jnp.float32)
        out = out.astype(x.dtype)
    return (out, rider_outs) if riders is not None else out


@functools.partial(jax.jit, static_argnames=("activation", "impl", "config"))
def _sparse_mlp_jit(x, w1, b1, w2t, b2, idx, w_gate, residual, *, activation, impl, config):
    if impl == "reference":
        if residual is not None:
            return residual + sparse_mlp_reference(x.astype(jnp.float32), w1, b1, w2t, b2, idx,
                                                   activation=activation, w_gate=w_gate)
        return sparse_mlp_reference(x, w1, b1, w2t, b2, idx, activation=activation,
                                    w_gate=w_gate)
    return sparse_mlp_pallas(x, w1, b1, w2t, b2, idx, activation=activation, w_gate=w_gate,
                             interpret=impl == "interpret", config=config, residual=residual)


def sparse_mlp(x, w1, b1, w2t, b2, idx, *, activation: str = "relu", w_gate=None,
               impl: str | None = None, config: MLPConfig | None = None,
               residual: jax.Array | None = None, riders: Riders | None = None):
    """Sparse MLP over the neurons ``idx``: ``act(x W1[idx]ᵀ + b1[idx]) W2ᵀ[idx] + b2``.

    Args:
      x: ``[B, d]`` inputs (the batch shares ``idx``).
      w1: ``[F, d]`` fc1 / up-projection weight (HF ``fc1.weight`` layout).
      b1: ``[F]`` or None.
      w2t: ``[F, d]`` fc2 weight transposed (``fc2.weight.T``) / down-projection transposed.
      b2: ``[d]`` or None.
      idx: ``[K]`` int32, distinct neuron ids in ``[0, F)``.
      activation: "relu" (OPT), "silu" (with ``w_gate``: Llama SwiGLU), "gelu" (the exact
        form, OPT's), "gelu_tanh" (the tanh approximation; with ``w_gate``: Gemma GeGLU),
        "identity".
      w_gate: optional ``[F, d]`` gate weight; then the hidden unit is
        ``act(x w_gate[idx]ᵀ) * (x w1[idx]ᵀ + b1[idx])``, gate and up rows gathered in
        the same kernel launch.
      impl: None (auto), "pallas", "interpret" or "reference" (see ``_common``).
      config: optional :class:`MLPConfig` block sizes (Pallas paths only).
      residual: optional fp32 ``[B, d]`` rows to add the output to (a pre-norm layer's
        residual stream). On the Pallas path the split-k chunks then add into them
        atomically in the fc2 launch, with no reduction launch after it (the summation
        order, so the low bits, vary between runs); inside a jitted step whose input they
        no longer are needed as, they are updated in place.
      riders: optional :class:`Riders`, launch parts that run inside the two launches
        (Pallas paths); the call is then not jitted on its own.
    Returns:
      ``[B, d]`` in ``x.dtype``; all accumulation is fp32. With ``residual``:
      ``residual + output``, fp32. With ``riders``: ``(that, the fc2 riders' outputs)``.
    """
    _validate(x, w1, b1, w2t, b2, idx, activation, w_gate)
    if residual is not None:
        check_array("residual", residual, shape=x.shape)
        if residual.dtype != jnp.float32:
            raise TypeError(f"residual must be float32, got {residual.dtype}")
    impl = resolve_impl(impl)
    if riders is not None:
        if impl == "reference":
            raise ValueError("riders run only on the Pallas paths (impl 'pallas' or "
                             "'interpret')")
        return sparse_mlp_pallas(x, w1, b1, w2t, b2, idx, activation=activation, w_gate=w_gate,
                                 interpret=impl == "interpret", config=config,
                                 residual=residual, riders=riders)
    return _sparse_mlp_jit(x, w1, b1, w2t, b2, idx, w_gate, residual, activation=activation,
                           impl=impl, config=config)
