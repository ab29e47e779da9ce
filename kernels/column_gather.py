"""Column-gather GEMV: the out-projection of selected heads from a ``[d_out, H * hd]`` weight.

``out[b, r] = sum_j a[b, j] * W[r, col(j)]`` over the selected logical columns ``j``,
``col(j) = ids[j // m] * m + j % m`` (m = the columns of one head group). A head's columns
are m contiguous elements of every weight row, so the loads stay coalesced, and every
program owns whole output rows: it reads all selected columns of its rows and finishes
them (residual and bias added, no split-k partials, no atomics, a deterministic sum).
Stacked layers ``[L * d_out, n]`` (a free reshape of ``[L, d_out, n]``) take global ids
``layer * (n / m) + local``: a call's ids all lie in one layer, whose rows it reads.
The activations ``a`` come from a caller-supplied loader, as in
:func:`~.gather_matvec.gather_matvec_t`.

With a power-of-two group width the weight can be loaded as a 3-D view ``[rows, groups,
m]`` (``group_view``): the innermost index is then a plain range, which Triton can prove
contiguous and read with vector loads, where the flat gathered column index of the 2-D
load hides that contiguity. A batch flattens the loaded tile for the tensor cores.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import cdiv, is_pow2
from .gather_matvec import accumulate_blocks, batch_pad, evict_hint, logical_rows, mma


def _split_refs(refs, n_act: int, has_res: bool, has_bias: bool, has_mask: bool):
    """(activation refs, ids, id mask or None, w, residual or None, bias or None, out) of
    a kernel's refs."""
    act_refs = refs[:n_act]
    ids_ref, w_ref = refs[n_act:n_act + 2]
    rest = list(refs[n_act + 2:])
    mask_ref = rest.pop(0) if has_mask else None
    res_ref = rest.pop(0) if has_res else None
    b_ref = rest.pop(0) if has_bias else None
    return act_refs, ids_ref, mask_ref, w_ref, res_ref, b_ref, rest[-1]


def _kept(mask_ref, j, valid):
    """``valid`` narrowed to the ids ``j`` whose mask entry is nonzero (no mask: valid)."""
    if mask_ref is None:
        return valid
    return valid & (plgpu.load(mask_ref.at[j], mask=valid, other=0) != 0)


def _program_rows(ids_ref, bk: int, d_out: int, groups_per_layer: int, layers: int):
    """This program's output rows, their mask, the ids' layer and its weight rows."""
    rows = pl.program_id(0) * bk + jnp.arange(bk, dtype=jnp.int32)
    layer = ids_ref[0] // groups_per_layer if layers > 1 else 0
    return rows, rows < d_out, layer, layer * d_out + rows


def _kernel(*refs, n_act, load_act, B, Bp, m, n_cols, d_out, n_local, layers, bk, bc,
            chunks, has_res, has_bias, has_mask, evict_first):
    act_refs, ids_ref, mask_ref, w_ref, res_ref, b_ref, o_ref = _split_refs(
        refs, n_act, has_res, has_bias, has_mask)
    rows, rm, layer, w_rows = _program_rows(ids_ref, bk, d_out, n_local // m, layers)
    brow = jnp.arange(Bp, dtype=jnp.int32)
    bmask = brow < B

    def chunk(c, acc):
        lc = c * bc + jnp.arange(bc, dtype=jnp.int32)
        valid = lc < n_cols
        valid = _kept(mask_ref, lc // m, valid)
        cols = logical_rows(ids_ref, lc, valid, m)
        a = load_act(act_refs, lc, valid, cols)       # fp32 [bc] or [Bp, bc]
        if layers > 1:
            cols = jnp.where(valid, cols - layer * n_local, 0)
        w = plgpu.load(w_ref.at[w_rows[:, None], cols[None, :]],
                       mask=rm[:, None] & valid[None, :], other=0,
                       eviction_policy=evict_hint(evict_first))
        if Bp == 1:
            prod = w.astype(jnp.float32) * a[None, :]
            return acc + jnp.sum(prod, axis=1)
        return acc + mma(a, w, trans_b=True)

    acc = accumulate_blocks(chunk, chunks, (bk,) if Bp == 1 else (Bp, bk))
    _store_rows(acc, rows, rm, brow, bmask, Bp, res_ref, b_ref, o_ref)


def _group_kernel(*refs, n_act, load_act, B, Bp, m, n_groups, d_out, n_local, layers, bk, gc,
                  chunks, has_res, has_bias, has_mask, evict_first):
    """Over the ``[rows, n_local / m, m]`` view, ``gc`` selected groups per load: batch 1
    multiplies the 3-D tile elementwise; a batch flattens it for the tensor cores."""
    act_refs, ids_ref, mask_ref, w_ref, res_ref, b_ref, o_ref = _split_refs(
        refs, n_act, has_res, has_bias, has_mask)
    rows, rm, layer, w_rows = _program_rows(ids_ref, bk, d_out, n_local // m, layers)
    lane = jnp.arange(m, dtype=jnp.int32)
    brow = jnp.arange(Bp, dtype=jnp.int32)

    def chunk(c, acc):
        g = c * gc + jnp.arange(gc, dtype=jnp.int32)
        vg = _kept(mask_ref, g, g < n_groups)
        gid = plgpu.load(ids_ref.at[g], mask=vg, other=0)
        valid = jnp.broadcast_to(vg[:, None], (gc, m))
        if Bp == 1:
            a = load_act(act_refs, g[:, None] * m + lane[None, :], valid,
                         gid[:, None] * m + lane[None, :])        # fp32 [gc, m]
        else:
            lc = c * gc * m + jnp.arange(gc * m, dtype=jnp.int32)
            lv = _kept(mask_ref, lc // m, lc < n_groups * m)
            a = load_act(act_refs, lc, lv, logical_rows(ids_ref, lc, lv, m))  # [Bp, gc*m]
        if layers > 1:
            gid = jnp.where(vg, gid - layer * (n_local // m), 0)
        w = plgpu.load(w_ref.at[w_rows[:, None, None], gid[None, :, None], lane[None, None, :]],
                       mask=rm[:, None, None] & valid[None], other=0,
                       eviction_policy=evict_hint(evict_first))
        if Bp > 1:
            return acc + mma(a, w.reshape(bk, gc * m), trans_b=True)
        prod = w.astype(jnp.float32) * a[None]
        return acc + jnp.sum(jnp.sum(prod, axis=2), axis=1)

    acc = accumulate_blocks(chunk, chunks, (bk,) if Bp == 1 else (Bp, bk))
    _store_rows(acc, rows, rm, brow, brow < B, Bp, res_ref, b_ref, o_ref)


def _store_rows(acc, rows, rm, brow, bmask, Bp, res_ref, b_ref, o_ref):
    """Add bias and residual to the fp32 rows ``acc`` and store them."""
    if b_ref is not None:
        bias = plgpu.load(b_ref.at[rows], mask=rm, other=0).astype(jnp.float32)
        acc = acc + (bias if Bp == 1 else bias[None, :])
    if Bp == 1:
        if res_ref is not None:
            acc = acc + plgpu.load(res_ref.at[0, rows], mask=rm, other=0.0)
        plgpu.store(o_ref.at[0, rows], acc, mask=rm)
    else:
        msk = bmask[:, None] & rm[None, :]
        if res_ref is not None:
            acc = acc + plgpu.load(res_ref.at[brow[:, None], rows[None, :]], mask=msk,
                                   other=0.0)
        plgpu.store(o_ref.at[brow[:, None], rows[None, :]], acc, mask=msk)


def gather_cols_matvec(act_args: Sequence[jax.Array], load_act: Callable, w: jax.Array,
                       ids: jax.Array, *, B: int, cols_per_id: int, block_rows: int = 8,
                       block_cols: int = 512, num_warps: int = 4, num_stages: int = 2,
                       residual: jax.Array | None = None,
                       bias: jax.Array | None = None, layers: int = 1,
                       group_view: bool = False, id_mask: jax.Array | None = None,
                       interpret: bool = False, evict_first: bool = False) -> jax.Array:
    """``residual + a @ W[:, cols].T + bias`` as fp32 ``[B, d_out]`` for ``w [d_out, n]``.

    Args:
      act_args, load_act: the activations' arrays and the in-kernel loader
        ``load_act(act_args, j, valid, cols)`` returning fp32 ``[block_cols]`` (B == 1) or
        ``[Bp, block_cols]`` for logical columns ``j`` (zeros where not ``valid``; an
        ``id_mask`` narrows ``valid``).
      ids: ``[K]`` selected column groups; logical column j is physical column
        ``ids[j // cols_per_id] * cols_per_id + j % cols_per_id``.
      block_rows: output rows per program (>= 16 when B > 1, for the tensor cores).
      block_cols: logical columns per load (a power of two).
      residual: optional fp32 ``[B, d_out]`` added (and updated in place when donated);
        bias: optional ``[d_out]``.
      layers: ``w`` stacks this many layers' ``[d_out, n]`` matrices by rows; the ids are
        then global (``layer * n // cols_per_id + local``), all from one layer.
      group_view: load ``[block_rows, groups, cols_per_id]`` tiles of the 3-D view (vector
        loads); needs a power-of-two ``cols_per_id <= block_cols``. At batch 1
        ``load_act`` then gets ``[groups, cols_per_id]`` columns.
      id_mask: optional ``[K]`` int32 or bool: the ids whose entry is 0 are skipped, their
        columns not read (a GQA group's unselected query heads).
      evict_first: load the weight with L2's evict-first hint (read once a token).
    """
    if w.shape[0] % layers:
        raise ValueError(f"{layers} layers must divide the weight's {w.shape[0]} rows")
    d_out = w.shape[0] // layers
    m = cols_per_id
    n_cols = int(ids.shape[0]) * m
    Bp = batch_pad(B)
    bk = block_rows if Bp == 1 else max(16, block_rows)
    for name, v in (("block_rows", bk), ("block_cols", block_cols)):
        if not is_pow2(v):
            raise ValueError(f"{name}={v} must be a power of two")
    if residual is not None and (residual.shape != (B, d_out)
                                 or residual.dtype != jnp.float32):
        raise ValueError(f"residual must be fp32 [{B}, {d_out}], got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    common = dict(n_act=len(act_args), load_act=load_act, m=m, d_out=d_out,
                  n_local=w.shape[1], layers=layers, bk=bk, has_res=residual is not None,
                  has_bias=bias is not None, has_mask=id_mask is not None,
                  evict_first=bool(evict_first))
    if group_view:
        if not is_pow2(m) or m > block_cols:
            raise ValueError(f"group_view needs a power-of-two cols_per_id <= block_cols, "
                             f"got {m} and {block_cols}")
        gc = block_cols // m
        kernel = functools.partial(_group_kernel, B=B, Bp=Bp, n_groups=int(ids.shape[0]),
                                   gc=gc, chunks=cdiv(int(ids.shape[0]), gc), **common)
        w = w.reshape(w.shape[0], w.shape[1] // m, m)
    else:
        kernel = functools.partial(_kernel, B=B, Bp=Bp, n_cols=n_cols, bc=block_cols,
                                   chunks=cdiv(n_cols, block_cols), **common)
    args = [*act_args, ids.astype(jnp.int32), w]
    if id_mask is not None:
        if id_mask.shape != ids.shape:
            raise ValueError(f"id_mask has shape {id_mask.shape}, the ids {ids.shape}")
        args.append(id_mask.astype(jnp.int32))
    aliases = {}
    if residual is not None:
        aliases = {len(args): 0}
        args.append(residual)
    if bias is not None:
        args.append(bias)
    return pl.pallas_call(
        kernel,
        grid=(cdiv(d_out, bk),),
        out_shape=jax.ShapeDtypeStruct((B, d_out), jnp.float32),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gather_cols_matvec",
    )(*args)
