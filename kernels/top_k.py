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

    def halve(_, bounds):
        lo, hi = bounds                      # count(key >= lo) >= k > count(key >= hi)
        mid = (lo + hi) // 2
        enough = jnp.sum((key >= mid).astype(jnp.int32)) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    kth, _ = lax.fori_loop(0, KEY_BITS, halve, (jnp.int32(0), jnp.int32(1 << KEY_BITS)))
    above = key > kth
    tie = key == kth
    room = k - jnp.sum(above.astype(jnp.int32))
    chosen = above | (tie & (jnp.cumsum(tie.astype(jnp.int32)) <= room))
    # every lane writes a distinct slot: the chosen ids first, in order, then the rest
    slot = jnp.where(chosen, jnp.cumsum(chosen.astype(jnp.int32)),
                     k + jnp.cumsum((~chosen).astype(jnp.int32))) - 1
    plgpu.store(o_ref.at[slot], ids)


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
