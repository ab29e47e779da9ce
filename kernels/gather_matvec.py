"""Row-gather matrix-vector Pallas kernels (the engine of every sparse layer).

Two kernels, both reading each selected weight row exactly once, straight from
HBM into registers (no gathered copy is ever materialised):

* :func:`gather_matvec` (the "fc1" shape): ``h[b, r] = sum_c x[b, c] * W[row(r), c]``
  for the selected logical rows ``r``.  The grid is (row blocks, d splits), so
  even a handful of selected rows spreads over many programs; the result is
  left as fp32 partial sums ``[n_dsplit, B, R_pad]`` and the consumer (the next
  kernel) finishes the reduction, adding bias and activation for free.
* :func:`gather_matvec_t` (the "fc2" shape): ``out[b, c] = sum_r a[b, r] * W[row(r), c]``.
  The grid is (row chunks, column blocks): split-k over the selected rows, so
  the grid fills the GPU even at small K.  The activations ``a`` come from a
  caller-supplied loader run inside the kernel (e.g. "sum fc1's partials, add
  bias, apply ReLU").  The result is fp32 partials ``[n_kchunks, B, d]`` that
  the caller sums (one tiny XLA reduction, fused with the output bias and cast).

Selected rows are described by an id vector ``ids [K]`` and a static
``rows_per_id`` m: logical row r maps to physical row ``ids[r // m] * m + r % m``.
m = 1 is a neuron gather (MLP); m = head_dim (or group * head_dim) gathers whole
attention heads from a ``[H * hd, d]`` view of per-head weights.

Triton needs power-of-two block shapes, so every load and store is masked at the
ragged edges (rows past K, columns past d, batch rows past B).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import activation_fn, cdiv, check_array, is_pow2, next_pow2
from .launch import LaunchPart, interpreting, launch


def batch_pad(B: int) -> int:
    """Padded batch rows inside the kernels: 1 (vector path) or >= 16 (tensor-core dot)."""
    return 1 if B == 1 else max(16, next_pow2(B))


def mma(a, b, trans_b: bool = False):
    """``a @ b`` (or ``a @ b.T``) with fp32 accumulation.

    bf16/fp16 operands use the tensor cores; fp32 operands are multiplied in full fp32
    (no tf32 rounding).
    """
    prec = lax.Precision.HIGHEST if b.dtype == jnp.float32 else None
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a.astype(b.dtype), b, dims, precision=prec,
                           preferred_element_type=jnp.float32)


def evict_hint(evict_first: bool) -> str | None:
    """A weight load's eviction policy: "evict_first" (weights stream through L2 once a
    token, so the small arrays that are read again stay), or None (the default)."""
    return "evict_first" if evict_first else None


def accumulate_blocks(step: Callable, n: int, shape) -> jax.Array:
    """fp32 zeros of ``shape`` folded through ``acc = step(i, acc)`` for ``i < n`` (a
    kernel's loop over its blocks: unrolled up to 4 blocks, a ``fori_loop`` beyond)."""
    acc = jnp.zeros(shape, jnp.float32)
    if n <= 4:
        for i in range(n):
            acc = step(i, acc)
        return acc
    return lax.fori_loop(0, n, step, acc)


def logical_rows(ids_ref, r, valid, m: int):
    """Physical weight rows for logical rows ``r`` (masked entries map to row 0)."""
    if m == 1:
        return plgpu.load(ids_ref.at[r], mask=valid, other=0)
    ids = plgpu.load(ids_ref.at[r // m], mask=valid, other=0)
    return ids * m + r % m


@dataclasses.dataclass(frozen=True)
class Segment:
    """One gathered matrix of :func:`gather_matvec`: weight [R, d], ids [K], rows_per_id.

    x: this segment's own input ``[B_s, d]`` (None: the call's shared x); block_rows: its
    own rows per program (None: the call's). A segment with more input rows (the missing-KV
    window) takes the tensor-core path while a one-row segment keeps the vector path.
    block_d: its own columns per load, a power of two dividing the call's (None: the
    call's); a many-row input takes narrower loads so its tile fits, while the other
    segments keep their wide ones.
    window, current, past_flags: ``x`` holds ``x.shape[0] // window`` windows of
    ``window`` rows each, row ``current`` ([1] int32) of every window always needed; the
    other rows of an id's outputs only where ``past_flags[id_slot]`` ([K] int32) is
    nonzero: a program whose ids are all unflagged multiplies the current rows alone
    and leaves the others unwritten (the missing-KV window once nothing is missing).
    mask: optional ``[K]`` int32 or bool: an id whose entry is 0 is skipped, its rows are
    not read and its outputs are 0 (a GQA group's unselected query heads).
    x_row0, x_span = (n, stride): ``x`` holds ``stride`` rows per batch row, of which the
    segment's input is the ``n`` starting at row ``x_row0`` ([1] int32, may be traced),
    read in place: the segment has ``(x.shape[0] // stride) * n`` input rows, row ``r``
    being ``x``'s row ``(r // n) * stride + x_row0 + r % n`` (one layer's window rows in
    every layer's rings).
    """
    w: jax.Array
    ids: jax.Array
    rows_per_id: int = 1
    x: jax.Array | None = None
    block_rows: int | None = None
    block_d: int | None = None
    past_flags: jax.Array | None = None
    current: jax.Array | None = None
    window: int = 0
    mask: jax.Array | None = None
    x_row0: jax.Array | None = None
    x_span: tuple[int, int] = (0, 0)

    @property
    def n_rows(self) -> int:
        return int(self.ids.shape[0]) * self.rows_per_id


jax.tree_util.register_dataclass(Segment, data_fields=["w", "ids", "x", "past_flags", "current",
                                                       "mask", "x_row0"],
                                 meta_fields=["rows_per_id", "block_rows", "block_d", "window",
                                              "x_span"])


def segment_input(seg: Segment, x: jax.Array) -> jax.Array:
    """A segment's input rows ``[B_s, d]`` as the kernel reads them (``x``: the call's
    shared input, used when the segment brings none); copies where ``x_row0`` maps them."""
    xs = x if seg.x is None else seg.x
    if seg.x_row0 is None:
        return xs
    n, stride = seg.x_span
    d = xs.shape[-1]
    rows = xs.reshape(-1, stride, d)
    row0 = jnp.asarray(seg.x_row0, jnp.int32).reshape(())
    return lax.dynamic_slice_in_dim(rows, row0, n, axis=1).reshape(-1, d)


def _check_window(seg: Segment, rows: int) -> None:
    """Raise on a windowed segment's malformed window, current row or flags."""
    W = seg.window
    if W < 1 or rows % W or batch_pad(rows // W) == 1:
        raise ValueError(f"a windowed segment needs two or more {W}-row windows, got "
                         f"{rows} rows")
    if seg.past_flags is None or seg.current is None:
        raise ValueError("a windowed segment needs past_flags and current")
    if seg.past_flags.shape != seg.ids.shape:
        raise ValueError(f"past_flags has shape {seg.past_flags.shape}, the ids "
                         f"{seg.ids.shape}")
    if jnp.size(seg.current) != 1:
        raise ValueError(f"current must be one row index, got shape "
                         f"{jnp.shape(seg.current)}")
    try:
        current = int(jnp.asarray(seg.current).reshape(()))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return                                  # traced: checked by its producer
    if not 0 <= current < W:
        raise ValueError(f"current={current} is not a row of a {W}-row window")


def segment_rows(seg: Segment) -> jax.Array:
    """The physical weight rows ``[n_rows]`` of a segment's logical rows."""
    m = seg.rows_per_id
    return (seg.ids.astype(jnp.int32)[:, None] * m + jnp.arange(m, dtype=jnp.int32)).reshape(-1)


def segment_reference(seg: Segment, x: jax.Array) -> jax.Array:
    """jnp reference of one segment's :func:`gather_matvec` result, as one partial
    ``[1, B_s, n_rows]`` fp32 (``x`` is used when the segment brings no input). It
    computes every row, also those a windowed segment's kernel may leave unwritten."""
    xs = segment_input(seg, x).astype(jnp.float32)
    w = seg.w[segment_rows(seg)].astype(jnp.float32)
    if seg.mask is not None:
        keep = jnp.repeat(seg.mask.astype(bool), seg.rows_per_id)
        w = jnp.where(keep[:, None], w, 0.0)
    return jnp.dot(xs, w.T, precision=lax.Precision.HIGHEST)[None]


def check_segment(seg: Segment, x: jax.Array) -> None:
    """Raise on a malformed :class:`Segment` for the call input ``x [B, d]``."""
    if not isinstance(seg, Segment):
        raise TypeError(f"expected a Segment, got {type(seg).__name__}")
    check_array("segment w", seg.w, ndim=2, floating=True)
    check_array("segment ids", seg.ids, ndim=1)
    if not jnp.issubdtype(seg.ids.dtype, jnp.integer):
        raise TypeError(f"segment ids must be integers, got {seg.ids.dtype}")
    if seg.w.shape[1] != x.shape[1]:
        raise ValueError(f"segment w has width {seg.w.shape[1]}, the input {x.shape[1]}")
    if seg.rows_per_id < 1 or seg.w.shape[0] % seg.rows_per_id:
        raise ValueError(f"rows_per_id={seg.rows_per_id} must divide the weight's "
                         f"{seg.w.shape[0]} rows")
    if seg.mask is not None:
        check_array("segment mask", seg.mask, shape=seg.ids.shape)
    if seg.x is not None:
        check_array("segment x", seg.x, ndim=2, floating=True)
        if seg.x.shape[1] != x.shape[1]:
            raise ValueError(f"segment x has width {seg.x.shape[1]}, expected {x.shape[1]}")
    if seg.x_row0 is not None:
        n, stride = seg.x_span
        rows = (x if seg.x is None else seg.x).shape[0]
        if not 1 <= n <= stride or rows % stride:
            raise ValueError(f"x_span={seg.x_span} must be (n, stride) with 1 <= n <= stride "
                             f"and stride dividing the input's {rows} rows")
        if jnp.size(seg.x_row0) != 1:
            raise ValueError(f"x_row0 must be one row index, got shape "
                             f"{jnp.shape(seg.x_row0)}")


def _gather_matvec_body(pids, *refs, seg_meta, d, bd, chunks, evict_first):
    n_in = sum(meta[-1] for meta in seg_meta)
    in_refs, out_refs = refs[:n_in], refs[n_in:]
    i, j = pids

    first = 0
    for s, (start, nb, m, n_rows, B, Bp, bk, bd_s, W, masked, x_map, n_refs) in enumerate(
            seg_meta):
        x_ref, ids_ref, w_ref, *skip_refs = in_refs[first:first + n_refs]
        first += n_refs
        o_ref = out_refs[s]

        @pl.when((i >= start) & (i < start + nb))
        def _(x_ref=x_ref, ids_ref=ids_ref, w_ref=w_ref, o_ref=o_ref, skip_refs=skip_refs,
              start=start, m=m, n_rows=n_rows, B=B, Bp=Bp, bk=bk, bd_s=bd_s, W=W,
              masked=masked, x_map=x_map):
            if x_map is not None:
                *skip_refs, row0_ref = skip_refs
                n_x, stride, x_rows = x_map
                row0 = row0_ref[0]

                def x_row(r):   # the input's row r in x (clamped: masked rows read nothing)
                    return jnp.minimum((r // n_x) * stride + row0 + r % n_x, x_rows - 1)
            else:
                def x_row(r):
                    return r
            kk = jnp.arange(bk, dtype=jnp.int32)
            local = (i - start) * bk + kk
            valid = local < n_rows
            if masked:   # skipped ids: masked loads, no bytes read
                mask_ref, *skip_refs = skip_refs
                valid = valid & (plgpu.load(mask_ref.at[local // m], mask=valid, other=0) != 0)
            rows = logical_rows(ids_ref, local, valid, m)

            def product(brow, nrows, out_rows, bd=bd_s, chunks=chunks * (bd // bd_s)):
                """Partials of x rows ``brow`` (valid below ``nrows``) into ``out_rows``,
                ``bd`` columns per load over this d-split's ``chunks * bd`` columns."""
                Bq = brow.shape[0]
                bmask = jnp.arange(Bq, dtype=jnp.int32) < nrows

                def chunk(c, acc):
                    cols = (j * chunks + c) * bd + jnp.arange(bd, dtype=jnp.int32)
                    cm = cols < d
                    w = plgpu.load(w_ref.at[rows[:, None], cols[None, :]],
                                   mask=valid[:, None] & cm[None, :], other=0,
                                   eviction_policy=evict_hint(evict_first))
                    if Bq == 1:
                        xv = plgpu.load(x_ref.at[x_row(0), cols], mask=cm, other=0)
                        prod = w.astype(jnp.float32) * xv.astype(jnp.float32)[None, :]
                        return acc + jnp.sum(prod, axis=1)
                    xb = plgpu.load(x_ref.at[x_row(brow)[:, None], cols[None, :]],
                                    mask=bmask[:, None] & cm[None, :], other=0)
                    return acc + mma(xb, w, trans_b=True)

                acc = accumulate_blocks(chunk, chunks, (bk,) if Bq == 1 else (Bq, bk))
                if Bq == 1:
                    plgpu.store(o_ref.at[j, 0, local], acc)
                else:
                    plgpu.store(o_ref.at[j, out_rows[:, None], local[None, :]], acc,
                                mask=bmask[:, None])

            every = jnp.arange(Bp, dtype=jnp.int32)
            if not W:
                product(every, B, every)
                return
            flags_ref, cur_ref = skip_refs
            past = jnp.max(plgpu.load(flags_ref.at[local // m], mask=valid, other=0)) != 0

            @pl.when(past)
            def _():
                product(every, B, every)

            @pl.when(jnp.logical_not(past))
            def _():   # a window's worth fewer rows: the call's full-width loads
                current = jnp.arange(batch_pad(B // W), dtype=jnp.int32) * W + cur_ref[0]
                product(current, B // W, current, bd, chunks)


def gather_matvec(x: jax.Array, segments: Sequence[Segment], *, block_rows: int = 16,
                  block_d: int = 512, d_chunks: int = 1, num_warps: int = 4,
                  num_stages: int = 2, interpret: bool = False, evict_first: bool = False):
    """Gathered GEMV partials for one or more matrices sharing the input ``x [B, d]``.

    One launch of :func:`gather_matvec_part` (which other kernels may join, see
    :mod:`.launch`).

    Args:
      x: ``[B, d]`` input, shared by the segments that bring none of their own.
      segments: :class:`Segment` s; all weights are ``[R_s, d]``.
      block_rows: selected rows per program (power of two; >= 16 when B > 1), unless a
        segment sets its own.
      block_d: columns per load (power of two).
      d_chunks: column chunks per program; the grid has ``cdiv(d, block_d * d_chunks)``
        d-splits.
      evict_first: load the weight rows with L2's evict-first hint (read once a token).
    Returns:
      One fp32 array per segment, ``[n_dsplit, B_s, n_blocks * block_rows]``; summing over
      axis 0 gives ``x @ W[rows].T`` in the first ``n_rows`` columns (the padding columns
      past them hold zeros). A windowed segment leaves the earlier window rows of
      unflagged ids unwritten (undefined values; NaN in the interpreter).
    """
    part = gather_matvec_part(x, segments, block_rows=block_rows, block_d=block_d,
                              d_chunks=d_chunks, evict_first=evict_first)
    return launch([part], num_warps=num_warps, num_stages=num_stages, interpret=interpret)[0]


def gather_matvec_part(x: jax.Array, segments: Sequence[Segment], *, block_rows: int = 16,
                       block_d: int = 512, d_chunks: int = 1,
                       evict_first: bool = False) -> LaunchPart:
    """:func:`gather_matvec` as a :class:`~.launch.LaunchPart` (same arguments)."""
    d = x.shape[1]
    bd = block_d
    if not is_pow2(bd):
        raise ValueError(f"block_d={bd} must be a power of two")
    nds = cdiv(d, bd * d_chunks)
    seg_meta, outs, args = [], [], []
    start = 0
    for seg in segments:
        xs = x if seg.x is None else seg.x
        if xs.ndim != 2 or xs.shape[1] != d:
            raise ValueError(f"segment input has shape {xs.shape}; expected [B, {d}]")
        x_map = None
        B = xs.shape[0]
        if seg.x_row0 is not None:
            n_x, stride = seg.x_span
            x_map = (n_x, stride, xs.shape[0])
            B = (xs.shape[0] // stride) * n_x
        Bp = batch_pad(B)
        bk = seg.block_rows or block_rows
        bk = bk if Bp == 1 else max(16, bk)
        bd_s = seg.block_d or bd
        if not is_pow2(bd_s) or bd_s > bd:
            raise ValueError(f"a segment's block_d={bd_s} must be a power of two <= the "
                             f"call's block_d={bd}")
        nb = cdiv(seg.n_rows, bk)
        W = seg.window
        refs = [xs, seg.ids.astype(jnp.int32), seg.w]
        if seg.mask is not None:
            refs.append(seg.mask.astype(jnp.int32))
        if W:
            _check_window(seg, B)
            refs += [seg.past_flags.astype(jnp.int32),
                     jnp.asarray(seg.current, jnp.int32).reshape(1)]
        if x_map is not None:
            refs.append(jnp.asarray(seg.x_row0, jnp.int32).reshape(1))
        seg_meta.append((start, nb, seg.rows_per_id, seg.n_rows, B, Bp, bk, bd_s, W,
                         seg.mask is not None, x_map, len(refs)))
        outs.append(jax.ShapeDtypeStruct((nds, B, nb * bk), jnp.float32))
        args += refs
        start += nb
    body = functools.partial(_gather_matvec_body, seg_meta=tuple(seg_meta), d=d, bd=bd,
                             chunks=d_chunks, evict_first=bool(evict_first))
    return LaunchPart(body, (start, nds), tuple(args), tuple(outs), name="gather_matvec")


def _gather_matvec_t_body(pids, *refs, n_act, load_act, B, Bp, d, m, n_rows, bk, bd, kblocks,
                          accumulate, has_bias, deferred, masked_atomics, evict_first):
    act_refs = refs[:n_act]
    ids_ref, w_ref = refs[n_act:n_act + 2]
    rest = refs[n_act + 2:]
    if accumulate:  # (residual, [bias], out aliased to residual)
        b_ref = rest[1] if has_bias else None
        o_ref = rest[-1]
    else:
        o_ref = rest[0]
    i, j = pids
    kk = jnp.arange(bk, dtype=jnp.int32)
    cols = j * bd + jnp.arange(bd, dtype=jnp.int32)
    cm = cols < d

    def body(t, acc):
        r = (i * kblocks + t) * bk + kk
        valid = r < n_rows
        rows = logical_rows(ids_ref, r, valid, m)
        a = load_act(act_refs, r, valid, rows)       # fp32 [bk] or [Bp, bk], 0 where invalid
        w = plgpu.load(w_ref.at[rows[:, None], cols[None, :]],
                       mask=valid[:, None] & cm[None, :], other=0,
                       eviction_policy=evict_hint(evict_first))
        if Bp == 1:
            prod = a[:, None] * w.astype(jnp.float32)
            return acc + (prod if deferred else jnp.sum(prod, axis=0))
        return acc + mma(a, w)

    acc_shape = ((bk, bd) if deferred else (bd,)) if Bp == 1 else (Bp, bd)
    acc = accumulate_blocks(body, kblocks, acc_shape)
    if Bp == 1 and deferred:
        acc = jnp.sum(acc, axis=0)
    write_split_k(acc, o_ref, b_ref if accumulate else None, i, cols, d, B=B, Bp=Bp,
                  accumulate=accumulate, has_bias=has_bias, masked_atomics=masked_atomics)


def write_split_k(acc, o_ref, b_ref, i, cols, d: int, *, B: int, Bp: int, accumulate: bool,
                  has_bias: bool, masked_atomics: bool = True) -> None:
    """A split-k program's result ``acc`` (fp32 ``[bd]``, or ``[Bp, bd]``) for columns
    ``cols`` of ``d``: stored as chunk ``i``'s partial, or with ``accumulate`` added into
    the residual rows in place (and the bias once, by chunk 0). Batch rows are added by
    one masked atomic over ``[Bp, bd]`` (``masked_atomics``, compiled kernels only), or
    else one row at a time, each picked out of ``acc`` by a reduction."""
    cm = cols < d
    if accumulate:
        # Lanes past d add 0 at distinct wrapped columns (block_d <= d): the interpreter
        # has neither masked atomics nor sums over repeated addresses.
        if has_bias:
            bias = plgpu.load(b_ref.at[cols], mask=cm & (i == 0), other=0).astype(jnp.float32)
            acc = acc + (bias if Bp == 1 else bias[None, :])
        cols_w = cols % d
        if Bp == 1:
            plgpu.atomic_add(o_ref, (0, cols_w), jnp.where(cm, acc, 0.0))
        elif masked_atomics and not interpreting():
            brow = jnp.arange(Bp, dtype=jnp.int32)
            plgpu.atomic_add(o_ref, (brow[:, None], cols[None, :]), acc,
                             mask=(brow < B)[:, None] & cm[None, :])
        else:
            brow = jnp.arange(Bp, dtype=jnp.int32)
            for b in range(B):
                row = jnp.sum(jnp.where((brow == b)[:, None], acc, 0.0), axis=0)
                plgpu.atomic_add(o_ref, (b, cols_w), jnp.where(cm, row, 0.0))
    elif Bp == 1:
        plgpu.store(o_ref.at[i, 0, cols], acc, mask=cm)
    else:
        brow = jnp.arange(Bp, dtype=jnp.int32)
        plgpu.store(o_ref.at[i, brow[:, None], cols[None, :]], acc,
                    mask=(brow < B)[:, None] & cm[None, :])


def gather_matvec_t(act_args: Sequence[jax.Array], load_act: Callable, w: jax.Array,
                    ids: jax.Array, *, B: int, rows_per_id: int = 1, block_rows: int = 16,
                    block_d: int = 512, row_blocks_per_program: int = 4,
                    num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                    residual: jax.Array | None = None, bias: jax.Array | None = None,
                    deferred_sum: bool = False, masked_atomics: bool = True,
                    evict_first: bool = False):
    """Split-k transposed gathered GEMV: fp32 partials ``[n_kchunks, B, d]``.

    ``out = sum over chunks`` equals ``a @ W[rows]`` where ``a [B, K*m]`` is produced
    inside the kernel by ``load_act(act_refs, r, valid, rows)`` for each block of
    logical rows ``r`` (it must return fp32 ``[bk]`` when B == 1 else ``[Bp, bk]``,
    with zeros where ``valid`` is False or for padded batch rows).

    With ``residual`` (fp32 ``[B, d]``) the chunks are summed in the launch instead:
    each adds its partial atomically into the residual rows (updated in place when the
    caller donates them), and ``bias [d]`` (optional) is added once, so the result is
    ``residual + a @ W[rows] + bias`` as ``[B, d]`` fp32. The order of the fp32 additions
    varies from run to run, so the low bits may too.

    ``deferred_sum`` (batch 1): accumulate the products elementwise over a program's row
    blocks and sum across rows once at the end (not once per block). ``masked_atomics``:
    see :func:`write_split_k`. ``evict_first``: load the weight rows with L2's evict-first
    hint.
    """
    part = gather_matvec_t_part(act_args, load_act, w, ids, B=B, rows_per_id=rows_per_id,
                                block_rows=block_rows, block_d=block_d,
                                row_blocks_per_program=row_blocks_per_program,
                                residual=residual, bias=bias, deferred_sum=deferred_sum,
                                masked_atomics=masked_atomics, evict_first=evict_first)
    return launch([part], num_warps=num_warps, num_stages=num_stages,
                  interpret=interpret)[0][0]


def gather_matvec_t_part(act_args: Sequence[jax.Array], load_act: Callable, w: jax.Array,
                         ids: jax.Array, *, B: int, rows_per_id: int = 1,
                         block_rows: int = 16, block_d: int = 512,
                         row_blocks_per_program: int = 4,
                         residual: jax.Array | None = None, bias: jax.Array | None = None,
                         deferred_sum: bool = False, masked_atomics: bool = True,
                         evict_first: bool = False) -> LaunchPart:
    """:func:`gather_matvec_t` as a :class:`~.launch.LaunchPart` (same arguments)."""
    d = w.shape[1]
    m = rows_per_id
    n_rows = int(ids.shape[0]) * m
    Bp = batch_pad(B)
    bk = block_rows if Bp == 1 else max(16, block_rows)
    kblocks = max(1, min(row_blocks_per_program, cdiv(n_rows, bk)))
    nkc = cdiv(n_rows, bk * kblocks)
    ndb = cdiv(d, block_d)
    accumulate = residual is not None
    if bias is not None and not accumulate:
        raise ValueError("bias is added only with residual (partials come without it)")
    body = functools.partial(
        _gather_matvec_t_body, n_act=len(act_args), load_act=load_act, B=B, Bp=Bp, d=d,
        m=m, n_rows=n_rows, bk=bk, bd=block_d, kblocks=kblocks, accumulate=accumulate,
        has_bias=bias is not None, deferred=bool(deferred_sum),
        masked_atomics=masked_atomics, evict_first=bool(evict_first))
    args = [*act_args, ids.astype(jnp.int32), w]
    if accumulate:
        if residual.shape != (B, d) or residual.dtype != jnp.float32:
            raise ValueError(f"residual must be fp32 [{B}, {d}], got {residual.dtype} "
                             f"{tuple(residual.shape)}")
        if block_d > d:
            raise ValueError(f"block_d={block_d} must not exceed d={d} with a residual")
        aliases = {len(args): 0}
        args += [residual] + ([bias] if bias is not None else [])
        out_shape = jax.ShapeDtypeStruct((B, d), jnp.float32)
    else:
        aliases = {}
        out_shape = jax.ShapeDtypeStruct((nkc, B, d), jnp.float32)
    return LaunchPart(body, (nkc, ndb), tuple(args), (out_shape,), aliases,
                      name="gather_matvec_t")


def partials_loader(act_refs, r, valid, rows, *, nds, B, Bp, has_b1=False, gated=False,
                    activation="identity"):
    """Activation loader for :func:`gather_matvec_t` that finishes a :func:`gather_matvec`.

    ``act_refs`` = (h partials ``[nds, B, R]``, [gate partials], [bias ``[F]``]).  Sums the
    d-split partials, adds the gathered bias, applies the activation (times the summed
    gate's activation when ``gated``: SwiGLU), and zeroes invalid rows.
    """
    act = activation_fn(activation)
    it = iter(act_refs)
    h_ref = next(it)
    g_ref = next(it) if gated else None
    b1_ref = next(it) if has_b1 else None
    brow = jnp.arange(Bp, dtype=jnp.int32)

    def summed(ref):
        tot = None
        for s in range(nds):
            if Bp == 1:
                part = plgpu.load(ref.at[s, 0, r], mask=valid, other=0.0)
            else:
                part = plgpu.load(ref.at[s, brow[:, None], r[None, :]],
                                  mask=(brow < B)[:, None] & valid[None, :], other=0.0)
            tot = part if tot is None else tot + part
        return tot

    h = summed(h_ref)
    if b1_ref is not None:
        bias = plgpu.load(b1_ref.at[rows], mask=valid, other=0).astype(jnp.float32)
        h = h + (bias if Bp == 1 else bias[None, :])
    if gated:
        a = act(summed(g_ref)) * h
    else:
        a = act(h)
    return jnp.where(valid if Bp == 1 else valid[None, :], a, 0.0)
