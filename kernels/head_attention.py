"""Head-sparse decode attention: one decode step touching only the selected heads.

``head_sparse_attention(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx)``
follows DESIGN.md's contract and extends it (keyword-only, default None) with
grouped-query attention, rotary embeddings and a key-validity mask.

Pipeline (Pallas path), every stage reading only the selected heads:

1. :func:`~.gather_matvec.gather_matvec` -- q, k and v rows of the selected heads in ONE
   launch (three segments), split over d, fp32 partials.
2. :func:`decode_attention` -- flash-decoding over the cache: grid (B, selected KV
   heads, sequence splits). Each program finishes its head's q/k/v from the partials
   (sum, biases, rotary embedding), streams its split of the head's K/V once with an
   online softmax, and the program owning ``pos`` also folds in the current token and
   writes its k/v row into the (aliased, in-place) cache.
3. :func:`~.column_gather.gather_cols_matvec` -- out-projection over the selected heads'
   columns of ``wo [d, H, hd]`` (HF's ``out_proj.weight`` as stored): each program owns
   whole output rows, its loader normalises a single split's (o, l) (several splits are
   merged first, in one XLA fusion), and it adds ``bo`` (and, given a ``residual``, the
   residual rows) with no split-k partials and no atomics.

Missing-KV window (:class:`KVWindow`): the K/V segments of step 1 multiply the window's W
stored inputs instead of x (the current token is one of them), for the selected heads
plus the window's refresh heads; in step 2 each program finishes the window entries of
its split that ``need`` (or the written bitmap) marks, writes them to the caches and
attends to them, and extra programs write the refresh heads' entries. No weight is read
twice and no XLA op runs.

Grouped-query attention: ``wk/wv/bk/bv`` and the caches have ``n_kv = H // group`` heads;
``head_idx`` then holds KV-group ids (query head ``h`` uses KV head ``h // group``), and
``head_mask [Kh, group]`` picks the query heads computed in each selected group (default:
all of them). The selection is a set of query heads; :func:`query_head_groups` turns it
into these two arrays. Unselected query heads cost nothing: their q rows and out-projection
columns are masked loads (never read), and a group with no selected head is skipped
entirely (no K/V weights, no cache reads, no K/V written). With ``n_kv == H`` and no mask
this is exactly DESIGN.md's contract.

Per-row heads (batches): a ``[B, Kh, group]`` mask gives each row its own query heads
among the union ``head_idx``. The projections read the union's weights once for all rows;
each attention program reads and writes its row's cache only for that row's heads (the
KV reads, which grow with batch x context, shrink with each row's set), and the
out-projection sees zeros for a row's other heads.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (balanced_chunks, cdiv, check_array, check_bias, check_indices, is_pow2,
                      next_pow2, resolve_impl, sm_count, soft_cap)
from .column_gather import gather_cols_matvec
from .gather_matvec import (Segment, batch_pad, check_segment, gather_matvec, mma,
                            segment_reference)

NEG = -1e30  # finite "minus infinity" for the online softmax


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Block sizes for the attention pipeline (None = pick from the problem size)."""
    proj_block_rows: int = 16
    window_block_rows: int = 32            # K/V rows per program when a window adds inputs
    proj_block_d: int = 512
    proj_d_chunks: int | None = None
    out_block_rows: int | None = None      # out-projection rows per program (None: 8 at
                                           # batch 1, 32 for a batch; measured best)
    out_block_d: int = 512                 # selected columns per load there
    block_s: int = 64
    seq_splits: int | None = None
    num_warps: int = 4
    num_stages: int | None = None          # projection and out-projection pipeline stages
                                           # (None: 2 at batch 1, 3 for a batch; measured)
    attn_num_warps: int = 4
    target_programs: int | None = None       # the q/k/v projection's grid (None: 8 per SM)
    attn_target_programs: int | None = None  # flash-decoding grid, B x heads x splits
                                             # (None: 4 per SM)
    out_num_warps: int | None = None       # the out-projection's warps (None: num_warps)
    evict_first: bool = False              # q/k/v and out-projection weights loaded with
                                           # L2's evict-first hint

    def stages(self, B: int) -> int:
        """Pipeline stages of the projection launches for batch B (`num_stages`)."""
        return self.num_stages or (2 if B == 1 else 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVWindow:
    """Missing-KV recomputation riding on the projection launch (see module docstring).

    x: ``[B, W, d]`` normed inputs of the window's W tokens in any order (a ring buffer),
      the current token's among them: row ``current`` must hold the values of the call's
      ``x`` (the current token's K/V are computed from that row). The K/V projection reads
      these rows as they lie, so a ring needs no reordering.
    current: int32 scalar in ``[0, W)`` (may be traced), the row of ``x`` holding the
      current token.
    extra_ids: ``[R]`` int32 KV heads recomputed besides ``head_idx`` (a refresh set;
      they get no attention, only K/V), or None.
    need: ``[B, Kh + R, W]`` bool, which (head, window row) cache entries to write, for
      the heads ``concat(head_idx, extra_ids)``; or None with ``written`` given.
    slots: ``[W]`` int32 cache slots of the window rows, in ``[0, S)`` (entries with need
      False may repeat a slot; they are never written). Two rows marked in ``need`` for
      one head must not share a slot, and a head in both ``head_idx`` and ``extra_ids``
      must have the same ``need`` rows in both places.
    cos, sin: ``[B, W, hd]`` fp32 rotary tables of the window rows: required when the
      attention has a rotary embedding (given as tables; a callable ``rope`` cannot be
      combined with a window), None otherwise.
    written, written_base, row_valid: the bitmap form of ``need`` (give these or
      ``need``): ``written [B, N, S]`` bool marks the cache entries that hold their K/V,
      head h's entries in row ``written_base + h`` (an int32 scalar, may be traced);
      ``row_valid [B, W]`` bool (or int32, nonzero) marks the window rows that may be
      written. An entry is
      needed when its row is valid and its bit is clear; the attention launch computes
      that itself and sets the bits of what it writes, so the call returns the updated
      bitmap (no XLA op before or after). A head in both ``head_idx`` and ``extra_ids``
      is written once.
    x_row0: ``x`` then holds more rows per batch row than the window (``[B, R, d]``, say
      every layer's rings): the window's W rows (W = the length of ``slots``) start at
      row ``x_row0`` (an int32 scalar, may be traced) and are read in place; None: ``x``
      is the window ``[B, W, d]``.
    """
    x: jax.Array
    current: jax.Array
    extra_ids: jax.Array | None
    need: jax.Array | None
    slots: jax.Array
    cos: jax.Array | None = None
    sin: jax.Array | None = None
    written: jax.Array | None = None
    written_base: jax.Array | None = None
    row_valid: jax.Array | None = None
    x_row0: jax.Array | None = None


# ----------------------------------------------------------------------------
# helpers shared by both paths
# ----------------------------------------------------------------------------

def _query_heads(head_idx, group: int):
    """Query-head ids of the selected KV groups, ``[Kh * group]`` (group-major)."""
    if group == 1:
        return head_idx
    return (head_idx[:, None] * group + jnp.arange(group, dtype=head_idx.dtype)).reshape(-1)


def query_head_groups(q_ids, n_kv: int, group: int, n_groups: int | None = None):
    """The KV groups of a query-head selection: ``(group_ids [n_groups], head_mask
    [n_groups, group] bool)`` for distinct query-head ids ``q_ids [Kq]`` of ``n_kv * group``
    heads.

    The groups holding a selected head come first, in ascending order, then groups with
    none (their mask rows all False: the kernels skip them) fill the static capacity
    ``n_groups`` (default ``min(n_kv, Kq)``, every group a selection can touch). For
    ``group == 1`` this is ``(q_ids, None)``: multi-head attention needs no mask; a set of
    every query head (its static size ``n_kv * group``) gives ``(all groups, None)``.
    Per-row selections ``q_ids [B, Kq]`` (each row's own distinct heads) give the groups of
    the rows' union (default capacity ``min(n_kv, B * Kq)``) and a per-row mask
    ``[B, n_groups, group]``, for every ``group`` (1 included).
    """
    if q_ids.ndim == 2:
        return _row_query_head_groups(q_ids, n_kv, group, n_groups)
    if group == 1:
        return q_ids.astype(jnp.int32), None
    if q_ids.shape[0] == n_kv * group and n_groups in (None, n_kv):
        return jnp.arange(n_kv, dtype=jnp.int32), None
    n_groups = min(n_kv, q_ids.shape[0]) if n_groups is None else n_groups
    keep = jnp.zeros((n_kv * group,), bool).at[q_ids].set(True).reshape(n_kv, group)
    order = jnp.argsort(jnp.logical_not(keep.any(axis=1)).astype(jnp.int32), stable=True)
    gids = order[:n_groups].astype(jnp.int32)
    return gids, keep[gids]


def _row_query_head_groups(q_ids, n_kv: int, group: int, n_groups: int | None):
    """:func:`query_head_groups` of per-row selections ``q_ids [B, Kq]``: the groups of
    the rows' union, and each row's own query heads in them, ``[B, n_groups, group]``."""
    B, Kq = q_ids.shape
    n_groups = min(n_kv, B * Kq) if n_groups is None else n_groups
    rows = jnp.arange(B)[:, None]
    keep = jnp.zeros((B, n_kv * group), bool).at[rows, q_ids].set(True)
    keep = keep.reshape(B, n_kv, group)
    if n_groups == n_kv:   # every group: idle ones have all-False rows, which cost nothing
        return jnp.arange(n_kv, dtype=jnp.int32), keep
    idle = jnp.logical_not(keep.any(axis=(0, 2))).astype(jnp.int32)
    gids = jnp.argsort(idle, stable=True)[:n_groups].astype(jnp.int32)
    return gids, keep[:, gids]


def union_head_mask(head_mask):
    """The ``[Kh, G]`` query heads some row computes, of a ``[Kh, G]`` or per-row
    ``[B, Kh, G]`` head mask (None stays None)."""
    if head_mask is None or head_mask.ndim == 2:
        return head_mask
    return jnp.any(head_mask.astype(bool), axis=0)


def _active_groups(head_mask, Kh: int):
    """``[Kh]`` bool: the selected groups with at least one selected query head."""
    if head_mask is None:
        return jnp.ones((Kh,), bool)
    return jnp.any(head_mask.astype(bool), axis=1)


def rotate_half(t):
    """HF Llama's ``rotate_half``: concat(-x2, x1) over the last axis."""
    h = t.shape[-1] // 2
    return jnp.concatenate([-t[..., h:], t[..., :h]], axis=-1)


def apply_rope(t, rope):
    """Apply ``rope`` to ``t [B, n, hd]``: a callable, or ``(cos, sin)`` of ``[hd]`` / ``[B, hd]``."""
    if rope is None:
        return t
    if callable(rope):
        return rope(t)
    cos, sin = rope
    cos = jnp.asarray(cos, jnp.float32)
    sin = jnp.asarray(sin, jnp.float32)
    if cos.ndim == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    return t * cos + rotate_half(t) * sin


def _validate(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx, rope,
              kv_mask, head_mask=None):
    check_array("x", x, ndim=2, floating=True)
    B, d = x.shape
    check_array("wq", wq, ndim=3, floating=True)
    H, hd, dq = wq.shape
    if dq != d:
        raise ValueError(f"wq is [H, hd, d] = {tuple(wq.shape)} but x has width {d}")
    check_array("wk", wk, ndim=3, floating=True)
    n_kv = wk.shape[0]
    if n_kv < 1 or H % n_kv:
        raise ValueError(f"wk has {n_kv} KV heads, which must divide the {H} query heads")
    check_array("wk", wk, shape=(n_kv, hd, d))
    check_array("wv", wv, shape=(n_kv, hd, d), floating=True)
    check_array("wo", wo, ndim=3, floating=True)
    Hl = wo.shape[1]
    if (wo.shape[2] != hd or Hl < 1 or H % Hl or wo.shape[0] != H // Hl * d
            or n_kv % (H // Hl)):
        raise ValueError(f"wo must be [d, H, hd] = [{d}, {H}, {hd}] (or L layers stacked by "
                         f"rows, [L*d, H/L, hd], when the other weights hold L layers' "
                         f"heads), got {tuple(wo.shape)}")
    check_bias("bq", bq, (H, hd))
    check_bias("bk", bk, (n_kv, hd))
    check_bias("bv", bv, (n_kv, hd))
    check_bias("bo", bo, (d,))
    check_array("k_cache", k_cache, ndim=4, floating=True)
    if k_cache.shape[0] != B or k_cache.shape[1] != n_kv or k_cache.shape[3] != hd:
        raise ValueError(f"k_cache must be [B, n_kv, S, hd] = [{B}, {n_kv}, S, {hd}], "
                         f"got {tuple(k_cache.shape)}")
    check_array("v_cache", v_cache, shape=k_cache.shape, floating=True)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype "
                        f"{k_cache.dtype}")
    S = k_cache.shape[2]
    check_indices("head_idx", head_idx, n_kv)
    if not hasattr(pos, "shape"):
        if not isinstance(pos, (int, np.integer)):
            raise TypeError(f"pos must be an integer scalar, got {type(pos).__name__}")
    else:
        if np.shape(pos) not in ((), (1,)):
            raise ValueError(f"pos must be a scalar, got shape {np.shape(pos)}")
        if not jnp.issubdtype(pos.dtype, jnp.integer):
            raise TypeError(f"pos must be an integer scalar, got dtype {pos.dtype}")
    if not isinstance(pos, jax.core.Tracer):
        p = int(np.asarray(pos).reshape(()))
        if not 0 <= p < S:
            raise ValueError(f"pos={p} is outside the cache length S={S}")
    if rope is not None and not callable(rope):
        if not isinstance(rope, (tuple, list)) or len(rope) != 2:
            raise TypeError("rope must be a callable or a (cos, sin) pair")
        for nm, a in zip(("rope cos", "rope sin"), rope):
            if np.shape(a) not in ((hd,), (B, hd)):
                raise ValueError(f"{nm} must have shape ({hd},) or ({B}, {hd}), "
                                 f"got {np.shape(a)}")
    if rope is not None and hd % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {hd}")
    if kv_mask is not None:
        check_array("kv_mask", kv_mask, shape=(B, S))
    if head_mask is not None:
        Kh, G = head_idx.shape[0], H // n_kv
        if np.ndim(head_mask) == 3:
            check_array("head_mask", head_mask, shape=(B, Kh, G))
        else:
            check_array("head_mask", head_mask, shape=(Kh, G))
    return H // n_kv


# ----------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------

def window_inputs(window: KVWindow) -> jax.Array:
    """The window's input rows ``[B, W, d]`` (a slice of ``x`` where ``x_row0`` is given)."""
    if window.x_row0 is None:
        return window.x
    return lax.dynamic_slice_in_dim(window.x, jnp.asarray(window.x_row0, jnp.int32),
                                    window.slots.shape[0], axis=1)


def window_heads(head_idx, window: KVWindow):
    """The KV heads a window recomputes: ``concat(head_idx, window.extra_ids)``."""
    head_idx = head_idx.astype(jnp.int32)
    if window.extra_ids is None:
        return head_idx
    return jnp.concatenate([head_idx, window.extra_ids.astype(jnp.int32)])


def window_need(window: KVWindow, ids) -> jax.Array:
    """``[B, n, W]`` bool: the window's entries to write for the KV heads ``ids`` (its
    ``need``, or what its bitmap says is missing from valid rows)."""
    if window.need is not None:
        return window.need
    B = window.written.shape[0]
    rows = jnp.asarray(window.written_base, jnp.int32) + ids.astype(jnp.int32)
    held = window.written[jnp.arange(B)[:, None, None], rows[None, :, None],
                          window.slots[None, None, :]]
    return ~held & window.row_valid.astype(bool)[:, None, :]


def window_past_flags(window: KVWindow, ids) -> jax.Array:
    """``[n]`` int32: 1 for the KV heads ``ids`` that need some window row other than the
    current token's, in any batch row."""
    W = window.slots.shape[0]
    past = jnp.arange(W, dtype=jnp.int32) != jnp.asarray(window.current, jnp.int32)
    need = window_need(window, ids) & past[None, None, :]
    return jnp.any(need, axis=(0, 2)).astype(jnp.int32)


def mark_written(window: KVWindow, ids, need) -> jax.Array:
    """The window's bitmap with the entries ``need [B, n, W]`` of heads ``ids`` set."""
    written = window.written
    B, S = written.shape[0], written.shape[2]
    rows = jnp.asarray(window.written_base, jnp.int32) + ids.astype(jnp.int32)
    s_i = jnp.where(need, window.slots[None, None, :], S)
    return written.at[jnp.arange(B)[:, None, None], rows[None, :, None], s_i].set(
        True, mode="drop")


def _window_rope(t, window: KVWindow):
    """Rotary embedding of window K ``[B, n, W, hd]`` at the window tokens' positions."""
    if window.cos is None:
        return t
    cos, sin = window.cos[:, None], window.sin[:, None]
    return t * cos + rotate_half(t) * sin


def merge_window(cache, new, ids, window: KVWindow, need):
    """Write ``new [B, n, W, hd]`` into ``cache [B, n_kv, S, hd]`` at (ids, window.slots)
    where ``need``; nothing else is written (entries without need go to slot S and
    are dropped, so a slot repeated in the window keeps the needed value)."""
    B, S = cache.shape[0], cache.shape[2]
    b_i = jnp.arange(B)[:, None, None]
    g_i = ids[None, :, None]
    s_i = jnp.where(need, window.slots[None, None, :], S)
    return cache.at[b_i, g_i, s_i].set(new.astype(cache.dtype), mode="drop")


def _window_kv_reference(wk, bk, wv, bv, ids, window: KVWindow, k_norm=None,
                         norm_eps: float = 1e-6):
    f32 = jnp.float32
    hi = lax.Precision.HIGHEST
    xs = window_inputs(window).astype(f32)

    def proj(w, b):
        t = jnp.einsum("bwd,nkd->bnwk", xs, w[ids].astype(f32), precision=hi)
        return t if b is None else t + b[ids].astype(f32)[None, :, None]

    return _window_rope(head_norm(proj(wk, bk), k_norm, norm_eps), window), proj(wv, bv)


def head_norm(t, weight, eps: float):
    """RMSNorm over each head's vector ``t [..., hd]`` with weights ``[hd]`` (Gemma 3's q/k
    norms), fp32."""
    if weight is None:
        return t
    tf = t.astype(jnp.float32)
    return (tf * lax.rsqrt(jnp.mean(tf * tf, axis=-1, keepdims=True) + eps)
            * weight.astype(jnp.float32))


def head_sparse_attention_reference(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache,
                                    pos, head_idx, *, rope=None, kv_mask=None,
                                    window: KVWindow | None = None, out_dtype=None,
                                    qk_norm=None, norm_eps: float = 1e-6, scale=None,
                                    head_mask=None, softcap=None):
    """Pure-jnp reference of :func:`head_sparse_attention` (same signature and result,
    without ``residual`` and ``extra_segments``; ``out_dtype`` overrides the output's
    dtype, ``x.dtype`` by default)."""
    f32 = jnp.float32
    hi = lax.Precision.HIGHEST
    B, d = x.shape
    H, hd, _ = wq.shape
    n_kv = wk.shape[0]
    G = H // n_kv
    Kh = head_idx.shape[0]
    head_idx = head_idx.astype(jnp.int32)
    pos = jnp.asarray(pos, jnp.int32).reshape(())
    hq = _query_heads(head_idx, G)
    # each row's computed query heads [B, Kh, G], and the groups holding one [B, Kh]
    row_q = (jnp.ones((Kh, G), bool) if head_mask is None else head_mask.astype(bool))
    row_q = jnp.broadcast_to(row_q, (B, Kh, G))
    active = jnp.any(row_q, axis=2)
    keep_q = row_q.reshape(B, Kh * G)
    xf = x.astype(f32)

    def proj(w, b, ids):
        t = jnp.einsum("bd,hkd->bhk", xf, w[ids].astype(f32), precision=hi)
        return t if b is None else t + b[ids].astype(f32)[None]

    q_norm, k_norm = (None, None) if qk_norm is None else qk_norm
    scale = hd ** -0.5 if scale is None else scale
    q = apply_rope(head_norm(proj(wq, bq, hq), q_norm, norm_eps), rope) * scale
    k = apply_rope(head_norm(proj(wk, bk, head_idx), k_norm, norm_eps), rope)
    v = proj(wv, bv, head_idx)
    written = None
    if window is not None:
        ids = window_heads(head_idx, window)
        n_extra = ids.shape[0] - Kh
        need = window_need(window, ids) & jnp.concatenate(
            [active, jnp.ones((B, n_extra), bool)], axis=1)[:, :, None]
        k_win, v_win = _window_kv_reference(wk, bk, wv, bv, ids, window, k_norm, norm_eps)
        k_cache = merge_window(k_cache, k_win, ids, window, need)
        v_cache = merge_window(v_cache, v_win, ids, window, need)
        if window.written is not None:
            written = mark_written(window, ids, need)
    # a group with no selected head writes nothing (its K/V stays missing)
    act = active[:, :, None]
    k_cache = k_cache.at[:, head_idx, pos, :].set(
        jnp.where(act, k.astype(k_cache.dtype), k_cache[:, head_idx, pos, :]))
    v_cache = v_cache.at[:, head_idx, pos, :].set(
        jnp.where(act, v.astype(v_cache.dtype), v_cache[:, head_idx, pos, :]))
    o = _attention_core_reference(q.reshape(B, Kh, G, hd), k_cache[:, head_idx],
                                  v_cache[:, head_idx], pos, kv_mask,
                                  softcap).reshape(B, Kh * G, hd)
    o = jnp.where(keep_q[:, :, None], o, 0.0)               # unselected query heads add 0
    Hl = wo.shape[1]                 # wo may stack H // Hl layers by rows
    wo_sel = wo.reshape(H // Hl, d, Hl, hd)[hq // Hl, :, hq % Hl]     # [Kh*G, d, hd]
    wo_sel = jnp.where(jnp.any(keep_q, axis=0)[:, None, None], wo_sel, 0.0)
    out = jnp.einsum("bhk,hdk->bd", o, wo_sel.astype(f32), precision=hi)
    if bo is not None:
        out = out + bo.astype(f32)
    out = out.astype(out_dtype or x.dtype)
    return (out, k_cache, v_cache) + (() if written is None else (written,))


# ----------------------------------------------------------------------------
# flash-decoding kernel
# ----------------------------------------------------------------------------

def _decode_attention_kernel(*refs, nds, has_bq, has_bk, has_bv, has_rope, has_mask, G, Gp,
                             hd, hdp, L, bs, scale, Kh, W, Wp, bitmap, has_hmask, row_hmask,
                             softcap, columns):
    # W > 0: a missing-KV window. Grid axis 1 then runs over Kh selected + R refresh heads;
    # a refresh head's programs only write its needed window entries. bitmap: the needed
    # entries come from the written bitmap (read, then set, per program's cache split).
    # has_hmask: a [Kh, G] query-head mask; a selected group with no head in it is idle
    # (no cache reads, nothing written), like a refresh head with nothing to write.
    # row_hmask: the mask is per batch row, [B, Kh, G]: each row attends with its own
    # heads, and its unselected heads output o = l = 0.
    it = iter(refs)
    qp_ref, kp_ref, vp_ref = next(it), next(it), next(it)
    if W:
        cur_ref = next(it)
        if bitmap:
            rv_ref, wbase_ref, need_ref = next(it), next(it), None
        else:
            need_ref = next(it)
        wslot_ref = next(it)
        wcos_ref, wsin_ref = (next(it), next(it)) if has_rope else (None, None)
    bq_ref = next(it) if has_bq else None
    bk_ref = next(it) if has_bk else None
    bv_ref = next(it) if has_bv else None
    cos_ref, sin_ref = (next(it), next(it)) if has_rope else (None, None)
    hidx_ref, pos_ref = next(it), next(it)
    mask_ref = next(it) if has_mask else None
    hm_ref = next(it) if has_hmask else None
    kc_ref, vc_ref = next(it), next(it)
    wr_ref = next(it) if W and bitmap else None   # the bitmap (aliased to wout_ref)
    o_ref, m_ref, l_ref, kout_ref, vout_ref = (next(it) for _ in range(5))
    wout_ref = next(it) if W and bitmap else None
    b = pl.program_id(0)
    g = pl.program_id(1)
    s = pl.program_id(2)
    hv = hidx_ref[g]                         # the KV head this program serves
    attend = g < Kh                          # False: a refresh head (window writes only)
    gq = jnp.minimum(g, Kh - 1)              # in-range query columns for every program
    pos = pos_ref[0]
    start = s * L
    end = jnp.minimum(start + L, pos)        # cache positions strictly before pos
    f32 = jnp.float32
    cols = jnp.arange(hdp, dtype=jnp.int32)
    cm = cols < hd
    half = hd // 2
    rcols = jnp.where(cols < half, cols + half, cols - half)   # rotate_half's source column
    sign = jnp.where(cols < half, -1.0, 1.0).astype(f32)
    jr = jnp.arange(Gp, dtype=jnp.int32)
    jm = jr < G
    vec = Gp == 1
    qrows = jm                               # the query heads computed in this group
    attends = attend                         # attends to the cache and writes pos
    def hm_at(group, col):   # the head mask at (group, col), of this row when per row
        return hm_ref.at[b, group, col] if row_hmask else hm_ref.at[group, col]

    if has_hmask:
        qrows = jm & (plgpu.load(hm_at(gq, jr), mask=jm, other=0) != 0)
        active = jnp.max(qrows.astype(jnp.int32)) > 0
        attends = attend & active

    # -- finish the projections: sum d-split partials, bias, rotary embedding ----------
    kv_b = b if not W else b * W + cur_ref[0]   # the current token's K/V partials' row

    def project(p_ref, b_ref, local0, bias0, rotary, one, row=b, heads=None):
        # one: a single head's vector [hdp]; else the group's query heads [Gp, hdp];
        # heads: the query heads to load (no mask: all G)
        def gathered(c):
            sel = c if one else jr[:, None] * hd + c[None, :]
            msk = cm if one else jm[:, None] & cm[None, :]
            if heads is not None:
                msk = msk & (jnp.max(heads.astype(jnp.int32)) > 0 if one else heads[:, None])
            t = None
            for k in range(nds):
                v = plgpu.load(p_ref.at[k, row, local0 + sel], mask=msk, other=0.0)
                t = v if t is None else t + v
            if b_ref is not None:
                t = t + plgpu.load(b_ref.at[bias0 + sel], mask=msk, other=0).astype(f32)
            return t
        t = gathered(cols)
        if rotary and has_rope:
            cs = plgpu.load(cos_ref.at[b, cols], mask=cm, other=0.0)
            sn = plgpu.load(sin_ref.at[b, cols], mask=cm, other=0.0)
            tr = gathered(rcols)
            if one:
                t = t * cs + tr * sign * sn
            else:
                t = t * cs[None, :] + tr * (sign * sn)[None, :]
        return t

    q_col, k_col, v_col = columns
    q = project(qp_ref, bq_ref, q_col + gq * (G * hd), hidx_ref[gq] * (G * hd), True, vec,
                heads=qrows if has_hmask else None) * scale
    kn = project(kp_ref, bk_ref, k_col + g * hd, hv * hd, True, True,
                 kv_b).astype(kout_ref.dtype)
    vn = project(vp_ref, bv_ref, v_col + g * hd, hv * hd, False, True,
                 kv_b).astype(vout_ref.dtype)

    # -- the window's needed entries in this split: finish, write, attend to ------------
    if W:
        jw = jnp.arange(Wp, dtype=jnp.int32)
        jwm = jw < W
        wslot = plgpu.load(wslot_ref.at[jw], mask=jwm, other=-1)
        S_ = kout_ref.shape[2]
        in_split = (wslot >= s * L) & (wslot < s * L + L) & (wslot < S_)
        if bitmap:
            # a refresh head also selected is left to its attending programs
            n_ids = hidx_ref.shape[0]
            if n_ids > Kh:
                kk = jnp.arange(next_pow2(Kh), dtype=jnp.int32)
                sel = plgpu.load(hidx_ref.at[kk], mask=kk < Kh, other=-1)
                if has_hmask:   # an idle selected group leaves its entries to the refresh
                    on = plgpu.load(hm_at(kk[:, None], jr[None, :]),
                                    mask=(kk < Kh)[:, None] & jm[None, :], other=0)
                    sel = jnp.where(jnp.max(on, axis=1) != 0, sel, -1)
                dup = jnp.logical_not(attend) & (jnp.max((sel == hv).astype(jnp.int32)) > 0)
                own = jwm & in_split & jnp.logical_not(dup)
            else:
                own = jwm & in_split
            brow = wbase_ref[0] + hv
            held = plgpu.load(wr_ref.at[b, brow, jnp.maximum(wslot, 0)], mask=own,
                              other=1).astype(jnp.int32)
            valid_row = plgpu.load(rv_ref.at[b, jw], mask=jwm, other=0)
            wneed = own & (held == 0) & (valid_row != 0)
        else:
            wneed = (plgpu.load(need_ref.at[b, g, jw], mask=jwm, other=0) != 0) & in_split
        if has_hmask:   # an idle selected group writes nothing
            wneed = wneed & (attends | jnp.logical_not(attend))
        # the current token of a selected head is written below, with its attention
        wwrite = wneed & ~((wslot == pos) & attends)
        wrows = b * W + jw
        wm = wneed[:, None] & cm[None, :]      # rows not needed may hold no partials

        def window_rows(p_ref, b_ref, rotary):       # [Wp, hdp] finished K or V rows
            def gathered(c):
                t = None
                for k in range(nds):
                    v = plgpu.load(p_ref.at[k, wrows[:, None], g * hd + c[None, :]],
                                   mask=wm, other=0.0)
                    t = v if t is None else t + v
                if b_ref is not None:
                    t = t + plgpu.load(b_ref.at[hv * hd + c], mask=cm,
                                       other=0).astype(f32)[None, :]
                return t
            t = gathered(cols)
            if rotary and has_rope:
                cs = plgpu.load(wcos_ref.at[b, jw[:, None], cols[None, :]], mask=wm, other=0.0)
                sn = plgpu.load(wsin_ref.at[b, jw[:, None], cols[None, :]], mask=wm, other=0.0)
                t = t * cs + gathered(rcols) * sign[None, :] * sn
            return t

        kw = window_rows(kp_ref, bk_ref, True).astype(kout_ref.dtype)
        vw = window_rows(vp_ref, bv_ref, False).astype(vout_ref.dtype)
        wst = wwrite[:, None] & cm[None, :]
        # masked-off lanes aim at a slot outside the window: the Pallas interpreter writes
        # them back, and a repeated window slot (clamped early steps) must not be clobbered.
        # With a cache no longer than the window there is none once pos = S - 1; then the
        # interpreter (only it: the GPU stores no masked lane) may lose that slot's write.
        spare = jnp.where(pos >= W, pos - W, jnp.minimum(pos + 1, S_ - 1))
        wdst = jnp.where(wwrite, wslot, spare)
        plgpu.store(kout_ref.at[b, hv, wdst[:, None], cols[None, :]], kw, mask=wst)
        plgpu.store(vout_ref.at[b, hv, wdst[:, None], cols[None, :]], vw, mask=wst)
        if bitmap:   # every needed entry of this split is now held (pos: written below)
            plgpu.store(wout_ref.at[b, brow, jnp.where(wneed, wslot, spare)],
                        jnp.ones((Wp,), wout_ref.dtype), mask=wneed)

    # -- online softmax over this program's split of the cache ------------------------
    def scores_of(k):  # k [n, hdp] -> [n] or [Gp, n]
        if vec:
            return soft_cap(jnp.sum(k.astype(f32) * q[None, :], axis=1), softcap)
        return soft_cap(mma(q, k, trans_b=True), softcap)

    def pv(p, v):  # p [n] or [Gp, n], v [n, hdp] -> [hdp] or [Gp, hdp]
        if vec:
            return jnp.sum(p[:, None] * v.astype(f32), axis=0)
        return mma(p, v)

    def online(carry, sc, keep, v):
        """The (o, m, l) online softmax after entries with scores sc, values v, where keep."""
        o, m, l = carry
        kb = keep if vec else keep[None, :]
        sc = jnp.where(kb, sc, NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(kb, jnp.exp(sc - (m_new if vec else m_new[:, None])), 0.0)
        l = l * corr + jnp.sum(p, axis=-1)
        return o * (corr if vec else corr[:, None]) + pv(p, v), m_new, l

    def body(t, carry):
        pp = start + t * bs + jnp.arange(bs, dtype=jnp.int32)
        valid = pp < end
        if has_mask:
            valid = valid & (plgpu.load(mask_ref.at[b, pp], mask=valid, other=0) != 0)
        if W:   # entries this program rewrites: read from the window below, not the cache
            rewritten = (pp[:, None] == wslot[None, :]) & wwrite[None, :]
            valid = valid & (jnp.max(rewritten.astype(jnp.int32), axis=1) == 0)
        ld = valid[:, None] & cm[None, :]
        k = plgpu.load(kc_ref.at[b, hv, pp[:, None], cols[None, :]], mask=ld, other=0)
        v = plgpu.load(vc_ref.at[b, hv, pp[:, None], cols[None, :]], mask=ld, other=0)
        return online(carry, scores_of(k), valid, v)

    shape = () if vec else (Gp,)
    carry = (jnp.zeros(shape + (hdp,), f32), jnp.full(shape, NEG, f32), jnp.zeros(shape, f32))
    n_it = (jnp.maximum(end - start, 0) + bs - 1) // bs
    n_it = jnp.where(attends, n_it, 0)
    o, m, l = lax.fori_loop(0, n_it, body, carry)
    if W:   # fold in the rewritten entries before pos, at cache precision
        wuse = wwrite & (wslot < pos)
        if has_mask:
            wuse = wuse & (plgpu.load(mask_ref.at[b, jnp.maximum(wslot, 0)], mask=wuse,
                                      other=0) != 0)
        o, m, l = online((o, m, l), scores_of(kw), wuse, vw)

    # -- the program whose split holds `pos` folds in the current token, writes k/v ----
    mine = pos // L == s
    knf = kn.astype(f32)
    sc = soft_cap(jnp.sum(knf * q) if vec else jnp.sum(q * knf[None, :], axis=1), softcap)
    m_new = jnp.where(mine, jnp.maximum(m, sc), m)
    corr = jnp.exp(m - m_new)
    p = jnp.where(mine, jnp.exp(sc - m_new), 0.0)
    l = l * corr + p
    if vec:
        o = o * corr + p * vn.astype(f32)
    else:
        o = o * corr[:, None] + p[:, None] * vn.astype(f32)[None, :]
    m = m_new

    @pl.when(mine & attends)
    def _():
        plgpu.store(kout_ref.at[b, hv, pos, cols], kn, mask=cm)
        plgpu.store(vout_ref.at[b, hv, pos, cols], vn, mask=cm)

    if row_hmask:   # this row's unselected heads add nothing
        if vec:
            o, l = jnp.where(attends, o, 0.0), jnp.where(attends, l, 0.0)
        else:
            on = qrows & attends
            o, l = jnp.where(on[:, None], o, 0.0), jnp.where(on, l, 0.0)

    @pl.when(attend)
    def _():
        if vec:
            plgpu.store(o_ref.at[s, b, g, cols], o, mask=cm)
            m_ref[s, b, g] = m
            l_ref[s, b, g] = l
        else:
            rows = g * G + jr
            plgpu.store(o_ref.at[s, b, rows[:, None], cols[None, :]], o,
                        mask=jm[:, None] & cm[None, :])
            plgpu.store(m_ref.at[s, b, rows], m, mask=jm)
            plgpu.store(l_ref.at[s, b, rows], l, mask=jm)


def decode_attention(qp, kp, vp, head_idx, pos, k_cache, v_cache, *, group, bq=None, bk=None,
                     bv=None, cos=None, sin=None, kv_mask=None, block_s=64, seq_splits=None,
                     target_programs=None, num_warps=4, batch=None,
                     window: KVWindow | None = None, interpret=False, scale=None,
                     head_mask=None, softcap=None, columns=(0, 0, 0)):
    """Flash-decoding over the selected KV heads, writing the new k/v rows in place.

    Args:
      qp, kp, vp: fp32 projection partials ``[nds, B, R]`` (as :func:`gather_matvec`
        returns them for the q/k/v segments: rows group-major over the selected heads).
      head_idx: ``[Kh]`` int32 KV heads; pos: ``[1]`` int32; caches ``[B, n_kv, S, hd]``.
      group: query heads per KV head.
      bq, bk, bv: optional flat biases ``[H*hd]`` / ``[n_kv*hd]``.
      cos, sin: optional ``[B, hd]`` fp32 rotary tables for the current position.
      kv_mask: optional ``[B, S]`` int32 (nonzero = attend).
      batch: rows B to attend for (default: q's partials' row count).
      scale: the attention logits' scale (default ``hd ** -0.5``).
      softcap: the scaled logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
      columns: where q's, k's and v's rows start among the partials' columns, so that
        one array of every head's q, k and v (in that order) may be passed three times.
      head_mask: optional ``[Kh, group]`` query heads to compute (see
        :func:`head_sparse_attention`): a group with none reads and writes no cache entry;
        the other heads' outputs are left for the out-projection to skip. Per row,
        ``[B, Kh, group]``: the same for each row on its own, and a row's unselected
        heads output ``o = l = 0``.
      window: the missing-KV window whose K/V were projected into ``kp``/``vp`` (rows
        ``b * W + j`` for window row j, columns ``window_heads(head_idx, window)``; its
        ``x`` is not read). Its needed entries are finished (bias, rotary), written to the
        caches and attended to here, and the current token's K/V come from row
        ``b * W + window.current``; the refresh heads get writes, no attention. Only
        those rows are read: the others may hold no partials (see
        :func:`window_past_flags`).
    Returns:
      ``(o [ns, B, Kh*G, hd], m [ns, B, Kh*G], l [ns, B, Kh*G], k_cache, v_cache)``:
      unnormalised split partials (normalised by :func:`merged_attention_loader` when
      there is one split, else merged by :func:`merge_splits`) and the caches; and the
      updated bitmap when the window has one.
    """
    nds, B, _ = qp.shape
    B = batch or B
    Kh = head_idx.shape[0]
    ids = head_idx if window is None else window_heads(head_idx, window)
    W = 0 if window is None else window.slots.shape[0]
    bitmap = window is not None and window.written is not None
    G = group
    Hs = Kh * G
    S, hd = k_cache.shape[2], k_cache.shape[3]
    bs = min(block_s, max(16, next_pow2(S)))
    if seq_splits is None:
        seq_splits = max(1, min(cdiv(S, bs), cdiv(target_programs or 8 * sm_count(), B * Kh)))
    L = cdiv(cdiv(S, seq_splits), bs) * bs
    ns = cdiv(S, L)
    Gp = 1 if G == 1 else max(16, next_pow2(G))
    kernel = functools.partial(
        _decode_attention_kernel, nds=nds, has_bq=bq is not None, has_bk=bk is not None,
        has_bv=bv is not None, has_rope=cos is not None, has_mask=kv_mask is not None, G=G,
        Gp=Gp, hd=hd, hdp=next_pow2(hd), L=L, bs=bs,
        scale=float(hd) ** -0.5 if scale is None else float(scale), Kh=Kh, W=W,
        Wp=max(16, next_pow2(W)), bitmap=bitmap, has_hmask=head_mask is not None,
        row_hmask=head_mask is not None and head_mask.ndim == 3,
        softcap=None if softcap is None else float(softcap),
        columns=tuple(int(c) for c in columns))
    if window is not None and any(columns):
        raise ValueError("a missing-KV window's K/V partials start at column 0")
    args = [qp, kp, vp]
    if window is not None:
        args.append(jnp.asarray(window.current, jnp.int32).reshape(1))
        if bitmap:
            args += [window.row_valid.astype(jnp.int32),
                     jnp.asarray(window.written_base, jnp.int32).reshape(1)]
        else:
            args.append(window.need.astype(jnp.int32))
        args.append(window.slots.astype(jnp.int32))
        if cos is not None:
            args += [window.cos.astype(jnp.float32), window.sin.astype(jnp.float32)]
    args += [t for t in (bq, bk, bv, cos, sin) if t is not None]
    args += [ids.astype(jnp.int32), pos] + ([kv_mask] if kv_mask is not None else [])
    if head_mask is not None:
        args.append(head_mask.astype(jnp.int32))
    n_in = len(args)
    args += [k_cache, v_cache]
    out_shape = (jax.ShapeDtypeStruct((ns, B, Hs, hd), jnp.float32),
                 jax.ShapeDtypeStruct((ns, B, Hs), jnp.float32),
                 jax.ShapeDtypeStruct((ns, B, Hs), jnp.float32),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    aliases = {n_in: 3, n_in + 1: 4}
    if bitmap:
        args.append(window.written)
        out_shape += (jax.ShapeDtypeStruct(window.written.shape, window.written.dtype),)
        aliases[n_in + 2] = 5
    return pl.pallas_call(
        kernel,
        grid=(B, ids.shape[0], ns),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="head_sparse_decode_attention",
    )(*args)


def _attention_core_reference(q, k_cache, v_cache, pos, kv_mask=None, softcap=None):
    """fp32 softmax attention of queries ``q [B, n, G, hd]`` (scaled) over caches
    ``[B, n, S, hd]``: slots up to ``pos``, those before it where ``kv_mask`` allows;
    ``[B, n, G, hd]``. Unattended slots are zeroed first: they may hold anything. With
    ``softcap`` the logits become ``softcap * tanh(logits / softcap)``."""
    f32 = jnp.float32
    hi = lax.Precision.HIGHEST
    B, S = k_cache.shape[0], k_cache.shape[2]
    positions = jnp.arange(S)
    valid = jnp.broadcast_to(positions <= pos, (B, S))
    if kv_mask is not None:
        valid = valid & (kv_mask.astype(bool) | (positions == pos)[None])
    keep = valid[:, None, :, None]
    kc = jnp.where(keep, k_cache.astype(f32), 0.0)
    vc = jnp.where(keep, v_cache.astype(f32), 0.0)
    s = jnp.einsum("bgjk,bgsk->bgjs", q.astype(f32), kc, precision=hi)
    s = soft_cap(s, softcap)
    p = jax.nn.softmax(jnp.where(valid[:, None, None, :], s, -jnp.inf), axis=-1)
    return jnp.einsum("bgjs,bgsk->bgjk", p, vc, precision=hi)


def row_head_attention_reference(q, k_cache, v_cache, pos, head_mask, kv_mask=None,
                                 group_ids=None, softcap=None):
    """jnp reference of :func:`row_head_attention` (fp32)."""
    B, H, hd = q.shape
    if group_ids is not None:
        k_cache, v_cache = k_cache[:, group_ids], v_cache[:, group_ids]
    n_kv = k_cache.shape[1]
    o = _attention_core_reference(q.reshape(B, n_kv, H // n_kv, hd), k_cache, v_cache, pos,
                                  kv_mask, softcap)
    return jnp.where(head_mask.astype(bool)[..., None], o, 0.0).reshape(B, H, hd)


def row_head_attention(q, k_cache, v_cache, pos, head_mask, *, kv_mask=None, group_ids=None,
                       softcap=None, impl: str | None = None,
                       config: AttnConfig | None = None):
    """Each batch row's attention over its own query heads, for queries already projected:
    the attention core of a batch whose projections run dense (every head's K/V of this
    token already written at ``pos``).

    Args:
      q: ``[B, H, hd]`` queries, already scaled (and rotated, normed).
      k_cache, v_cache: ``[B, n_kv, S, hd]`` holding this token's K/V at ``pos``.
      pos: int32 scalar, the current slot (attended to together with the valid ones before).
      head_mask: ``[B, n_kv, G]`` bool (``G = H // n_kv``): the query heads each row
        computes. A row reads the cache of the groups holding one of its heads only.
      kv_mask: optional ``[B, S]`` validity of the slots before ``pos``.
      group_ids: optional ``[n_kv]`` int32: the caches' groups the query heads use, when
        the caches hold more (stacked layers: ``layer * n_kv + arange(n_kv)``).
      softcap: the logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    Returns:
      ``(out [B, H, hd] fp32, k_cache, v_cache)``: softmax(q kᵀ) v for each row's selected
      heads, 0 for the others; the caches as given (the Pallas kernel rewrites the entries
      at ``pos`` in place: pass them donated under jit).
    """
    check_array("q", q, ndim=3, floating=True)
    B, H, hd = q.shape
    check_array("k_cache", k_cache, ndim=4, floating=True)
    n_kv = k_cache.shape[1] if group_ids is None else group_ids.shape[0]
    if k_cache.shape[0] != B or k_cache.shape[3] != hd or H % n_kv:
        raise ValueError(f"k_cache must be [B, n_kv, S, hd] = [{B}, n_kv, S, {hd}] with n_kv "
                         f"dividing {H}, got {tuple(k_cache.shape)}")
    check_array("v_cache", v_cache, shape=k_cache.shape, floating=True)
    check_array("head_mask", head_mask, shape=(B, n_kv, H // n_kv))
    if group_ids is not None:
        check_indices("group_ids", group_ids, k_cache.shape[1])
    if kv_mask is not None:
        check_array("kv_mask", kv_mask, shape=(B, k_cache.shape[2]))
    return _row_head_attention_jit(q, k_cache, v_cache, jnp.asarray(pos, jnp.int32).reshape(()),
                                   jnp.asarray(head_mask, bool), kv_mask, group_ids,
                                   softcap=None if softcap is None else float(softcap),
                                   impl=resolve_impl(impl), config=config)


@functools.partial(jax.jit, static_argnames=("softcap", "impl", "config"))
def _row_head_attention_jit(q, k_cache, v_cache, pos, head_mask, kv_mask, group_ids, *,
                            softcap, impl, config):
    if impl == "reference":
        return (row_head_attention_reference(q, k_cache, v_cache, pos, head_mask, kv_mask,
                                             group_ids, softcap), k_cache, v_cache)
    cfg = config or AttnConfig()
    B, H, hd = q.shape
    n_kv = head_mask.shape[1]
    ids = (jnp.arange(n_kv, dtype=jnp.int32) if group_ids is None
           else group_ids.astype(jnp.int32))
    # the current token's K/V as one-split "partials" of the whole groups, read back from
    # the cache (the kernel writes them again where a row attends: the same values)
    cur_k = k_cache[:, ids, pos]
    cur_v = v_cache[:, ids, pos]
    f32 = jnp.float32
    o, m, l, k_cache, v_cache = decode_attention(
        q.astype(f32).reshape(1, B, H * hd), cur_k.astype(f32).reshape(1, B, n_kv * hd),
        cur_v.astype(f32).reshape(1, B, n_kv * hd), ids,
        pos.reshape(1), k_cache, v_cache, group=H // n_kv,
        kv_mask=None if kv_mask is None else kv_mask.astype(jnp.int32),
        block_s=cfg.block_s, seq_splits=cfg.seq_splits,
        target_programs=cfg.attn_target_programs or 4 * sm_count(),
        num_warps=cfg.attn_num_warps, batch=B, interpret=impl == "interpret", scale=1.0,
        head_mask=head_mask, softcap=softcap)
    return merge_splits(o, m, l).reshape(B, H, hd), k_cache, v_cache


def merge_splits(o, m, l):
    """Merge flash-decoding split partials into normalised attention ``[B, Hs, hd]``."""
    mx = jnp.max(m, axis=0)
    w = jnp.exp(m - mx[None])
    den = (l * w).sum(0)
    # a row's unselected head (per-row head masks) has o = l = 0 in every split: 0
    return (o * w[..., None]).sum(0) / jnp.where(den > 0, den, 1.0)[..., None]


def merged_attention_loader(act_refs, r, valid, rows, *, ns, B, Bp, hd):
    """Out-projection activation loader: the normalised attention at logical rows ``r``.

    Logical row r is column ``r % hd`` of selected query head ``r // hd``. With ``ns ==
    0`` ``act_refs`` = (attn ``[1, B, Hs*hd]``,), already merged (:func:`merge_splits`);
    with ``ns == 1`` ``act_refs`` = (o ``[1, B, Hs*hd]``, l ``[1, B, Hs]``), the one
    split's partials, divided by ``l`` here.
    """
    if ns not in (0, 1):
        raise ValueError(f"ns={ns}: several splits are merged by merge_splits first")
    brow = jnp.arange(Bp, dtype=jnp.int32)
    if Bp == 1:
        def ld(ref, idx, other):
            return plgpu.load(ref.at[0, 0, idx], mask=valid, other=other)
    else:
        msk = (brow < B)[:, None] & valid[None, :]

        def ld(ref, idx, other):
            return plgpu.load(ref.at[0, brow[:, None], idx[None, :]], mask=msk, other=other)
    if ns == 0:
        return ld(act_refs[0], r, 0.0)
    o_ref, l_ref = act_refs
    tl = ld(l_ref, r // hd, 0.0)
    a = ld(o_ref, r, 0.0) / jnp.where(tl > 0, tl, 1.0)
    return jnp.where(valid if Bp == 1 else valid[None, :], a, 0.0)


# ----------------------------------------------------------------------------
# Pallas pipeline and public entry point
# ----------------------------------------------------------------------------

def head_sparse_attention_pallas(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos,
                                 head_idx, *, rope=None, kv_mask=None, interpret=False,
                                 config: AttnConfig | None = None,
                                 window: KVWindow | None = None, extra_segments=(),
                                 residual=None, qk_norm=None, norm_eps: float = 1e-6,
                                 scale=None, head_mask=None, softcap=None):
    """Pallas path of :func:`head_sparse_attention` (no validation).

    Three Pallas launches (q/k/v projection, attention, out-projection), plus an XLA merge
    of the attention's sequence splits when there are several; with
    a callable ``rope`` or with ``qk_norm`` the q/k finishing (sums of the partials,
    biases, norms, rotary embedding; for a window's rows too) runs in XLA instead. With a
    ``window``, the projection's K/V segments multiply the window's inputs (the extra
    heads' rows included) and the attention launch writes and attends to the needed
    entries: the missing-KV recomputation reads no weight twice and adds no launch.
    With a ``head_mask`` the q segment and the out-projection take one id per query head,
    masked (:class:`~.gather_matvec.Segment` ``mask``, ``gather_cols_matvec``'s
    ``id_mask``), and the K/V segments skip the idle groups.
    """
    cfg = config or AttnConfig()
    f32 = jnp.float32
    B, d = x.shape
    H, hd, _ = wq.shape
    n_kv = wk.shape[0]
    G = H // n_kv
    Kh = head_idx.shape[0]
    head_idx = head_idx.astype(jnp.int32)
    pos = jnp.asarray(pos, jnp.int32).reshape(1)
    # columns per load: an x tile of at most 8192 elements, for x's rows and, narrower
    # where they are many more, for the window's
    def tile_d(rows):
        return min(cfg.proj_block_d, 1 << (d.bit_length() - 1), max(32, 8192 // batch_pad(rows)))

    bd = tile_d(B)
    kv_ids, x_rows, kv_opts = head_idx, x, {}
    if window is not None:
        # K/V read the window's rows (the current token's among them); q keeps x's rows
        kv_ids = window_heads(head_idx, window)
        W = window.slots.shape[0]
        R = window.x.shape[1]
        x_rows = window.x.reshape(B * R, d).astype(x.dtype)
        kv_opts = dict(block_rows=cfg.window_block_rows, block_d=min(bd, tile_d(B * W)))
        if window.x_row0 is not None:   # the window's rows read in place among x's
            kv_opts.update(x_row0=jnp.asarray(window.x_row0, jnp.int32).reshape(1),
                           x_span=(W, R))
        if batch_pad(B) > 1:
            # a batch's window is many rows: multiply the earlier ones only for heads
            # that miss some entry there (one XLA fusion finds them)
            kv_opts.update(window=W, current=window.current,
                           past_flags=window_past_flags(window, kv_ids))
    q_seg = Segment(wq.reshape(H * hd, d), head_idx, G * hd)
    union_mask = union_head_mask(head_mask)   # the weights: read once, for every row
    if head_mask is not None:   # one masked id per query head; idle groups' K/V skipped
        q_seg = Segment(wq.reshape(H * hd, d), _query_heads(head_idx, G), hd,
                        mask=union_mask.reshape(-1))
        kv_opts = dict(kv_opts, mask=jnp.concatenate(
            [_active_groups(union_mask, Kh), jnp.ones((kv_ids.shape[0] - Kh,), bool)]))
    segs = [q_seg,
            Segment(wk.reshape(n_kv * hd, d), kv_ids, hd, x=x_rows, **kv_opts),
            Segment(wv.reshape(n_kv * hd, d), kv_ids, hd, x=x_rows, **kv_opts)]
    bk_rows = cfg.proj_block_rows if batch_pad(B) == 1 else max(16, cfg.proj_block_rows)
    chunks = cfg.proj_d_chunks
    if chunks is None:
        tiles = cdiv(Kh * G * hd + 2 * kv_ids.shape[0] * hd, bk_rows) * cdiv(d, bd)
        chunks = balanced_chunks(cdiv(d, bd), tiles // (cfg.target_programs or 8 * sm_count()))
    qp, kp, vp, *extras = gather_matvec(
        x, segs + list(extra_segments), block_rows=bk_rows, block_d=bd, d_chunks=chunks,
        num_warps=cfg.num_warps, num_stages=cfg.stages(B), interpret=interpret,
        evict_first=cfg.evict_first)
    flat = lambda t: None if t is None else t.reshape(-1)
    biases = dict(bq=flat(bq), bk=flat(bk), bv=flat(bv))
    cos = sin = None
    if callable(rope):
        # finish q/k/v in XLA (the callable cannot run inside the kernel)
        def finish(parts, n, bias, ids):
            t = parts.sum(0)[:, : n * hd].reshape(B, n, hd)
            return t if bias is None else t + bias[ids].astype(f32)[None]
        hq = _query_heads(head_idx, G)
        qp = apply_rope(finish(qp, Kh * G, bq, hq), rope).reshape(1, B, -1)
        kp = apply_rope(finish(kp, Kh, bk, head_idx), rope).reshape(1, B, -1)
        vp = finish(vp, Kh, bv, head_idx).reshape(1, B, -1)
        biases = dict(bq=None, bk=None, bv=None)
    elif qk_norm is not None:
        # per-head RMS norms before the rotary embedding: finished here, for the current
        # token and, with a window, for every window row (rotated at its own position)
        def finish(parts, n, bias, ids, rows, weight, tables):
            t = parts.sum(0)[:rows, : n * hd].reshape(rows, n, hd)
            t = t if bias is None else t + bias[ids].astype(f32)[None]
            t = head_norm(t, weight, norm_eps)
            return (t if tables is None else apply_rope(t, tables)).reshape(1, rows, n * hd)
        tables = None if rope is None else tuple(
            jnp.broadcast_to(jnp.asarray(t, f32), (B, hd)) for t in rope)
        kv_rows, kv_tables = B, tables
        if window is not None:
            kv_rows = B * W
            kv_tables = None if window.cos is None else (
                window.cos.reshape(kv_rows, hd), window.sin.reshape(kv_rows, hd))
        n_kv_ids = kv_ids.shape[0]
        qp = finish(qp, Kh * G, bq, _query_heads(head_idx, G), B, qk_norm[0], tables)
        kp = finish(kp, n_kv_ids, bk, kv_ids, kv_rows, qk_norm[1], kv_tables)
        vp = finish(vp, n_kv_ids, bv, kv_ids, kv_rows, None, None)
        biases = dict(bq=None, bk=None, bv=None)
    elif rope is not None:
        cos, sin = (jnp.broadcast_to(jnp.asarray(t, f32), (B, hd)) for t in rope)
    mask = None if kv_mask is None else kv_mask.astype(jnp.int32)
    o, m, l, k_cache, v_cache, *written = decode_attention(
        qp, kp, vp, head_idx, pos, k_cache, v_cache, group=G, cos=cos, sin=sin,
        kv_mask=mask, block_s=cfg.block_s, seq_splits=cfg.seq_splits,
        target_programs=cfg.attn_target_programs or 4 * sm_count(),
        num_warps=cfg.attn_num_warps, batch=B, window=window, interpret=interpret,
        scale=scale, head_mask=head_mask, softcap=softcap, **biases)

    ns = o.shape[0]
    if ns > 1:
        # several splits: merging them inside every out-projection program cost more than
        # one small XLA fusion
        act_args, ns = [merge_splits(o, m, l).reshape(1, B, Kh * G * hd)], 0
    else:
        act_args = [o.reshape(1, B, Kh * G * hd), l]
    load_act = functools.partial(merged_attention_loader, ns=ns, B=B, Bp=batch_pad(B), hd=hd)
    out_cols = min(cfg.out_block_d, next_pow2(Kh * G * hd))
    out_ids, per_id, id_mask = head_idx, G * hd, None
    if head_mask is not None:   # the selected query heads' columns only
        out_ids, per_id, id_mask = _query_heads(head_idx, G), hd, union_mask.reshape(-1)
    out = gather_cols_matvec(act_args, load_act, wo.reshape(wo.shape[0], -1), out_ids, B=B,
                             cols_per_id=per_id, layers=H // wo.shape[1],
                             block_rows=cfg.out_block_rows or (8 if B == 1 else 32),
                             block_cols=out_cols,
                             num_warps=cfg.out_num_warps or cfg.num_warps,
                             num_stages=cfg.stages(B),
                             residual=residual, bias=bo,
                             group_view=per_id <= out_cols and is_pow2(per_id),
                             id_mask=id_mask, interpret=interpret,
                             evict_first=cfg.evict_first)
    if residual is None:
        out = out.astype(x.dtype)
    return ((out, k_cache, v_cache) + tuple(written)
            + ((tuple(extras),) if extra_segments else ()))


@functools.partial(jax.jit, static_argnames=("impl", "config", "rope_fn", "norm_eps",
                                             "scale", "softcap"))
def _attn_jit(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx, rope_arr,
              kv_mask, window, extra_segments, residual, qk_norm, head_mask, *, impl, config,
              rope_fn, norm_eps, scale, softcap):
    rope = rope_fn if rope_fn is not None else rope_arr
    norms = dict(qk_norm=qk_norm, norm_eps=norm_eps, scale=scale, head_mask=head_mask,
                 softcap=softcap)
    if impl == "reference":
        out, *rest = head_sparse_attention_reference(
            x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx, rope=rope,
            kv_mask=kv_mask, window=window,
            out_dtype=None if residual is None else jnp.float32, **norms)
        if residual is not None:
            out = residual + out
        extras = tuple(segment_reference(seg, x) for seg in extra_segments)
        return (out, *rest) + ((extras,) if extra_segments else ())
    return head_sparse_attention_pallas(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache,
                                        pos, head_idx, rope=rope, kv_mask=kv_mask,
                                        interpret=impl == "interpret", config=config,
                                        window=window, extra_segments=tuple(extra_segments),
                                        residual=residual, **norms)


def _validate_window(window, x, k_cache, head_idx, rope):
    if not isinstance(window, KVWindow):
        raise TypeError(f"window must be a KVWindow, got {type(window).__name__}")
    if callable(rope):
        raise ValueError("a window needs the rotary embedding as (cos, sin) tables: a "
                         "callable rope cannot rotate the window's keys")
    if (rope is None) != (window.cos is None):
        raise ValueError("window.cos/sin must be given exactly when rope is: the window's "
                         "keys take the same rotary embedding at their own positions")
    B, d = x.shape
    hd = k_cache.shape[3]
    check_array("window.x", window.x, ndim=3, floating=True)
    if window.x.shape[0] != B or window.x.shape[2] != d:
        raise ValueError(f"window.x must be [B, W, d] = [{B}, W, {d}], got "
                         f"{tuple(window.x.shape)}")
    W = window.x.shape[1]
    if window.x_row0 is not None:   # x holds more rows; the window is the slots' length
        W = window.slots.shape[0]
        check_array("window.x_row0", window.x_row0, shape=())
        if W > window.x.shape[1]:
            raise ValueError(f"window.x has {window.x.shape[1]} rows per batch row, fewer "
                             f"than the window's {W}")
    check_array("window.current", window.current, shape=())
    if not jnp.issubdtype(window.current.dtype, jnp.integer):
        raise TypeError(f"window.current must be an integer scalar, got {window.current.dtype}")
    for name, value, upper in (("window.current", window.current, W),
                               ("window.slots", window.slots, k_cache.shape[2])):
        if not isinstance(value, jax.core.Tracer):
            v = np.asarray(value)
            if v.size and (v.min() < 0 or v.max() >= upper):
                raise ValueError(f"{name} must lie in [0, {upper}), got {v.tolist()}")
    n = head_idx.shape[0]
    if window.extra_ids is not None:
        check_indices("window.extra_ids", window.extra_ids, k_cache.shape[1])
        n += window.extra_ids.shape[0]
    if (window.need is None) == (window.written is None):
        raise ValueError("give window.need or window.written (the bitmap), exactly one")
    if window.need is not None:
        check_array("window.need", window.need, shape=(B, n, W))
    else:
        check_array("window.written", window.written, ndim=3)
        if window.written.shape[0] != B or window.written.shape[2] != k_cache.shape[2]:
            raise ValueError(f"window.written must be [B, N, S] = [{B}, N, "
                             f"{k_cache.shape[2]}], got {tuple(window.written.shape)}")
        if window.written.dtype != jnp.bool_:
            raise TypeError(f"window.written must be bool, got {window.written.dtype}")
        if window.row_valid is None or window.written_base is None:
            raise ValueError("a bitmap window needs row_valid and written_base")
        check_array("window.row_valid", window.row_valid, shape=(B, W))
        check_array("window.written_base", window.written_base, shape=())
    check_array("window.slots", window.slots, shape=(W,))
    if (window.cos is None) != (window.sin is None):
        raise ValueError("window.cos and window.sin must be given together")
    if window.cos is not None:
        check_array("window.cos", window.cos, shape=(B, W, hd))
        check_array("window.sin", window.sin, shape=(B, W, hd))


def head_sparse_attention(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx,
                          *, head_mask=None, rope=None, kv_mask=None, impl: str | None = None,
                          config: AttnConfig | None = None, window: KVWindow | None = None,
                          residual=None, extra_segments=(), qk_norm=None,
                          norm_eps: float = 1e-6, scale: float | None = None,
                          softcap: float | None = None):
    """One decode step of attention over the selected heads only.

    Args:
      x: ``[B, d]`` layer-normed input of the current token.
      wq: ``[H, hd, d]`` per-head query weights; wo: ``[d, H, hd]`` the out-projection
        (HF's ``out_proj.weight`` as stored, its columns viewed per head). Stacked
        layers: wq..bv hold ``L`` layers' heads (ids ``layer * n_kv/L + local``) and wo is
        ``[L * d, H / L, hd]`` (a free reshape of ``[L, d, H/L, hd]``).
      wk, wv: ``[n_kv, hd, d]`` (``n_kv == H`` for multi-head attention).
      bq: ``[H, hd]`` or None; bk, bv: ``[n_kv, hd]`` or None; bo: ``[d]`` or None.
      k_cache, v_cache: ``[B, n_kv, S, hd]``; only the selected heads' rows at ``pos`` are
        written (pass them donated under jit to update in place).
      pos: int32 scalar (may be traced): index of the current token.
      head_idx: ``[Kh]`` int32 distinct KV-head ids (= head ids when ``n_kv == H``).
      head_mask: optional ``[Kh, G]`` bool (``G = H // n_kv``): query head ``j`` of group
        ``head_idx[i]`` (query head ``head_idx[i] * G + j``) is computed where
        ``head_mask[i, j]``; None computes all G. An unselected query head's q rows and
        out-projection columns are not read; a group with no selected head is skipped
        (no K/V weights or cache read, no K/V written, window entries included: a
        refresh in ``window.extra_ids`` still writes its own). Made from a query-head
        selection by :func:`query_head_groups`. Per row, ``[B, Kh, G]``: each row
        attends with its own query heads, reading and writing only their groups' cache
        entries (an entry a row skips stays missing for that row), while the weights are
        read once for the heads some row computes.
      rope: optional rotary embedding for the current position: a callable mapping
        ``[B, n, hd]`` fp32 to the same shape, or ``(cos, sin)`` of shape ``[hd]`` or
        ``[B, hd]`` applied HF-Llama style (``t*cos + rotate_half(t)*sin``) to q and k.
      kv_mask: optional ``[B, S]`` key-validity mask (e.g. left padding); the current
        position is always attended.
      impl: None (auto), "pallas", "interpret" or "reference".
      config: optional :class:`AttnConfig` (Pallas paths only).
      window: optional :class:`KVWindow`: before attending, recompute K/V of the window's
        tokens for ``head_idx`` and ``window.extra_ids`` from their stored inputs and
        write the entries ``window.need`` marks (missing-KV recomputation). On the
        Pallas path this rides on the projection launch, reading each weight row once.
      residual: optional fp32 ``[B, d]`` rows to add the output to (a pre-norm layer's
        residual stream), in the out-projection's launch (updated in place when donated).
      extra_segments: :class:`~.gather_matvec.Segment` s multiplied in the projection
        launch besides q/k/v (each with its own ``x`` or the call's): a GEMV that rides
        on a launch the step makes anyway.
      qk_norm: optional ``(q_weight [hd], k_weight [hd])``: RMSNorm (epsilon ``norm_eps``)
        over each query and key head after the biases, before the rotary embedding
        (Gemma 3; the window's keys too). On the Pallas path q/k/v are then finished in
        XLA between the projection and attention launches.
      scale: the attention logits' scale (default ``hd ** -0.5``).
      softcap: the scaled logits become ``softcap * tanh(logits / softcap)`` before the
        softmax (Gemma 2); None leaves them.
    Returns:
      ``(out [B, d] in x.dtype, k_cache, v_cache)``: ``out = sum over selected query
      heads of softmax(scale q kᵀ) v @ wo[h] + bo`` (q, k after their norms and rotary
      embedding; the selected query heads: every head of the selected groups, or those
      of ``head_mask``); unselected heads add 0. With
      ``residual``, ``out`` is ``residual + out`` in fp32. With a bitmap window
      (``window.written``) the next item is the updated bitmap. With ``extra_segments``
      a last item: one fp32 ``[P_s, B_s, R_s]`` per segment whose sum over axis 0 holds
      ``x_s @ W_s[rows]ᵀ`` in its first ``Segment.n_rows`` columns.
    """
    _validate(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx, rope,
              kv_mask, head_mask)
    if window is not None:
        _validate_window(window, x, k_cache, head_idx, rope)
    impl = resolve_impl(impl)
    rope_fn = rope if callable(rope) else None
    rope_arr = None if (rope is None or callable(rope)) else tuple(rope)
    pos = jnp.asarray(pos, jnp.int32).reshape(())
    extra_segments = tuple(extra_segments)
    for seg in extra_segments:
        check_segment(seg, x)
    if residual is not None:
        check_array("residual", residual, shape=x.shape)
        if residual.dtype != jnp.float32:
            raise TypeError(f"residual must be float32, got {residual.dtype}")
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be positive and finite, got {softcap!r}")
    if qk_norm is not None:
        if callable(rope):
            raise ValueError("qk_norm needs the rotary embedding as (cos, sin) tables")
        for nm, w in zip(("qk_norm[0]", "qk_norm[1]"), qk_norm):
            check_array(nm, w, shape=(wq.shape[1],), floating=True)
        qk_norm = tuple(qk_norm)
    return _attn_jit(x, wq, bq, wk, bk, wv, bv, wo, bo, k_cache, v_cache, pos, head_idx,
                     rope_arr, kv_mask, window, extra_segments, residual, qk_norm,
                     None if head_mask is None else jnp.asarray(head_mask, bool), impl=impl,
                     config=config, rope_fn=rope_fn, norm_eps=float(norm_eps),
                     scale=None if scale is None else float(scale),
                     softcap=None if softcap is None else float(softcap))
