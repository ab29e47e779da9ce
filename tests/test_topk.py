"""Sort-free top-k against numpy's exact top-k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.topk import threshold_top_k

select = jax.jit(threshold_top_k, static_argnums=1)


@pytest.mark.parametrize("n,k", [(20480, 2048), (1536, 692), (9, 5), (100, 1), (100, 100)])
def test_threshold_top_k_equals_exact_top_k(rng, n, k):
    for scores in (rng.normal(size=n), rng.lognormal(size=n) * 100, -rng.exponential(size=n)):
        got = np.asarray(select(jnp.asarray(scores, jnp.float32), k))
        want = np.sort(np.argsort(-scores.astype(np.float32), kind="stable")[:k])
        np.testing.assert_array_equal(got, want)


def test_threshold_top_k_with_ties_keeps_k_distinct_best(rng):
    scores = rng.integers(0, 4, size=300).astype(np.float32)
    got = np.asarray(select(jnp.asarray(scores), 77))
    assert len(set(got.tolist())) == 77
    np.testing.assert_array_equal(np.sort(scores[got]), np.sort(scores)[-77:])


def test_threshold_top_k_rejects_bad_k():
    with pytest.raises(ValueError):
        threshold_top_k(jnp.zeros(5), 6)
