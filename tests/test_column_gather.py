"""The column-gather out-projection kernel against numpy (Pallas interpreter)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.kernels.column_gather import gather_cols_matvec
from dejavu_jax.kernels.gather_matvec import batch_pad
from dejavu_jax.kernels.head_attention import merged_attention_loader

F32 = jnp.float32


@pytest.mark.parametrize("group_view", [False, True])
@pytest.mark.parametrize("B,d_out,n_groups,m,ids,block_rows,block_cols,res,bias", [
    (1, 40, 6, 8, (4, 1, 3), 8, 16, True, True),     # ragged rows, 2 chunks
    (1, 40, 6, 8, (0, 5), 4, 32, True, False),       # one masked chunk
    (1, 33, 5, 4, (2,), 16, 4, False, True),         # 1 group, chunk == group
    (3, 40, 6, 8, (5, 0, 2, 3), 16, 16, True, True), # tensor-core path
    (2, 24, 4, 16, (1, 3), 16, 64, False, False),
])
def test_gather_cols_matvec_equals_numpy(rng, B, d_out, n_groups, m, ids, block_rows,
                                         block_cols, res, bias, group_view):
    w = rng.standard_normal((d_out, n_groups * m)).astype(np.float32)
    ids = np.asarray(ids, np.int32)
    cols = (ids[:, None] * m + np.arange(m)).reshape(-1)
    keep = np.zeros(n_groups * m, bool)
    keep[cols] = True
    w[:, ~keep] = np.nan                                    # unselected columns: never read
    a = rng.standard_normal((B, cols.size)).astype(np.float32)
    r = rng.standard_normal((B, d_out)).astype(np.float32) if res else None
    b = rng.standard_normal(d_out).astype(np.float32) if bias else None
    want = a.astype(np.float64) @ w[:, cols].T.astype(np.float64)
    want = want + (0 if r is None else r) + (0 if b is None else b)
    load = functools.partial(merged_attention_loader, ns=0, B=B, Bp=batch_pad(B), hd=m)
    got = gather_cols_matvec([jnp.asarray(a)[None]], load, jnp.asarray(w), jnp.asarray(ids),
                             B=B, cols_per_id=m, block_rows=block_rows,
                             block_cols=block_cols, group_view=group_view,
                             residual=None if r is None else jnp.asarray(r),
                             bias=None if b is None else jnp.asarray(b), interpret=True)
    assert got.shape == (B, d_out) and got.dtype == F32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_gather_cols_matvec_rejects_bad_blocks_and_residual():
    load = functools.partial(merged_attention_loader, ns=0, B=1, Bp=1, hd=4)
    args = ([jnp.zeros((1, 1, 8))], load, jnp.zeros((16, 16)), jnp.asarray([0, 2]))
    with pytest.raises(ValueError, match="power of two"):
        gather_cols_matvec(*args, B=1, cols_per_id=4, block_rows=6)
    with pytest.raises(ValueError, match="residual must be fp32"):
        gather_cols_matvec(*args, B=1, cols_per_id=4, residual=jnp.zeros((1, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="group_view needs"):
        gather_cols_matvec(*args, B=1, cols_per_id=4, block_cols=2, group_view=True)


@pytest.mark.parametrize("B,group_view", [(1, False), (1, True), (2, False), (2, True)])
def test_gather_cols_matvec_reads_the_ids_layer_of_stacked_weights(rng, B, group_view):
    """Three layers stacked by rows: global ids of layer 1 read only layer 1's rows."""
    L, d_out, n_groups, m = 3, 24, 4, 8
    w = rng.standard_normal((L, d_out, n_groups * m)).astype(np.float32)
    local = np.asarray([3, 1], np.int32)
    cols = (local[:, None] * m + np.arange(m)).reshape(-1)
    keep = np.zeros((L, n_groups * m), bool)
    keep[1, cols] = True
    w[~keep[:, None, :].repeat(d_out, 1)] = np.nan          # other layers, other columns
    a = rng.standard_normal((B, cols.size)).astype(np.float32)
    want = a.astype(np.float64) @ w[1][:, cols].T.astype(np.float64)
    load = functools.partial(merged_attention_loader, ns=0, B=B, Bp=batch_pad(B), hd=m)
    got = gather_cols_matvec([jnp.asarray(a)[None]], load, jnp.asarray(w.reshape(L * d_out, -1)),
                             jnp.asarray(n_groups + local), B=B, cols_per_id=m, layers=L,
                             block_rows=16, block_cols=8, group_view=group_view,
                             interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
