"""Contiguous-row GEMVs through Pallas' Mosaic GPU backend (Hopper): a measurement only.

The sparse MLP's two products read K selected rows of ``w1 [F, d]`` and ``w2ᵀ [F, d]``.
These two functions do the same products over K *contiguous* rows with the Mosaic GPU
lowering: TMA copies of weight tiles into shared memory, pipelined ``max_steps`` deep,
and a tensor-core product per tile. They answer one question for the benchmarks
(``kernels.bench --baselines mosaic``): does that backend read a few tens of megabytes
faster than the Triton lowering and XLA do? On an H100, no: over contiguous rows they moved
89–106% of the bytes per second of the Triton gather pair over random rows
(``kernels/results/h100/mlp-mosaic-gpu``). No decode path uses them.

- :func:`rows_gemv`, fc1's shape: ``w [K, d] @ x [d] -> [K]``. Programs over row tiles
  and splits of ``d``; the input sits in column 0 of a ``[d, 64]`` operand (the narrowest
  the tensor-core layout takes here), fp32 partials ``[splits, K, 64]`` per split (the
  whole accumulator: its first column alone is not a contiguous copy).
- :func:`cols_gemv`, fc2's shape: ``h [K] @ w [K, d] -> [d]``. Programs over column tiles
  and splits of ``K``; ``h`` sits in row 0 of a ``[64, K]`` operand.

Shapes must divide into the tiles (``ValueError`` otherwise).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import check_array, sm_count

PAD = 64        # the padded operand's width: the narrowest the tensor-core layout takes here
KEPT_ROWS = 8   # rows of a column tile's accumulator written out (row 0 is the result)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tile sizes and pipeline depth. ``tile_out``: rows (rows_gemv) or columns
    (cols_gemv) per program; ``tile_k``: the contracted length per pipeline step;
    ``splits``: the contracted axis split over programs (0: enough programs for every SM)."""
    tile_out: int = 128
    tile_k: int = 64
    max_steps: int = 4
    splits: int = 0


def _transforms(minor: int, dtype) -> tuple:
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _splits(steps: int, tiles: int, want: int) -> int:
    """A divisor of ``steps`` (the pipeline steps of the whole contraction): ``want`` if
    given, else the smallest that gives every SM a program."""
    if want:
        if steps % want:
            raise ValueError(f"splits={want} must divide the {steps} contraction steps")
        return want
    for s in range(1, steps + 1):
        if steps % s == 0 and tiles * s >= sm_count():
            return s
    return steps


def _check(K: int, d: int, cfg: MosaicConfig, out_axis: int, k_axis: int) -> None:
    if out_axis % cfg.tile_out or k_axis % cfg.tile_k:
        raise ValueError(f"w [{K}, {d}] does not divide into tiles of {cfg.tile_out} outputs "
                         f"by {cfg.tile_k} contracted")


def _product(a_gmem, b_gmem, o_gmem, o_smem, *, a_block, b_block, a_index, b_index, steps,
             acc_shape, max_steps, out_slice, kept):
    """One program: the pipelined tensor-core product of its tiles into an fp32
    accumulator, whose ``kept`` part goes through shared memory to its slice of the
    partials (a column of a row tile cannot be copied alone: the whole tile is)."""
    dtype = a_gmem.dtype

    def accumulate(acc):
        def body(_, a_smem, b_smem):
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(1)

        plgpu.emit_pipeline(body, grid=(steps,), max_concurrent_steps=max_steps, in_specs=[
            plgpu.BlockSpec(a_block, a_index, transforms=_transforms(a_block[1], dtype),
                            delay_release=1),
            plgpu.BlockSpec(b_block, b_index, transforms=_transforms(b_block[1], dtype),
                            delay_release=1)])(a_gmem, b_gmem)
        plgpu.wgmma_wait(0)
        o_smem[...] = acc[...]

    pl.run_scoped(accumulate, plgpu.ACC(acc_shape, jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[kept], o_gmem.at[out_slice()])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def rows_gemv(w: jax.Array, x: jax.Array, cfg: MosaicConfig = MosaicConfig(), *,
              interpret: bool = False) -> jax.Array:
    """``w [K, d] @ x [d]`` in fp32 ``[K]`` (bf16 or fp16 ``w``; ``x`` cast to its dtype)."""
    check_array("w", w, ndim=2, floating=True)
    K, d = w.shape
    check_array("x", x, shape=(d,), floating=True)
    _check(K, d, cfg, K, d)
    steps_all = d // cfg.tile_k
    splits = _splits(steps_all, K // cfg.tile_out, cfg.splits)
    steps = steps_all // splits
    xb = jnp.zeros((d, PAD), w.dtype).at[:, 0].set(x.astype(w.dtype))

    def kernel(w_gmem, x_gmem, o_gmem, o_smem):
        m, s = lax.axis_index("m"), lax.axis_index("s")
        _product(w_gmem, x_gmem, o_gmem, o_smem, a_block=(cfg.tile_out, cfg.tile_k),
                 b_block=(cfg.tile_k, PAD), a_index=lambda k: (m, s * steps + k),
                 b_index=lambda k: (s * steps + k, 0), steps=steps,
                 acc_shape=(cfg.tile_out, PAD), max_steps=cfg.max_steps,
                 out_slice=lambda: (s, pl.ds(m * cfg.tile_out, cfg.tile_out)),
                 kept=(slice(None), slice(None)))

    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, K, PAD), jnp.float32),
        grid=(K // cfg.tile_out, splits), grid_names=("m", "s"),
        scratch_types=dict(o_smem=plgpu.SMEM((cfg.tile_out, PAD), jnp.float32)),
        interpret=plgpu.InterpretGPUParams() if interpret else None)(w, xb)
    return out[:, :, 0].sum(0)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def cols_gemv(h: jax.Array, w: jax.Array, cfg: MosaicConfig = MosaicConfig(tile_out=256), *,
              interpret: bool = False) -> jax.Array:
    """``h [K] @ w [K, d]`` in fp32 ``[d]`` (bf16 or fp16 ``w``; ``h`` cast to its dtype)."""
    check_array("w", w, ndim=2, floating=True)
    K, d = w.shape
    check_array("h", h, shape=(K,), floating=True)
    _check(K, d, cfg, d, K)
    steps_all = K // cfg.tile_k
    splits = _splits(steps_all, d // cfg.tile_out, cfg.splits)
    steps = steps_all // splits
    hb = jnp.zeros((PAD, K), w.dtype).at[0].set(h.astype(w.dtype))

    def kernel(h_gmem, w_gmem, o_gmem, o_smem):
        n, s = lax.axis_index("n"), lax.axis_index("s")
        _product(h_gmem, w_gmem, o_gmem, o_smem, a_block=(PAD, cfg.tile_k),
                 b_block=(cfg.tile_k, cfg.tile_out), a_index=lambda k: (0, s * steps + k),
                 b_index=lambda k: (s * steps + k, n), steps=steps,
                 acc_shape=(PAD, cfg.tile_out), max_steps=cfg.max_steps,
                 out_slice=lambda: (s, slice(None), pl.ds(n * cfg.tile_out, cfg.tile_out)),
                 kept=(pl.ds(0, KEPT_ROWS), slice(None)))

    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, KEPT_ROWS, d), jnp.float32),
        grid=(d // cfg.tile_out, splits), grid_names=("n", "s"),
        scratch_types=dict(o_smem=plgpu.SMEM((PAD, cfg.tile_out), jnp.float32)),
        interpret=plgpu.InterpretGPUParams() if interpret else None)(hb, w)
    return out[:, 0, :].sum(0)
