"""Activation-sparse matrix-vector Pallas kernels: only the weight rows that the
activations select are read (`dejavu_jax.activation_sparsity`).

* :func:`threshold_matvec` (input sparsity, TEAL's): ``out[b, n] = sum_k x[b, k] W_t[k, n]``
  over the input channels with ``|x[b, k]| > threshold``. ``W_t [K, N]`` is stored input-
  major, so a channel is one contiguous row; the kernel finds the kept channels on the
  device and its loads of the other rows are masked off, so they are never fetched. With
  several rows a channel is read when any row keeps it, and each row multiplies its own
  masked x, so every row's result is its own. Split-k over the channels: fp32 partials
  the caller sums, or with ``residual`` atomically added into the residual rows.
* :func:`row_masked_matvec` (output sparsity, CATS' up projection): ``out[b, i] =
  W[i] . x[b]`` for the rows with ``keep[i]``, 0 elsewhere; ``W [F, d]`` row-major, the
  other rows are never fetched.

Both take ``impl`` (None: Pallas on GPU, the jnp reference elsewhere; "pallas",
"interpret", "reference"). Triton needs power-of-two blocks, so loads and stores are
masked at the ragged edges.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from ._common import cdiv, check_array, is_pow2, next_pow2, resolve_impl, sm_count
from .gather_matvec import accumulate_blocks, batch_pad, evict_hint, mma, write_split_k
from .head_attention import NEG, merge_splits
from .launch import LaunchPart, launch

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ThresholdBlocks:
    """Block settings of one :func:`threshold_matvec` call (its keyword arguments of the
    same names); row_blocks None: `auto_row_blocks` up to max_row_blocks."""
    block_rows: int = 16
    block_n: int = 512
    row_blocks: int | None = None
    max_row_blocks: int = 4
    num_warps: int = 4
    num_stages: int = 2
    evict_first: bool = True
    columns_first: bool = False
    residual_atomics: bool = True
    deferred_sum: bool = False

    def __post_init__(self):
        if not (is_pow2(self.block_rows) and is_pow2(self.block_n)):
            raise ValueError(f"block_rows={self.block_rows} and block_n={self.block_n} must "
                             f"be powers of 2")
        if (self.row_blocks is not None and self.row_blocks < 1) or self.max_row_blocks < 1:
            raise ValueError(f"row_blocks={self.row_blocks} must be None or at least 1, and "
                             f"max_row_blocks={self.max_row_blocks} at least 1")
        if not (is_pow2(self.num_warps) and self.num_warps <= 16 and self.num_stages >= 1):
            raise ValueError(f"num_warps={self.num_warps} must be a power of 2 up to 16 and "
                             f"num_stages={self.num_stages} at least 1")

    def kwargs(self) -> dict:
        """The settings as :func:`threshold_matvec` keyword arguments."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ThresholdConfig:
    """:class:`ThresholdBlocks` of the activation-sparse layer's input-sparse GEMVs: q/k/v,
    the out-projection, the gate (with input-major up weights, the gate and up in one
    launch) and the down projection. The down projection's long split-k takes up to 8
    blocks a program in a loop Triton pipelines 4 deep, and the out-projection 256
    columns a program, measured faster (docs/activation-sparsity.md). attention_kernel:
    the layer's attention (q/k/v finishing, rotary embedding, the cache write and the
    attention itself) in the decode-attention kernel's one launch, else in XLA's ops;
    gated_kernel: a gated MLP's hidden units (the gate and up partials' sums, the
    activation, the gate threshold, the product) in one launch (`kernels.gated_hidden`),
    else in XLA's ops. Both are on by default, measured faster than XLA's ops.
    gate_rows_kernel: under the gate site's layout (up rows of the kept neurons), the gate
    partials' sum, the activation, the gate threshold, the up rows and the product in one
    launch (`kernels.gated_rows`), else in `row_masked_matvec` and XLA's ops; off until a
    GPU times it. o_merges_splits: with the attention kernel, the out-projection merges
    the attention's flash-decoding splits as it loads them (up to 16 splits), else an XLA
    merge runs between the two launches. qkv_atomics: with the attention kernel, the q/k/v
    GEMV's chunks add into one zeroed fp32 row, so the attention reads one partial, else
    its fp32 partials pass (past 16, an XLA sum first). Both off until a GPU times them."""
    qkv: ThresholdBlocks = ThresholdBlocks()
    o: ThresholdBlocks = ThresholdBlocks(block_n=256)
    gate_up: ThresholdBlocks = ThresholdBlocks()
    down: ThresholdBlocks = ThresholdBlocks(max_row_blocks=8, num_stages=4)
    attention_kernel: bool = True
    gated_kernel: bool = True
    gate_rows_kernel: bool = False
    o_merges_splits: bool = False
    qkv_atomics: bool = False


def threshold_matvec_reference(x, w_t, threshold, *, residual=None, bias=None):
    """jnp reference of :func:`threshold_matvec`."""
    xs = jnp.where(jnp.abs(x) > threshold, x, 0).astype(F32)
    out = jnp.dot(xs, w_t.astype(F32), precision=lax.Precision.HIGHEST)
    if bias is not None:
        out = out + bias.astype(F32)
    return out if residual is None else residual + out


def _merged_rows(o_ref, m_ref, l_ref, r, valid, brow, bmask, *, S, hd, Bp):
    """Rows ``r`` of the attention output merged from its ``S`` flash-decoding splits (as
    `head_attention.merge_splits`): ``[len(r)]`` at one row, else ``[Bp, len(r)]``."""
    s = jnp.arange(next_pow2(S), dtype=jnp.int32)
    if Bp == 1:
        at = (s[:, None], 0, r[None, :])
        head = (s[:, None], 0, (r // hd)[None, :])
        mask = (s < S)[:, None] & valid[None, :]
    else:
        at = (s[:, None, None], brow[None, :, None], r[None, None, :])
        head = (s[:, None, None], brow[None, :, None], (r // hd)[None, None, :])
        mask = (s < S)[:, None, None] & bmask[None, :, None] & valid[None, None, :]
    o = plgpu.load(o_ref.at[at], mask=mask, other=0.0)
    m = plgpu.load(m_ref.at[head], mask=mask, other=NEG)
    l = plgpu.load(l_ref.at[head], mask=mask, other=0.0)
    w = jnp.exp(m - jnp.max(m, axis=0)[None])
    den = jnp.sum(l * w, axis=0)
    return jnp.sum(o * w, axis=0) / jnp.where(den > 0, den, 1.0)


def _threshold_body(pids, x_ref, *refs, B, Bp, K, N, bk, bn, kblocks, accumulate, has_bias,
                    t_index, t_stride, evict_first, columns_first, deferred_sum,
                    splits=None):
    if splits is not None:  # x_ref: the attention's split outputs, merged as loaded
        m_ref, l_ref, *refs = refs
    t_ref, w_ref, *rest = refs
    row0, t_at = 0, t_index
    if t_stride is not None:  # stacked weights: this layer's rows start at layer * K
        layer_ref, *rest = rest
        layer = layer_ref[0]
        row0, t_at = layer * K, layer * t_stride + t_index
    if accumulate:
        b_ref = rest[1] if has_bias else None
        o_ref = rest[-1]
    else:
        o_ref = rest[0]
    j, i = pids if columns_first else pids[::-1]
    kk = jnp.arange(bk, dtype=jnp.int32)
    brow = jnp.arange(Bp, dtype=jnp.int32)
    bmask = brow < B
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    cm = cols < N
    t = t_ref[t_at].astype(F32)

    def block(s, acc):
        r = (i * kblocks + s) * bk + kk
        valid = r < K
        if splits is not None:
            xr = _merged_rows(x_ref, m_ref, l_ref, r, valid, brow, bmask, S=splits[0],
                              hd=splits[1], Bp=Bp)
        elif Bp == 1:
            xr = plgpu.load(x_ref.at[0, r], mask=valid, other=0).astype(F32)
        else:
            xr = plgpu.load(x_ref.at[brow[:, None], r[None, :]],
                            mask=bmask[:, None] & valid[None, :], other=0).astype(F32)
        if Bp == 1:
            kept = jnp.abs(xr) > t
            xr = jnp.where(kept, xr, 0.0)
        else:
            own = jnp.abs(xr) > t
            xr = jnp.where(own, xr, 0.0)
            kept = jnp.max(own.astype(jnp.int32), axis=0) > 0
        w = plgpu.load(w_ref.at[(row0 + r)[:, None], cols[None, :]],
                       mask=(kept & valid)[:, None] & cm[None, :], other=0,
                       eviction_policy=evict_hint(evict_first))
        if Bp == 1:
            product = xr[:, None] * w.astype(F32)
            return acc + (product if deferred_sum else jnp.sum(product, axis=0))
        return acc + mma(xr, w)

    vector = Bp == 1
    acc = accumulate_blocks(block, kblocks, ((bk, bn) if deferred_sum else (bn,)) if vector
                            else (Bp, bn))
    if vector and deferred_sum:  # one sum over the block's rows, after the last block
        acc = jnp.sum(acc, axis=0)
    write_split_k(acc, o_ref, b_ref if accumulate else None, i, cols, N, B=B, Bp=Bp,
                  accumulate=accumulate, has_bias=has_bias)


def auto_row_blocks(K: int, N: int, block_rows: int, block_n: int, most: int = 4) -> int:
    """Blocks per program: `most`, or half as many, and so on, where a matrix is too small
    to give every streaming multiprocessor two programs (an attention projection of a
    small model)."""
    blocks = most
    while blocks >= 2:
        if cdiv(K, block_rows * blocks) * cdiv(N, block_n) >= 2 * sm_count():
            return blocks
        blocks //= 2
    return 1


def threshold_matvec_part(x, w_t, threshold, *, residual=None, bias=None, block_rows=16,
                          block_n=512, row_blocks=None, max_row_blocks=4,
                          threshold_index=0, layer=None, evict_first=False,
                          columns_first=False, deferred_sum=False, splits=None) -> LaunchPart:
    """:func:`threshold_matvec`'s kernel as a :class:`~.launch.LaunchPart`: outputs fp32
    partials ``[n_chunks, B, N]``, or ``[B, N]`` (residual, bias and the product) with
    ``residual``."""
    B, K = x.shape[-2:]
    N = w_t.shape[1]
    table, t_stride = _threshold_table(threshold, threshold_index, layer)
    Bp = batch_pad(B)
    bk = block_rows if Bp == 1 else max(16, block_rows)
    if row_blocks is None:
        row_blocks = auto_row_blocks(K, N, bk, block_n, max_row_blocks)
    kblocks = max(1, min(row_blocks, cdiv(K, bk)))
    nkc, ndb = cdiv(K, bk * kblocks), cdiv(N, block_n)
    accumulate = residual is not None
    body = functools.partial(_threshold_body, B=B, Bp=Bp, K=K, N=N, bk=bk, bn=block_n,
                             kblocks=kblocks, accumulate=accumulate,
                             has_bias=bias is not None, t_index=threshold_index,
                             t_stride=t_stride, evict_first=evict_first,
                             columns_first=columns_first, deferred_sum=deferred_sum,
                             splits=None if splits is None else (
                                 x.shape[0], K // splits[0].shape[-1]))
    args = ([x] + list(splits or ()) + [table, w_t]
            + ([] if layer is None else [_layer_arg(layer)]))
    if accumulate:
        if block_n > N:
            raise ValueError(f"block_n={block_n} must not exceed N={N} with a residual")
        aliases = {len(args): 0}
        args += [residual] + ([bias] if bias is not None else [])
        out_shape = jax.ShapeDtypeStruct((B, N), F32)
    else:
        aliases = {}
        out_shape = jax.ShapeDtypeStruct((nkc, B, N), F32)
    grid = (ndb, nkc) if columns_first else (nkc, ndb)
    return LaunchPart(body, grid, tuple(args), (out_shape,), aliases,
                      name="threshold_matvec")


def _threshold_table(threshold, index: int, layer=None):
    """(the threshold as the kernel reads it: flat fp32, element `index` used, or with
    `layer` element ``layer * S + index`` of a table ``[L, S]``; S, or None without
    `layer`). A table (every layer's thresholds) passes whole, so that no slice of it is
    copied per launch."""
    threshold = jnp.asarray(threshold, F32)
    if layer is not None:
        if threshold.ndim != 2 or not 0 <= index < threshold.shape[1]:
            raise ValueError(f"with a layer the threshold must be a table [L, S] and "
                             f"threshold_index below S, got {tuple(threshold.shape)} and "
                             f"{index}")
        return threshold.reshape(-1), threshold.shape[1]
    table = threshold.reshape(-1)
    if not 0 <= index < table.shape[0]:
        raise ValueError(f"threshold_index={index} is outside a threshold of "
                         f"{table.shape[0]} values")
    return table, None


def _threshold_value(threshold, index: int, layer=None):
    """The threshold one call uses (the reference's)."""
    table, stride = _threshold_table(threshold, index, layer)
    if layer is None:
        return table[index]
    return table[jnp.asarray(layer, jnp.int32).reshape(()) * stride + index]


def _layer_arg(layer):
    """The layer index as the kernels read it: int32 ``[1]`` (it may be traced)."""
    return jnp.asarray(layer, jnp.int32).reshape(1)


def _check_layer(layer, n_layers: int, table_layers: int | None = None) -> None:
    """`layer` one index, and where it is concrete one of the `n_layers` the weights (and
    the threshold table's `table_layers` rows) hold: outside them a kernel would read
    another array's memory."""
    if jnp.size(layer) != 1:
        raise ValueError(f"layer must be one index, got shape {jnp.shape(layer)}")
    if table_layers is not None and table_layers < n_layers:
        raise ValueError(f"the threshold table has {table_layers} rows for weights of "
                         f"{n_layers} layers")
    if not isinstance(layer, jax.core.Tracer):
        value = int(jnp.asarray(layer).reshape(()))
        if not 0 <= value < n_layers:
            raise ValueError(f"layer={value} is outside the {n_layers} layers the weights "
                             f"hold")


def _layer_rows(w, layer, rows: int):
    """Rows ``layer * rows ...`` of ``w`` (every layer's rows flattened), or ``w`` itself
    without a layer: the matrix one layer reads."""
    if layer is None:
        return w
    start = jnp.asarray(layer, jnp.int32).reshape(()) * rows
    return lax.dynamic_slice_in_dim(w, start, rows, axis=0)


def _check_inputs(x, w_ts, block_rows, block_n, layer=None, threshold=None):
    check_array("x", x, ndim=2, floating=True)
    K = x.shape[1]
    if not K:
        raise ValueError("x has no channels")
    for w_t in w_ts:
        check_array("w_t", w_t, ndim=2, floating=True)
        if layer is None and w_t.shape[0] != K:
            raise ValueError(f"w_t has {w_t.shape[0]} rows, x {K} channels")
        if layer is not None and (w_t.shape[0] % K or not w_t.shape[0]):
            raise ValueError(f"with a layer w_t must hold every layer's rows [L * {K}, N], "
                             f"got {w_t.shape[0]} rows")
        if layer is not None:
            table = jnp.shape(threshold)
            _check_layer(layer, w_t.shape[0] // K, table[0] if len(table) == 2 else None)
    if not (is_pow2(block_rows) and is_pow2(block_n)):
        raise ValueError(f"block_rows={block_rows} and block_n={block_n} must be powers of 2")


def threshold_matvec(x, w_t, threshold, *, residual=None, bias=None, block_rows=16,
                     block_n=512, row_blocks=None, max_row_blocks=4, num_warps=4,
                     num_stages=2, evict_first=True, columns_first=False,
                     residual_atomics=True, deferred_sum=False, threshold_index=0, layer=None,
                     splits=None, impl=None):
    """``(x masked to |x| > threshold) @ w_t`` (+ bias, + residual) as fp32 ``[B, N]``,
    reading only the rows of ``w_t [K, N]`` that some row of ``x [B, K]`` keeps.

    threshold: a scalar, or an array of which the flat element ``threshold_index`` is
    used (a table of every layer's thresholds, read in place); layer: with stacked
    weights, ``w_t`` holds every layer's rows ``[L * K, N]`` and this layer's are read in
    place (an int32 scalar, may be traced); the threshold is then element
    ``[layer, threshold_index]`` of a table ``[L, S]``; residual: fp32 ``[B, N]``,
    updated in place when the caller donates it (the chunks add into it atomically, so the
    low bits of the fp32 sums vary between runs). block_rows (a power of two) rows per
    block, row_blocks blocks per program (None: `auto_row_blocks` up to max_row_blocks),
    block_n (a power of two) columns per program; num_stages: Triton's software pipelining
    depth of the loop over the blocks (from 5 blocks on); evict_first: the weight rows
    loaded with L2's evict-first hint (each is read once a token); columns_first:
    consecutive programs take the column blocks of the same channels (else the channel
    chunks of the same columns); residual_atomics: with ``residual``, the chunks add into
    it in the launch (else they write partials that XLA sums into it); deferred_sum: at one
    row, each program keeps a ``[block_rows, block_n]`` accumulator and sums its rows once
    after its last block (else after every block); splits: ``(m, l)``, fp32 ``[S, B, H]``,
    the flash-decoding splits' score maxima and sums of attention outputs ``x [S, B, H *
    hd]`` (`head_attention.decode_attention`'s unnormalised ``o``): the GEMV's input is
    their merge (`head_attention.merge_splits`), formed as the kernel loads its rows.
    """
    if splits is not None:
        x, splits = _check_splits(x, splits)
    merged = x if splits is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    _check_inputs(merged, [w_t], block_rows, block_n, layer, threshold)
    B = x.shape[-2]
    if residual is not None and (residual.shape != (B, w_t.shape[1]) or residual.dtype != F32):
        raise ValueError(f"residual must be fp32 {(B, w_t.shape[1])}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    impl = resolve_impl(impl)
    if impl == "reference":
        if splits is not None:
            x = merged_splits(x, *splits)
        return threshold_matvec_reference(
            x, _layer_rows(w_t, layer, x.shape[1]),
            _threshold_value(threshold, threshold_index, layer), residual=residual, bias=bias)
    in_launch = residual is not None and residual_atomics
    block_n = min(block_n, 1 << (w_t.shape[1].bit_length() - 1)) if in_launch else block_n
    part = threshold_matvec_part(x, w_t, threshold, residual=residual if in_launch else None,
                                 splits=splits,
                                 bias=bias if in_launch else None, block_rows=block_rows,
                                 block_n=block_n, row_blocks=row_blocks,
                                 max_row_blocks=max_row_blocks,
                                 threshold_index=threshold_index, layer=layer,
                                 evict_first=evict_first, columns_first=columns_first,
                                 deferred_sum=deferred_sum)
    (out,), = launch([part], num_warps=num_warps, num_stages=num_stages,
                     interpret=impl == "interpret")
    if in_launch:
        return out
    out = jnp.sum(out, axis=0)
    out = out if bias is None else out + bias.astype(F32)
    return out if residual is None else residual + out


def merged_splits(o, m, l):
    """The attention output ``[B, H * hd]`` merged from flash-decoding splits (``o [S, B,
    H * hd]``, ``m`` and ``l [S, B, H]``; `head_attention.merge_splits`)."""
    S, B, K = o.shape
    return merge_splits(o.reshape(S, B, m.shape[-1], -1), m, l).reshape(B, K)


def _check_splits(o, splits):
    """(o, (m, l)) checked: attention outputs [S, B, H * hd] and their splits' maxima and
    sums [S, B, H], fp32."""
    check_array("x", o, ndim=3, floating=True)
    if not isinstance(splits, (tuple, list)) or len(splits) != 2:
        raise ValueError("splits must be (m, l), each [S, B, H]")
    S, B, K = o.shape
    for name, a in zip("ml", splits):
        check_array(name, a, ndim=3, floating=True)
        if a.shape[:2] != (S, B) or not a.shape[2] or K % a.shape[2]:
            raise ValueError(f"{name} must be [S={S}, B={B}, H] with H dividing x's {K} "
                             f"channels, got {tuple(a.shape)}")
    m, l = splits
    if m.shape != l.shape:
        raise ValueError(f"m and l differ in shape: {tuple(m.shape)}, {tuple(l.shape)}")
    return o, (m.astype(F32), l.astype(F32))


def threshold_matvecs(x, w_ts, threshold, *, block_rows=16, block_n=512, row_blocks=None,
                      max_row_blocks=4, num_warps=4, num_stages=2, evict_first=True,
                      columns_first=False, residual_atomics=True, deferred_sum=False,
                      threshold_index=0, layer=None, partials=False, impl=None) -> list:
    """:func:`threshold_matvec` of one masked ``x`` by several matrices (a gated MLP's gate
    and up projections) in one launch: fp32 ``[B, N_i]`` per ``w_ts[i] [K, N_i]`` (with
    ``layer``, every layer's rows ``[L * K, N_i]``, as in :func:`threshold_matvec`; the
    block settings as there, residual_atomics unused: there is no residual). partials:
    each product's split-k fp32 partials ``[n, B, N_i]`` unsummed (``n`` 1 on the
    reference path), for a consumer that sums them in its own launch."""
    _check_inputs(x, w_ts, block_rows, block_n, layer, threshold)
    impl = resolve_impl(impl)
    if impl == "reference":
        t = _threshold_value(threshold, threshold_index, layer)
        outs = [threshold_matvec_reference(x, _layer_rows(w_t, layer, x.shape[1]), t)
                for w_t in w_ts]
        return [out[None] for out in outs] if partials else outs
    parts = [threshold_matvec_part(x, w_t, threshold, block_rows=block_rows,
                                   block_n=block_n, row_blocks=row_blocks,
                                   max_row_blocks=max_row_blocks,
                                   threshold_index=threshold_index, layer=layer,
                                   evict_first=evict_first, columns_first=columns_first,
                                   deferred_sum=deferred_sum)
             for w_t in w_ts]
    outs = launch(parts, num_warps=num_warps, num_stages=num_stages,
                  interpret=impl == "interpret")
    return [out if partials else jnp.sum(out, axis=0) for (out,) in outs]


def row_masked_matvec_reference(x, w, keep):
    """jnp reference of :func:`row_masked_matvec`."""
    out = jnp.dot(x.astype(F32), w.astype(F32).T, precision=lax.Precision.HIGHEST)
    return jnp.where(keep, out, 0.0)


def _row_masked_body(pids, x_ref, keep_ref, w_ref, *rest, B, Bp, F, d, bk, bd, chunks,
                     stacked):
    if stacked:  # this layer's rows start at layer * F
        layer_ref, o_ref = rest
        row0 = layer_ref[0] * F
    else:
        (o_ref,), row0 = rest, 0
    i, j = pids
    r = i * bk + jnp.arange(bk, dtype=jnp.int32)
    valid = r < F
    if keep_ref.shape[0] == 1:
        kept = plgpu.load(keep_ref.at[0, r], mask=valid, other=0) != 0
    else:  # one row of flags per batch row: read a row when any batch row keeps it
        brow_k = jnp.arange(batch_pad(keep_ref.shape[0]), dtype=jnp.int32)
        flags = plgpu.load(keep_ref.at[brow_k[:, None], r[None, :]],
                           mask=(brow_k < keep_ref.shape[0])[:, None] & valid[None, :],
                           other=0)
        kept = jnp.max(flags, axis=0) != 0
    rows = kept & valid
    brow = jnp.arange(Bp, dtype=jnp.int32)
    bmask = brow < B

    def chunk(c, acc):
        cols = (j * chunks + c) * bd + jnp.arange(bd, dtype=jnp.int32)
        cm = cols < d
        w = plgpu.load(w_ref.at[(row0 + r)[:, None], cols[None, :]],
                       mask=rows[:, None] & cm[None, :], other=0)
        if Bp == 1:
            xv = plgpu.load(x_ref.at[0, cols], mask=cm, other=0).astype(F32)
            return acc + jnp.sum(w.astype(F32) * xv[None, :], axis=1)
        xb = plgpu.load(x_ref.at[brow[:, None], cols[None, :]],
                        mask=bmask[:, None] & cm[None, :], other=0)
        return acc + mma(xb, w, trans_b=True)

    acc = accumulate_blocks(chunk, chunks, (bk,) if Bp == 1 else (Bp, bk))
    if Bp == 1:
        plgpu.store(o_ref.at[j, 0, r], acc, mask=valid)
    else:
        plgpu.store(o_ref.at[j, brow[:, None], r[None, :]], acc,
                    mask=bmask[:, None] & valid[None, :])


def row_masked_matvec(x, w, keep, *, block_rows=16, block_d=512, d_chunks=1, num_warps=4,
                      layer=None, impl=None):
    """``x @ w[i]`` for the rows ``i`` of ``w [F, d]`` with ``keep`` set, 0 for the others:
    fp32 ``[B, F]`` for ``x [B, d]``. keep: bool ``[F]``, or ``[B, F]`` (each batch row its
    own rows; a row is read when any keeps it). Rows not kept are never fetched. layer:
    with stacked weights, ``w`` holds every layer's rows ``[L * F, d]`` (F from ``keep``)
    and this layer's are read in place (an int32 scalar, may be traced).
    """
    check_array("x", x, ndim=2, floating=True)
    check_array("w", w, ndim=2, floating=True)
    B, d = x.shape
    F = w.shape[0] if layer is None else keep.shape[-1]
    if w.shape[1] != d:
        raise ValueError(f"w has width {w.shape[1]}, x {d}")
    if not F:
        raise ValueError("keep selects among no rows")
    if layer is not None and (w.shape[0] % F or not w.shape[0]):
        raise ValueError(f"with a layer w must hold every layer's rows [L * {F}, {d}], got "
                         f"{w.shape[0]} rows")
    if layer is not None:
        _check_layer(layer, w.shape[0] // F)
    if tuple(keep.shape) not in ((F,), (1, F), (B, F)):
        raise ValueError(f"keep must be [{F}] or [{B}, {F}], got {tuple(keep.shape)}")
    keep2 = keep.reshape(1, F) if keep.ndim == 1 else keep
    impl = resolve_impl(impl)
    if impl == "reference":
        return row_masked_matvec_reference(x, _layer_rows(w, layer, F), keep2)
    if not (is_pow2(block_rows) and is_pow2(block_d)):
        raise ValueError(f"block_rows={block_rows} and block_d={block_d} must be powers of 2")
    Bp = batch_pad(B)
    bk = block_rows if Bp == 1 else max(16, block_rows)
    nds = cdiv(d, block_d * d_chunks)
    body = functools.partial(_row_masked_body, B=B, Bp=Bp, F=F, d=d, bk=bk, bd=block_d,
                             chunks=d_chunks, stacked=layer is not None)
    args = (x, keep2.astype(jnp.int32), w) + (() if layer is None else (_layer_arg(layer),))
    part = LaunchPart(body, (cdiv(F, bk), nds), args,
                      (jax.ShapeDtypeStruct((nds, B, F), F32),), name="row_masked_matvec")
    (out,), = launch([part], num_warps=num_warps, interpret=impl == "interpret")
    return jnp.where(keep2, jnp.sum(out, axis=0), 0.0)
