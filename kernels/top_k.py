"""Top-k unit selection in one Pallas launch (the predictors' index sets).

XLA lowers ``lax.top_k`` of a few thousand out of tens of thousands of scores to a sort:
about 50 µs on an H200, twice per layer per token. Here one program holds the whole
score vector in registers and

1. maps each fp32 score to a 16-bit key that orders like the score's upper 16 bits (the
   score truncated to bfloat16 precision),
2. finds the k-th largest key by a 16-step binary search over key values (each step one
   compare-and-count over the block),
3. writes the ids of the keys above it, plus the lowest-index ties, in ascending order
   (two cumulative sums and one scatter store).

The result is exactly the top-k of the truncated scores, ties broken toward the lower
index: :func:`top_k_indices_reference` computes the same set with a stable sort.
:func:`top_k_indices_chunked` computes it again in three launches whose programs each own
a chunk of the scores, instead of one program doing 16 dependent counting passes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import check_array, next_pow2, resolve_impl

KEY_BITS = 16
NARROW_KEYS = 768   # 6 binades of bfloat16 keys below the largest (scores >= max / 64)


def score_keys(scores: jax.Array) -> jax.Array:
    """int32 keys in [0, 2**16) ordered like the scores' upper 16 bits (bf16 truncation)."""
    scores = scores.astype(jnp.float32)
    scores = jnp.where(scores == 0, 0.0, scores)      # -0.0 ties with +0.0, as they compare
    bits = lax.bitcast_convert_type(scores, jnp.int32)
    upper = (bits >> 16) & 0xFFFF
    return jnp.where(upper >= 0x8000, 0xFFFF - upper, upper + 0x8000)


def top_k_indices_reference(scores: jax.Array, k: int) -> jax.Array:
    """jnp reference of :func:`top_k_indices` (a stable sort of the keys)."""
    order = jnp.argsort(-score_keys(scores), stable=True)
    return jnp.sort(order[:k]).astype(jnp.int32)


def _top_k_kernel(s_ref, o_ref, *, n: int, k: int, block: int):
    ids = jnp.arange(block, dtype=jnp.int32)
    valid = ids < n
    s = plgpu.load(s_ref.at[ids], mask=valid, other=0.0)
    key = jnp.where(valid, score_keys(s), -1)
    plgpu.store(o_ref.at[_ranked_slots(key, k)], ids)


def kth_keys(key: jax.Array, k: int) -> jax.Array:
    """The k-th largest key along the last axis of ``key`` (int32 keys in [0, 2**16), -1
    for lanes to ignore; at least k lanes not ignored): one value per leading index. One
    row: :func:`row_kth_key`. Several: a 16-step binary search over key values for all
    rows at once keeps count(key >= lo) >= k > count(key >= hi), one count per step."""
    if key.ndim == 1:
        return row_kth_key(key, k)
    lead = key.shape[:-1]

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        enough = jnp.sum((key >= mid[..., None]).astype(jnp.int32), axis=-1) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    bounds = (jnp.zeros(lead, jnp.int32), jnp.full(lead, 1 << KEY_BITS, jnp.int32))
    return lax.fori_loop(0, KEY_BITS, halve, bounds)[0]


def row_kth_key(key: jax.Array, k: int) -> jax.Array:
    """The k-th largest of one row's keys ``key [block]`` (int32 in [0, 2**16), -1 for
    lanes to ignore; at least k lanes not ignored), as a scalar.

    A binary search over key values keeps count(key >= lo) >= k > count(key >= hi). It
    starts from [max - NARROW_KEYS, max] when that range already holds k keys (scores
    within a factor 2**(NARROW_KEYS / 128) of the largest: 10 steps instead of 16), else
    from the whole key range, and stops once the range is one key wide."""
    top = jnp.max(key)
    lo_try = jnp.maximum(top - NARROW_KEYS, 0)
    narrow = jnp.sum((key >= lo_try).astype(jnp.int32)) >= k
    bounds = (jnp.where(narrow, lo_try, 0), top + 1)

    def halve(b):
        lo, hi = b
        mid = (lo + hi) // 2
        enough = jnp.sum((key >= mid).astype(jnp.int32)) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    return lax.while_loop(lambda b: b[1] - b[0] > 1, halve, bounds)[0]


def top_lanes(key: jax.Array, kth: jax.Array, k: int) -> jax.Array:
    """The lanes of the k largest keys along the last axis of ``key`` (bool), from the
    k-th key ``kth`` (a scalar, or one per row of a 2-D ``key``): the keys above it, then
    its ties in lane order."""
    rows = key.ndim > 1
    above = key > (kth[:, None] if rows else kth)
    tie = key == (kth[:, None] if rows else kth)
    room = k - jnp.sum(above.astype(jnp.int32), axis=-1)
    return above | (tie & (jnp.cumsum(tie.astype(jnp.int32), axis=-1)
                           <= (room[:, None] if rows else room)))


def _ranked_slots(key, k: int):
    """A distinct output slot per lane: the lanes of the k largest keys (ties to the lower
    lane) get 0..k-1 in lane order, every other lane one of its own after them
    (:func:`kth_keys` finds the k-th key)."""
    chosen = top_lanes(key, kth_keys(key, k), k)
    return jnp.where(chosen, jnp.cumsum(chosen.astype(jnp.int32)),
                     k + jnp.cumsum((~chosen).astype(jnp.int32))) - 1


@functools.partial(jax.jit, static_argnames=("k", "impl"))
def _top_k_jit(scores, *, k: int, impl: str):
    if impl == "reference":
        return top_k_indices_reference(scores, k)
    n = scores.shape[0]
    block = next_pow2(n)
    return pl.pallas_call(
        functools.partial(_top_k_kernel, n=n, k=k, block=block),
        grid=(1,),
        out_shape=jax.ShapeDtypeStruct((block,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=min(32, max(4, block // 1024)),
                                             num_stages=1),
        interpret=impl == "interpret",
        name="top_k_indices",
    )(scores.astype(jnp.float32))[:k]


def top_k_indices(scores: jax.Array, k: int, *, impl: str | None = None) -> jax.Array:
    """Ids ``[k]`` (int32, ascending) of the k largest of ``scores [n]``.

    Scores are compared at bfloat16 precision (their upper 16 bits); equal keys go to the
    lower id. One launch, one program: meant for n up to a few tens of thousands (an
    MLP's neurons), where it replaces a sort.
    """
    check_array("scores", scores, ndim=1, floating=True)
    n = scores.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in 1..{n}")
    if n > 1 << 17:
        raise ValueError(f"top_k_indices holds the scores in one program; n={n} > 131072")
    return _top_k_jit(scores, k=int(k), impl=resolve_impl(impl))


# ----------------------------------------------------------------------------
# chunked: three parallel launches, no single-program bottleneck
# ----------------------------------------------------------------------------
#
# The 16-bit key splits into a coarse byte (key >> 8) and a fine byte (key & 255).
# 1. every chunk of C scores counts, for each coarse value b, its keys with coarse >= b;
# 2. every chunk finds the coarse byte b* of the k-th largest key from the summed counts
#    and counts, for each fine value f, its keys in b*'s bucket with fine >= f;
# 3. every chunk finds the k-th key T = (b*, f*) the same way, computes from the two count
#    tables how many ids the chunks before it contribute (keys above T, then ties in id
#    order up to the quota), and writes its own chosen ids at that offset.

CHUNK = 1024
BINS = 256


def _chunk_keys(s_ref, n, C):
    p = pl.program_id(0)
    ids = p * C + jnp.arange(C, dtype=jnp.int32)
    valid = ids < n
    s = plgpu.load(s_ref.at[ids], mask=valid, other=0.0)
    return ids, jnp.where(valid, score_keys(s), -1)


def _suffix_counts(values, mask, o_ref, p):
    """o_ref[p, b] = #(values >= b and mask) for b in 0..255, 16 thresholds at a time."""
    for j in range(BINS // 16):
        thr = j * 16 + jnp.arange(16, dtype=jnp.int32)
        hit = (values[:, None] >= thr[None, :]) & mask[:, None]
        o_ref[p, pl.ds(j * 16, 16)] = jnp.sum(hit.astype(jnp.int32), axis=0)


def _totals(ref, P, Pp):
    rows = jnp.arange(Pp, dtype=jnp.int32)
    cols = jnp.arange(BINS, dtype=jnp.int32)
    t = plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=(rows < P)[:, None], other=0)
    return jnp.sum(t, axis=0)


def _pick(vec, i):
    """vec[i] for a traced scalar i (0 when i is out of range)."""
    return jnp.sum(jnp.where(jnp.arange(vec.shape[0], dtype=jnp.int32) == i, vec, 0))


def _last_at_least(counts, k):
    """The largest b with counts[b] >= k (counts non-increasing, counts[0] >= k)."""
    b = jnp.arange(counts.shape[0], dtype=jnp.int32)
    return jnp.max(jnp.where(counts >= k, b, 0))


def _coarse_kernel(s_ref, o_ref, *, n, C):
    _, key = _chunk_keys(s_ref, n, C)
    _suffix_counts(key >> 8, key >= 0, o_ref, pl.program_id(0))


def _fine_kernel(s_ref, coarse_ref, o_ref, *, n, k, C, P, Pp):
    bstar = _last_at_least(_totals(coarse_ref, P, Pp), k)
    _, key = _chunk_keys(s_ref, n, C)
    _suffix_counts(key & 255, (key >> 8) == bstar, o_ref, pl.program_id(0))


def _compact_kernel(s_ref, coarse_ref, fine_ref, o_ref, *, n, k, C, P, Pp):
    p = pl.program_id(0)
    coarse = _totals(coarse_ref, P, Pp)
    bstar = _last_at_least(coarse, k)
    above_bucket = _pick(coarse, bstar + 1)
    fine = _totals(fine_ref, P, Pp)
    fstar = _last_at_least(fine, k - above_bucket)
    kth = bstar * BINS + fstar
    room = k - above_bucket - _pick(fine, fstar + 1)         # ties of kth to take
    # per chunk q: keys above kth, and ties
    q = jnp.arange(Pp, dtype=jnp.int32)
    before = q < p

    def column(ref, c):
        cc = jnp.full((Pp,), c, jnp.int32)
        ok = (q < P) & (c < BINS)
        return plgpu.load(ref.at[q, jnp.minimum(cc, BINS - 1)], mask=ok, other=0)

    gt_q = column(coarse_ref, bstar + 1) + column(fine_ref, fstar + 1)
    tie_q = column(fine_ref, fstar) - column(fine_ref, fstar + 1)
    ties_before = jnp.sum(jnp.where(before, tie_q, 0))
    offset = jnp.sum(jnp.where(before, gt_q, 0)) + jnp.minimum(ties_before, room)
    ids, key = _chunk_keys(s_ref, n, C)
    tie = key == kth
    chosen = (key > kth) | (tie & (ties_before + jnp.cumsum(tie.astype(jnp.int32)) <= room))
    # chosen ids go to their place among the k; every other lane to a slot of its own
    slot = jnp.where(chosen, offset + jnp.cumsum(chosen.astype(jnp.int32)) - 1, k + ids)
    plgpu.store(o_ref.at[slot], ids)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def _top_k_chunked(scores, *, k: int, interpret: bool):
    n = scores.shape[0]
    C = min(CHUNK, next_pow2(n))
    P = -(-n // C)
    Pp = next_pow2(P)
    scores = scores.astype(jnp.float32)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    table = jax.ShapeDtypeStruct((P, BINS), jnp.int32)
    coarse = pl.pallas_call(functools.partial(_coarse_kernel, n=n, C=C), grid=(P,),
                            out_shape=table, compiler_params=params, interpret=interpret,
                            name="top_k_coarse_counts")(scores)
    fine = pl.pallas_call(functools.partial(_fine_kernel, n=n, k=k, C=C, P=P, Pp=Pp),
                          grid=(P,), out_shape=table, compiler_params=params,
                          interpret=interpret, name="top_k_fine_counts")(scores, coarse)
    out = pl.pallas_call(functools.partial(_compact_kernel, n=n, k=k, C=C, P=P, Pp=Pp),
                         grid=(P,), out_shape=jax.ShapeDtypeStruct((k + P * C,), jnp.int32),
                         compiler_params=params, interpret=interpret,
                         name="top_k_compact")(scores, coarse, fine)
    return out[:k]


def top_k_indices_chunked(scores: jax.Array, k: int, *, impl: str | None = None) -> jax.Array:
    """The same set as :func:`top_k_indices` in three parallel launches over chunks of
    1024 scores (counts of the key's high byte, of its low byte within the k-th key's
    bucket, then each chunk writes its chosen ids at an offset read off the counts)."""
    check_array("scores", scores, ndim=1, floating=True)
    n = scores.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in 1..{n}")
    if n > 1 << 17:
        raise ValueError(f"top_k_indices_chunked sums per-chunk count tables in every "
                         f"program; n={n} > 131072")
    impl = resolve_impl(impl)
    if impl == "reference":
        return _top_k_jit(scores, k=int(k), impl="reference")
    return _top_k_chunked(scores, k=int(k), interpret=impl == "interpret")


# ----------------------------------------------------------------------------
# local: the top of every chunk, one launch of parallel programs
# ----------------------------------------------------------------------------

def local_top_k_shape(n: int, k: int, chunk: int) -> tuple[int, int, int]:
    """(chunks P, chunk length c, ids per chunk k_c) of :func:`top_k_indices_local`."""
    P = -(-n // chunk)
    c = -(-n // P)
    last = n - (P - 1) * c
    return P, c, max(1, min(round(k / P), last))


def top_k_indices_local_reference(scores: jax.Array, k: int, chunk: int = 2048) -> jax.Array:
    """jnp reference of :func:`top_k_indices_local` (a stable sort per chunk)."""
    n = scores.shape[0]
    P, c, kc = local_top_k_shape(n, k, chunk)
    keys = score_keys(scores)
    out = []
    for p in range(P):
        lo = p * c
        part = keys[lo:min(lo + c, n)]
        out.append(lo + jnp.sort(jnp.argsort(-part, stable=True)[:kc]))
    return jnp.concatenate(out).astype(jnp.int32)


def _local_top_k_kernel(s_ref, o_ref, *, n, c, kc, block):
    p = pl.program_id(0)
    lane = jnp.arange(block, dtype=jnp.int32)
    ids = p * c + lane
    valid = (lane < c) & (ids < n)
    s = plgpu.load(s_ref.at[ids], mask=valid, other=0.0)
    key = jnp.where(valid, score_keys(s), -1)
    plgpu.store(o_ref.at[p, _ranked_slots(key, kc)], ids)


@functools.partial(jax.jit, static_argnames=("k", "chunk", "interpret"))
def _top_k_local(scores, *, k: int, chunk: int, interpret: bool):
    n = scores.shape[0]
    P, c, kc = local_top_k_shape(n, k, chunk)
    block = next_pow2(c)
    out = pl.pallas_call(
        functools.partial(_local_top_k_kernel, n=n, c=c, kc=kc, block=block),
        grid=(P,),
        out_shape=jax.ShapeDtypeStruct((P, block), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, block // 256)),
                                             num_stages=1),
        interpret=interpret,
        name="top_k_local",
    )(scores.astype(jnp.float32))
    return out[:, :kc].reshape(-1)


def top_k_indices_local(scores: jax.Array, k: int, *, chunk: int = 2048,
                        impl: str | None = None) -> jax.Array:
    """Ids (int32, ascending) of the top ``k_c`` scores of every chunk: an approximate top-k
    in one launch of parallel programs.

    The n scores split into ``P = ceil(n / chunk)`` chunks of equal length (the last may be
    shorter); each chunk keeps its ``k_c = round(k / P)`` largest (bfloat16-precision keys,
    ties to the lower id), so ``P * k_c`` ids come back: within ``P / 2`` of k, unless the
    last chunk is shorter than ``k_c`` (:func:`local_top_k_shape`). k = n gives every id. With one chunk it is
    the exact set of :func:`top_k_indices`; with more, it differs from it only where the
    exact set is spread unevenly over the chunks.
    """
    check_array("scores", scores, ndim=1, floating=True)
    n = scores.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in 1..{n}")
    if chunk < 1 or chunk > 1 << 15:
        raise ValueError(f"chunk={chunk} must be in 1..32768")
    if k == n:  # every id: the chunks' equal quotas would leave some of a short last chunk's
        return jnp.arange(n, dtype=jnp.int32)
    impl = resolve_impl(impl)
    if impl == "reference":
        return top_k_indices_local_reference(scores, int(k), int(chunk))
    return _top_k_local(scores, k=int(k), chunk=int(chunk), interpret=impl == "interpret")
