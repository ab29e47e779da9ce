"""The one-launch batch union of local top-k sets against numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.kernels.top_k import local_top_k_shape, top_k_indices_local
from dejavu_jax.kernels.union_select import union_local_size, union_top_k_local


def _numpy_union(scores, k, chunk):
    """float64 numpy: per chunk, the union of each row's top k_c (stable order: ties to the
    lower id), then the lowest non-members up to the chunk's capacity."""
    B, n = scores.shape
    P, c, kc = local_top_k_shape(n, k, chunk)
    out = []
    for p in range(P):
        lo, hi = p * c, min(p * c + c, n)
        member = np.zeros(hi - lo, bool)
        for row in scores[:, lo:hi]:
            member[np.argsort(-row, kind="stable")[:kc]] = True
        cap = min(hi - lo, B * kc)          # each chunk: min(its lanes, B * k_c) ids
        spare = np.nonzero(~member)[0][:cap - member.sum()]
        member[spare] = True
        out.append(lo + np.nonzero(member)[0])
    return np.concatenate(out)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("B,n,k,chunk", [(1, 5000, 700, 2048), (3, 5000, 500, 2048),
                                         (4, 3000, 900, 1024), (16, 2500, 400, 2048),
                                         (5, 300, 60, 2048), (3, 11, 3, 8)])
def test_union_matches_numpy(rng, impl, B, n, k, chunk):
    """bf16-exact scores with many ties (a coarse grid): the union, its padding and its
    static size equal numpy's; ids are distinct and ascending."""
    scores = np.round(rng.standard_normal((B, n)) * 8) / 8        # ties, bf16-exact
    # the jnp references under jit: one program each, not op by op (the kernel path is
    # one jitted program already)
    union = union_top_k_local
    if impl == "reference":
        union = jax.jit(union, static_argnames=("k", "chunk", "impl"))
    local = jax.jit(top_k_indices_local, static_argnames=("k", "chunk", "impl"))
    got = np.asarray(union(jnp.asarray(scores, jnp.float32), k=k, chunk=chunk, impl=impl))
    want = _numpy_union(scores, k, chunk)
    np.testing.assert_array_equal(got, want)
    assert np.all(np.diff(got) > 0) and got.min() >= 0 and got.max() < n
    assert got.shape == (union_local_size(B, n, k, chunk),)
    for row in scores:   # every row's own local set is inside
        own = np.asarray(local(jnp.asarray(row, jnp.float32), k=k, chunk=chunk,
                               impl="reference"))
        assert set(own.tolist()) <= set(got.tolist())


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_a_full_chunk_holds_more_than_the_last_chunks_lanes(impl):
    """11 scores in chunks of 6 and 5, 3 rows choosing 2 each from the first chunk's 6
    lanes: all 6 are in the union, though the last chunk has only 5 lanes."""
    scores = np.full((3, 11), -1.0, np.float32)
    for row in range(3):
        scores[row, 2 * row:2 * row + 2] = 1.0 + row
    got = np.asarray(union_top_k_local(jnp.asarray(scores), 3, chunk=8, impl=impl))
    assert set(range(6)) <= set(got.tolist())
    assert got.shape == (union_local_size(3, 11, 3, 8),) and np.all(np.diff(got) > 0)


def test_one_row_is_the_local_top_k(rng):
    scores = jnp.asarray(rng.standard_normal((1, 4096)), jnp.float32)
    np.testing.assert_array_equal(
        union_top_k_local(scores, 300, impl="interpret"),
        top_k_indices_local(scores[0], 300, impl="reference"))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="k=0"):
        union_top_k_local(jnp.zeros((2, 10)), 0)
    with pytest.raises(ValueError, match="ndim|dimensions|2"):
        union_top_k_local(jnp.zeros((10,)), 3)
