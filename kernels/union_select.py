"""A batch's union of its rows' local top-k sets in one Pallas launch.

A batch of B rows computes the union of the rows' selected neurons. Ranking every row
and merging the sets in XLA takes a sort or several counting passes per layer; here one
launch does it, with a program per chunk of the scores:

1. row by row, the chunk's scores map to 16-bit keys (their bfloat16 truncation, as in
   :mod:`.top_k`) and a binary search over key values finds the row's ``k_c``-th largest
   key (:func:`row_kth_key`); a lane is a member when some row chooses it (its key above
   that row's k-th, then ties in lane order). One row's keys are live at a time, so the
   program stays small beside the bandwidth-bound programs it shares a launch with;
2. the chunk writes ``cap_c = min(c, B * k_c)`` ids in ascending order: its members, and
   where they are fewer, the lowest-index non-members (computing a unit no row chose
   changes no row's result beyond adding that unit).

The chunks are :func:`.top_k.top_k_indices_local`'s: with one row this is that set.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import check_array, next_pow2, resolve_impl
from .top_k import kth_keys, local_top_k_shape, row_kth_key, score_keys, top_lanes


def union_local_shape(B: int, n: int, k: int, chunk: int) -> tuple[int, int, int, int]:
    """(chunks P, chunk length c, ids per row per chunk k_c, ids per full chunk cap_c =
    min(c, B * k_c)); the last chunk, of ``n - (P - 1) c`` lanes, writes
    :func:`last_chunk_cap` ids."""
    P, c, kc = local_top_k_shape(n, k, chunk)
    return P, c, kc, min(c, B * kc)


def last_chunk_cap(B: int, n: int, k: int, chunk: int) -> int:
    """Ids the last chunk writes: min(its lanes, B * k_c)."""
    P, c, kc, _ = union_local_shape(B, n, k, chunk)
    return min(n - (P - 1) * c, B * kc)


def union_local_size(B: int, n: int, k: int, chunk: int) -> int:
    """The static size of the union: ``(P - 1) cap_c`` plus the last chunk's ids, about
    ``min(n, B * k)``."""
    P, _, _, cap = union_local_shape(B, n, k, chunk)
    return (P - 1) * cap + last_chunk_cap(B, n, k, chunk)


def union_top_k_local_reference(scores: jax.Array, k: int, chunk: int = 2048) -> jax.Array:
    """jnp reference of :func:`union_top_k_local` (a stable sort per row and chunk)."""
    B, n = scores.shape
    P, c, kc, cap = union_local_shape(B, n, k, chunk)
    keys = score_keys(scores)
    out = []
    for p in range(P):
        lo, hi = p * c, min(p * c + c, n)
        cap_p = cap if p < P - 1 else last_chunk_cap(B, n, k, chunk)
        top = jnp.argsort(-keys[:, lo:hi], axis=1, stable=True)[:, :kc]
        member = jnp.zeros((hi - lo,), bool).at[top.reshape(-1)].set(True)
        spare = jnp.cumsum(~member) <= cap_p - member.sum()
        take = member | (~member & spare)
        out.append(lo + jnp.nonzero(take, size=cap_p)[0])
    return jnp.concatenate(out).astype(jnp.int32)


def _union_kernel(s_ref, o_ref, *, B, n, c, kc, cap, cap_last, P, block):
    p = pl.program_id(0)
    ids, valid = chunk_lanes(p, c, n, block)
    slot, _ = union_slots(lambda b: plgpu.load(s_ref.at[b, ids], mask=valid, other=0.0),
                          p, valid, B=B, kc=kc, cap=cap, cap_last=cap_last, last=P - 1,
                          block=block)
    plgpu.store(o_ref.at[p, slot], ids)


def chunk_lanes(p, c: int, n: int, block: int) -> tuple[jax.Array, jax.Array]:
    """Chunk p's lanes: their ids ``p * c + lane`` (int32 [block]) and whether each is one
    of the chunk's scores (lane below c and id below n)."""
    lane = jnp.arange(block, dtype=jnp.int32)
    ids = p * c + lane
    return ids, (lane < c) & (ids < n)


def union_slots(row_scores, p, valid, *, B: int, kc: int, cap: int, cap_last: int,
                last: int, block: int) -> tuple[jax.Array, jax.Array]:
    """Chunk p's output slots (:func:`member_slots`) for the union of B rows' ``kc`` largest
    scores, row b's scores ``row_scores(b)`` ([block], read on the valid lanes), and the
    chunk's id count (``cap_last`` for chunk ``last``, else ``cap``)."""

    def row_keys(b):
        return jnp.where(valid, score_keys(row_scores(b)), -1)

    cap_p = cap + (cap_last - cap) * (p == last).astype(jnp.int32)
    return member_slots(union_members(row_keys, B, kc, block), valid, cap_p), cap_p


def rows_chosen(key: jax.Array, k: int) -> jax.Array:
    """Each row's k largest keys of ``key [R, block]`` (ties to the lower lane) as a bool
    mask, the R rows' k-th keys searched at once (:func:`.top_k.kth_keys`). Lanes outside
    a row's scores hold key -1."""
    return top_lanes(key, kth_keys(key, k), k)


def union_members(row_keys, B: int, k: int, block: int) -> jax.Array:
    """Whether some row of B chooses each lane (int32 [block], 1 = chosen): row b's keys
    ``row_keys(b)`` ([block], -1 outside its scores), its k largest with ties to the
    lower lane. The rows go one at a time, so a program holds one row's keys, not B."""

    def add_row(b, member):
        key = row_keys(b)
        chosen = top_lanes(key, row_kth_key(key, k), k)
        return jnp.maximum(member, chosen.astype(jnp.int32))

    return lax.fori_loop(0, B, add_row, jnp.zeros((block,), jnp.int32))


def member_slots(member: jax.Array, valid: jax.Array, cap: int) -> jax.Array:
    """A distinct output slot per lane of a chunk: the members (``member [block]`` > 0),
    then the lowest valid non-members up to ``cap`` lanes in all, get 0..cap-1 in lane
    order; every other lane one of its own after them."""
    member = member > 0
    spare = valid & jnp.logical_not(member)
    fill = cap - jnp.sum(member.astype(jnp.int32))
    take = member | (spare & (jnp.cumsum(spare.astype(jnp.int32)) <= fill))
    return jnp.where(take, jnp.cumsum(take.astype(jnp.int32)),
                     cap + jnp.cumsum(jnp.logical_not(take).astype(jnp.int32))) - 1


@functools.partial(jax.jit, static_argnames=("k", "chunk", "interpret"))
def _union_local(scores, *, k: int, chunk: int, interpret: bool):
    B, n = scores.shape
    P, c, kc, cap = union_local_shape(B, n, k, chunk)
    cap_last = last_chunk_cap(B, n, k, chunk)
    block = next_pow2(c)
    out = pl.pallas_call(
        functools.partial(_union_kernel, B=B, n=n, c=c, kc=kc, cap=cap,
                          cap_last=cap_last, P=P, block=block),
        grid=(P,),
        out_shape=jax.ShapeDtypeStruct((P, block), jnp.int32),
        compiler_params=plgpu.CompilerParams(
            num_warps=min(16, max(4, block // 512)), num_stages=1),
        interpret=interpret,
        name="union_top_k_local",
    )(scores.astype(jnp.float32))
    return jnp.concatenate([out[:P - 1, :cap].reshape(-1), out[P - 1, :cap_last]])


def union_top_k_local(scores: jax.Array, k: int, *, chunk: int = 2048,
                      impl: str | None = None) -> jax.Array:
    """Ids (int32, ascending) of a batch's union of local top-k sets, scores ``[B, n]``:
    per chunk of :func:`.top_k.top_k_indices_local`, the union of the rows' ``k_c``
    largest (bfloat16-precision keys, ties to the lower id), padded to ``min(c, B * k_c)``
    ids (the last chunk: min(its lanes, B * k_c)) with the chunk's lowest-index
    non-members. One launch; the size is static: :func:`union_local_size`, about
    ``min(n, B * k)``.
    """
    check_array("scores", scores, ndim=2, floating=True)
    B, n = scores.shape
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in 1..{n}")
    if chunk < 1 or chunk > 1 << 15:
        raise ValueError(f"chunk={chunk} must be in 1..32768")
    if B > 64:
        raise ValueError(f"union_top_k_local holds the batch's rows in one program; B={B} > 64")
    impl = resolve_impl(impl)
    if impl == "reference":
        return union_top_k_local_reference(scores, int(k), int(chunk))
    return _union_local(scores, k=int(k), chunk=int(chunk), interpret=impl == "interpret")
