"""Sort-free top-k against numpy's exact top-k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.topk import threshold_top_k

select = jax.jit(threshold_top_k, static_argnums=1)


@pytest.mark.parametrize("n,k", [(20480, 2048), (1536, 692), (9, 5), (100, 1), (100, 100)])
def test_threshold_top_k_equals_exact_top_k(rng, n, k):
    """Equal to numpy's top-k except among scores within the documented bracket width,
    (max - min) / 128**3, of the k-th largest (where either choice is a top-k)."""
    for scores in (rng.normal(size=n), rng.lognormal(size=n) * 100, -rng.exponential(size=n)):
        s = scores.astype(np.float32)
        got = np.asarray(select(jnp.asarray(s), k))
        want = np.sort(np.argsort(-s, kind="stable")[:k])
        assert len(np.unique(got)) == k and (np.diff(got) > 0).all()
        kth = np.sort(s)[::-1][k - 1]
        width = (float(s.max()) - float(s.min())) / 128 ** 3
        far = np.abs(s.astype(np.float64) - kth) > width
        np.testing.assert_array_equal(np.intersect1d(got, np.flatnonzero(far)),
                                      np.intersect1d(want, np.flatnonzero(far)))
        assert s[got].min() >= kth - width


def test_threshold_top_k_with_ties_keeps_k_distinct_best(rng):
    scores = rng.integers(0, 4, size=300).astype(np.float32)
    got = np.asarray(select(jnp.asarray(scores), 77))
    assert len(set(got.tolist())) == 77
    np.testing.assert_array_equal(np.sort(scores[got]), np.sort(scores)[-77:])


def test_threshold_top_k_rejects_bad_k():
    with pytest.raises(ValueError):
        threshold_top_k(jnp.zeros(5), 6)


@pytest.mark.parametrize("n,k", [(20480, 2048), (300, 150), (7, 7), (50, 1)])
def test_packed_top_k_equals_the_radix_kernel_set(rng, n, k):
    from dejavu_jax.kernels.top_k import top_k_indices
    from dejavu_jax.topk import packed_top_k
    for scores in (rng.normal(size=n), np.round(rng.normal(size=n) * 2) / 2):
        s = jnp.asarray(scores, jnp.float32)
        got = np.asarray(jax.jit(packed_top_k, static_argnums=1)(s, k))
        trunc = (np.asarray(scores, np.float32).view(np.int32) & np.int32(-65536)).view(np.float32)
        order = np.lexsort((np.arange(n), -(trunc.astype(np.float64) + 0.0)))
        np.testing.assert_array_equal(got, np.sort(order[:k]))
        np.testing.assert_array_equal(got, np.asarray(top_k_indices(s, k, impl="reference")))


def _bf16_order(scores):
    """Indices by descending bfloat16-truncated score, ties to the lower index (numpy)."""
    trunc = (np.asarray(scores, np.float32).view(np.int32) & np.int32(-65536)).view(np.float32)
    return np.lexsort((np.arange(len(scores)), -(trunc.astype(np.float64) + 0.0)))


@pytest.mark.parametrize("n,k,chunk", [(28672, 2867, 2048), (4097, 300, 1024), (300, 7, 2048),
                                       (50, 50, 16), (1000, 1, 100), (37, 37, 8),
                                       (37, 36, 8)])
def test_local_top_k_takes_the_top_of_every_chunk(rng, n, k, chunk):
    """The top of every chunk; k = n every id, though a short last chunk (37 = 4 x 8 + 5)
    caps the chunks' equal quotas below it."""
    from dejavu_jax.kernels.top_k import top_k_indices_local
    P = -(-n // chunk)
    c = -(-n // P)
    kc = max(1, min(round(k / P), n - (P - 1) * c))
    for scores in (rng.normal(size=n), np.round(rng.normal(size=n) * 2) / 2):
        want = np.arange(n) if k == n else np.concatenate(
            [lo + np.sort(_bf16_order(scores[lo:lo + c])[:kc]) for lo in range(0, n, c)])
        for impl in ("interpret", "reference"):
            got = np.asarray(top_k_indices_local(jnp.asarray(scores, jnp.float32), k,
                                                 chunk=chunk, impl=impl))
            np.testing.assert_array_equal(got, want)


def test_local_top_k_rejects_bad_arguments():
    from dejavu_jax.kernels.top_k import top_k_indices_local
    with pytest.raises(ValueError, match="k=0"):
        top_k_indices_local(jnp.zeros(10), 0)
    with pytest.raises(ValueError, match="chunk"):
        top_k_indices_local(jnp.zeros(10), 3, chunk=0)
    with pytest.raises(ValueError, match="rank 1"):
        top_k_indices_local(jnp.zeros((2, 10)), 3)


@pytest.mark.parametrize("method", ["radix", "chunked", "local", "packed", "threshold", "exact"])
def test_predictor_selector_methods_pick_the_top_scores(rng, method):
    """Each selection method returns the top-k of the predictor's own scores (radix: at
    bfloat16 precision) for the next layer, neurons and query heads."""
    from dejavu_jax.config import preset
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.sparse_variants import variant_selector
    from dejavu_jax.train.predict import predictor_scores
    config = preset("llama-tiny")
    preds = random_predictors(config, 16, jax.random.key(int(rng.integers(1 << 30))))
    preds = jax.tree.map(lambda a: a.astype(jnp.float32), preds)
    select = variant_selector(config.group_size, method, impl="interpret")
    x = jnp.asarray(rng.standard_normal((1, config.hidden)), jnp.float32)
    layer = jnp.int32(1)
    neurons, heads_idx = jax.jit(select, static_argnums=(3, 4))(preds, layer, x, 40, 2)
    mlp, heads = predictor_scores(preds, layer, x)
    for got, scores, k in ((neurons, mlp[0], 40),
                           (heads_idx, heads[0], 2)):
        scores = np.asarray(scores, np.float32)
        if method in ("radix", "chunked", "local", "packed"):
            scores = (scores.view(np.int32) & np.int32(-65536)).view(np.float32)
        got = np.asarray(got)
        assert len(set(got.tolist())) == k and (np.diff(got) > 0).all()
        # every chosen score is >= every score left out
        left = np.setdiff1d(np.arange(len(scores)), got)
        assert scores[got].min() >= (scores[left].max() if len(left) else -np.inf)


@pytest.mark.parametrize("B,n,k", [(2, 300, 30), (4, 20480, 2048), (3, 1000, 1)])
def test_kth_largest_bracket_holds_each_rows_kth_score(rng, B, n, k):
    from dejavu_jax.topk import kth_largest_bracket
    s = rng.standard_normal((B, n)).astype(np.float32)
    lo, hi = jax.jit(kth_largest_bracket, static_argnums=1)(jnp.asarray(s), k)
    kth = -np.sort(-s, axis=1)[:, k - 1]
    assert np.all(np.asarray(lo) <= kth) and np.all(kth <= np.asarray(hi))
    assert np.all((s >= np.asarray(lo)[:, None]).sum(1) >= k)
    assert np.all((s > np.asarray(hi)[:, None]).sum(1) < k)


@pytest.mark.parametrize("B,n,k", [(2, 300, 30), (4, 20480, 2048), (4, 1000, 100)])
def test_union_top_k_holds_every_rows_top_k(rng, B, n, k):
    """The union of numpy's per-row top-k sets, padded to k * B distinct ids by the
    largest margins over the rows' k-th scores; a smaller capacity keeps the union's
    members of largest margin."""
    from dejavu_jax.topk import union_top_k
    # rows of different scales and offsets: one row's raw scores must not crowd out another's
    scale, shift = np.array([1, 10, 0.1, 3])[:B], np.array([0, 5, -3, 1])[:B]
    s = (rng.standard_normal((B, n)) * scale[:, None] + shift[:, None]).astype(np.float32)
    union = set(np.argsort(-s, axis=1)[:, :k].reshape(-1).tolist())
    union_top_k = jax.jit(union_top_k, static_argnums=(1, 2))
    got = np.asarray(union_top_k(jnp.asarray(s), k, k * B))
    assert got.shape == (min(n, k * B),) and len(set(got.tolist())) == got.size
    assert np.all(np.diff(got) > 0) and union <= set(got.tolist())
    # the padding is the non-members nearest to some row's k-th score, up to the
    # brackets' resolution (one for the rows' k-th scores, one for the margins' ranking)
    kth = -np.sort(-s, axis=1)[:, k - 1]
    margin = (s - kth[:, None]).max(0)
    pad = sorted(set(got.tolist()) - union)
    rest = np.setdiff1d(np.arange(n), got)
    assert pad and rest.size
    tol = 2 * (np.ptp(s, axis=1).max() + np.ptp(margin)) / 32 ** 3
    assert margin[pad].min() >= margin[rest].max() - tol
    full = np.asarray(union_top_k(jnp.asarray(s), k, n))
    assert np.array_equal(full, np.arange(n))
    small = np.asarray(union_top_k(jnp.asarray(s), k, k + 3))
    members = np.array(sorted(union))
    assert small.size == k + 3 and set(small.tolist()) <= union
    left_out = np.setdiff1d(members, small)
    assert margin[small].min() >= margin[left_out].max() - tol


def test_union_top_k_rejects_bad_capacity():
    from dejavu_jax.topk import union_top_k
    with pytest.raises(ValueError, match="capacity"):
        union_top_k(jnp.zeros((2, 5)), 2, 6)
