"""Attention sparsity at query-head granularity for grouped-query models.

A selection is a set of query heads; the KV groups holding one follow
(`kernels.query_head_groups`). The kernels read only the selected heads' q rows and
out-projection columns and only the groups with a selected head: what they must not read is
poisoned with NaN (the Pallas interpreter also fills outputs with NaN first).
"""
import numpy as np
import pytest
import jax.numpy as jnp
from conftest import assert_finite_close

from dejavu_jax.kernels import KVWindow, head_sparse_attention, query_head_groups

F32 = jnp.float32


def _rot(t, cos, sin):
    h = t.shape[-1] // 2
    return t * cos + np.concatenate([-t[..., h:], t[..., :h]], -1) * sin


def _np_masked_attention(x, w, kc, vc, pos, hidx, hmask, cos, sin):
    """float64 numpy: the selected query heads' attention output and the caches with the
    current K/V of every group holding a selected head written."""
    wq, bq, wk, bk, wv, bv, wo, bo = w
    G = wq.shape[0] // wk.shape[0]
    kc, vc = kc.copy(), vc.copy()
    out = np.zeros((x.shape[0], wo.shape[0])) + bo
    for i, g in enumerate(hidx):
        if not hmask[i].any():
            continue
        kc[:, g, pos] = _rot(x @ wk[g].T + bk[g], cos, sin)
        vc[:, g, pos] = x @ wv[g].T + bv[g]
        for j in np.nonzero(hmask[i])[0]:
            h = g * G + j
            q = _rot(x @ wq[h].T + bq[h], cos, sin) / np.sqrt(wq.shape[1])
            s = np.einsum("bk,bsk->bs", q, kc[:, g, :pos + 1])
            p = np.exp(s - s.max(1, keepdims=True))
            out += np.einsum("bs,bsk->bk", p / p.sum(1, keepdims=True),
                             vc[:, g, :pos + 1]) @ wo[:, h].T
    return out, kc, vc


def _weights(rng, d, H, n_kv, hd):
    r = lambda *s: rng.standard_normal(s)
    return [r(H, hd, d) / np.sqrt(d), r(H, hd), r(n_kv, hd, d) / np.sqrt(d), r(n_kv, hd),
            r(n_kv, hd, d) / np.sqrt(d), r(n_kv, hd), r(d, H, hd) / np.sqrt(H * hd), r(d)]


def _problem(rng, B, d, H, n_kv, hd, S, pos):
    """Weights, caches NaN from `pos` on, inputs x [B, d] and one rotary (cos, sin)."""
    w = _weights(rng, d, H, n_kv, hd)
    kc, vc = rng.standard_normal((2, B, n_kv, S, hd))
    kc[:, :, pos:], vc[:, :, pos:] = np.nan, np.nan
    x = rng.standard_normal((B, d))
    ang = rng.standard_normal(hd // 2)
    return w, kc, vc, x, np.cos(np.r_[ang, ang]), np.sin(np.r_[ang, ang])


def _poison(w, kc, vc, hidx, hmask, G, keep_kv=()):
    """NaN in what a query-head selection must not read: unselected query heads' q rows,
    q biases and out-projection columns; the K/V weights and cache of groups with no
    selected head (except `keep_kv`, groups a window refreshes)."""
    wq, bq, wk, bk, wv, bv, wo, bo = (a.copy() for a in w)
    kc, vc = kc.copy(), vc.copy()
    keep = np.zeros((wk.shape[0], G), bool)
    keep[hidx] = hmask
    off_q = np.nonzero(~keep.reshape(-1))[0]
    wq[off_q], bq[off_q], wo[:, off_q] = np.nan, np.nan, np.nan
    idle = [g for g in range(wk.shape[0]) if not keep[g].any() and g not in keep_kv]
    for a in (wk, bk, wv, bv):
        a[idle] = np.nan
    kc[:, idle], vc[:, idle] = np.nan, np.nan
    return [wq, bq, wk, bk, wv, bv, wo, bo], kc, vc


def test_query_head_groups_puts_groups_with_a_selected_head_first():
    gids, mask = query_head_groups(jnp.asarray([7, 2, 3], jnp.int32), 4, 2)
    np.testing.assert_array_equal(gids, [1, 3, 0])
    np.testing.assert_array_equal(mask, [[True, True], [False, True], [False, False]])
    gids, mask = query_head_groups(jnp.asarray([5, 1], jnp.int32), 6, 1)
    np.testing.assert_array_equal(gids, [5, 1])
    assert mask is None
    gids, mask = query_head_groups(jnp.asarray([3, 0, 2, 1], jnp.int32), 2, 2)  # every head
    np.testing.assert_array_equal(gids, [0, 1])
    assert mask is None


@pytest.mark.parametrize("impl,B", [("interpret", 3), ("reference", 1)])
def test_query_head_mask_matches_numpy(rng, impl, B):
    """G = 3: one selected group partly masked, one whole, one with no selected head
    (skipped: its poisoned K/V weights and cache are not read, nothing is written)."""
    d, H, n_kv, hd, S, pos = 48, 12, 4, 16, 20, 13
    G = H // n_kv
    w, kc, vc, x, cos, sin = _problem(rng, B, d, H, n_kv, hd, S, pos)
    hidx = np.asarray([2, 0, 3], np.int32)
    hmask = np.asarray([[True, False, True], [True, True, True], [False, False, False]])
    want, want_k, want_v = _np_masked_attention(x, [np.nan_to_num(a) for a in w],
                                                np.nan_to_num(kc), np.nan_to_num(vc), pos,
                                                hidx, hmask, cos, sin)
    pw, pk, pv = _poison(w, kc, vc, hidx, hmask, G)
    f = lambda a: jnp.asarray(a, F32)
    out, k2, v2 = head_sparse_attention(
        f(x), *map(f, pw[:8]), f(pk), f(pv), jnp.int32(pos), jnp.asarray(hidx),
        head_mask=jnp.asarray(hmask), rope=(f(cos), f(sin)), impl=impl)
    assert_finite_close(out, want, rtol=1e-5, atol=1e-5)
    for got, ref, poisoned in ((k2, want_k, pk), (v2, want_v, pv)):
        got = np.asarray(got, np.float64)
        for g in (0, 2):
            assert_finite_close(got[:, g, :pos + 1], ref[:, g, :pos + 1], rtol=1e-5,
                                atol=1e-5)
        assert np.isnan(got[:, [1, 3]]).all()                 # idle groups: untouched


@pytest.mark.parametrize("impl", ["interpret"])   # the reference: the engine tests
def test_query_head_mask_with_a_missing_kv_window(rng, impl):
    """The bitmap window with a query-head mask: the groups with a selected head and the
    refresh groups write their missing entries; a selected group with no selected head
    writes nothing itself, but as a refresh group it still does (group 1 here), and an
    idle group that is not refreshed (3) keeps its entries and bits."""
    B, d, H, n_kv, hd, S, W, pos = 1, 32, 8, 4, 8, 16, 4, 9
    G = H // n_kv
    w = _weights(rng, d, H, n_kv, hd)
    kc, vc = rng.standard_normal((2, B, n_kv, S, hd))
    kc[:, :, pos + 1:], vc[:, :, pos + 1:] = np.nan, np.nan
    xs = rng.standard_normal((B, W, d))                       # the last row: this token
    slots = np.arange(pos - W + 1, pos + 1, dtype=np.int32)
    hidx, extra = np.asarray([1, 2, 0, 3], np.int32), np.asarray([1], np.int32)
    hmask = np.asarray([[False, False], [True, False], [True, True], [False, False]])
    written = rng.random((B, n_kv, S)) > 0.5
    written[:, :, pos] = False                                # the current token: missing
    ang = rng.standard_normal(hd // 2)
    cos, sin = np.cos(np.r_[ang, ang]), np.sin(np.r_[ang, ang])
    wq, bq, wk, bk, wv, bv, wo, bo = w
    want_k, want_v, want_w = kc.copy(), vc.copy(), written.copy()
    for g in (2, 0, 1):                                       # writing groups
        for j, s in enumerate(slots):
            if not written[0, g, s]:                          # same rotary table: a test
                want_k[0, g, s] = _rot(xs[0, j] @ wk[g].T + bk[g], cos, sin)
                want_v[0, g, s] = xs[0, j] @ wv[g].T + bv[g]
                want_w[0, g, s] = True
    want, want_k, want_v = _np_masked_attention(xs[:, -1], w, want_k, want_v, pos, hidx,
                                                hmask, cos, sin)
    pw, pk, pv = _poison(w, kc, vc, hidx, hmask, G, keep_kv=(1,))
    f = lambda a: jnp.asarray(a, F32)
    tables = (np.broadcast_to(cos, (B, W, hd)), np.broadcast_to(sin, (B, W, hd)))
    window = KVWindow(x=f(xs), current=jnp.int32(W - 1), extra_ids=jnp.asarray(extra),
                      need=None, slots=jnp.asarray(slots), cos=f(tables[0]),
                      sin=f(tables[1]), written=jnp.asarray(written),
                      written_base=jnp.int32(0), row_valid=jnp.ones((B, W), bool))
    out, k2, v2, w2 = head_sparse_attention(
        f(xs[:, -1]), *map(f, pw), f(pk), f(pv), jnp.int32(pos), jnp.asarray(hidx),
        head_mask=jnp.asarray(hmask), rope=(f(cos), f(sin)), window=window, impl=impl)
    assert_finite_close(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(w2), want_w)
    for got, ref in ((k2, want_k), (v2, want_v)):
        got = np.asarray(got, np.float64)
        assert_finite_close(got[:, :3, :pos + 1], ref[:, :3, :pos + 1], rtol=1e-5,
                            atol=1e-5)
        assert np.isnan(got[:, 3]).all()


def _row_poison(w, kc, vc, hidx, row_mask, G):
    """`_poison` for per-row masks: weights by the rows' union, each row's cache by its own
    heads (a group a row does not select is NaN in that row's cache)."""
    pw, _, _ = _poison(w, kc, vc, hidx, row_mask.any(0), G)
    kc, vc = kc.copy(), vc.copy()
    for b in range(kc.shape[0]):
        keep = np.zeros((kc.shape[1], G), bool)
        keep[hidx] = row_mask[b]
        idle = ~keep.any(1)
        kc[b, idle], vc[b, idle] = np.nan, np.nan
    return pw, kc, vc


@pytest.mark.parametrize("impl,G,splits", [("interpret", 3, 1), ("interpret", 1, 3),
                                           ("reference", 2, None)])
def test_per_row_head_masks_equal_each_row_alone(rng, impl, G, splits):
    """Three rows, each with its own query heads among the union's groups (one row with a
    group the others skip, one with a group of no head at all): every row's output and
    cache entries equal numpy's attention of that row alone with its own heads; the
    weights only the union reads and the cache groups a row skips are NaN."""
    from dejavu_jax.kernels import AttnConfig
    B, d, hd, S, pos, n_kv = 3, 48, 16, 40, 29, 4
    H = n_kv * G
    w, kc, vc, x, cos, sin = _problem(rng, B, d, H, n_kv, hd, S, pos)
    hidx = np.asarray([2, 0, 3], np.int32)
    row_mask = np.zeros((B, 3, G), bool)
    row_mask[0, 0, 0] = True                    # row 0: group 2 only
    row_mask[1, 0, -1] = row_mask[1, 1, :] = True
    row_mask[2, 1, 0] = True                    # row 2: group 0 only; group 3: no row
    pw, pk, pv = _row_poison(w, kc, vc, hidx, row_mask, G)
    f = lambda a: jnp.asarray(a, F32)
    cfg = None if splits is None else AttnConfig(seq_splits=splits, block_s=16)
    out, k2, v2 = head_sparse_attention(
        f(x), *map(f, pw), f(pk), f(pv), jnp.int32(pos), jnp.asarray(hidx),
        head_mask=jnp.asarray(row_mask), rope=(f(cos), f(sin)), impl=impl, config=cfg)
    for b in range(B):
        want, want_k, want_v = _np_masked_attention(
            x[b:b + 1], [np.nan_to_num(a) for a in w], np.nan_to_num(kc[b:b + 1]),
            np.nan_to_num(vc[b:b + 1]), pos, hidx, row_mask[b], cos, sin)
        assert_finite_close(out[b:b + 1], want, rtol=1e-5, atol=1e-5)
        own = [g for i, g in enumerate(hidx) if row_mask[b, i].any()]
        idle = [g for g in range(n_kv) if g not in own]
        for got, ref in ((k2, want_k), (v2, want_v)):
            got = np.asarray(got, np.float64)[b]
            assert_finite_close(got[own, :pos + 1], ref[0, own, :pos + 1], rtol=1e-5,
                                atol=1e-5)
            assert np.isnan(got[idle]).all()        # a row's skipped groups: untouched


def test_per_row_query_head_groups_hold_the_union_and_each_rows_heads():
    ids = jnp.asarray([[7, 2], [3, 2]], jnp.int32)          # G = 2, 4 groups
    gids, mask = query_head_groups(ids, 4, 2)               # capacity min(4, 2 * 2): all
    np.testing.assert_array_equal(gids, [0, 1, 2, 3])
    assert not mask[:, [0, 2]].any() and mask.shape == (2, 4, 2)
    gids, mask = query_head_groups(ids, 4, 2, n_groups=3)
    np.testing.assert_array_equal(gids, [1, 3, 0])
    np.testing.assert_array_equal(mask, [[[True, False], [False, True], [False, False]],
                                         [[True, True], [False, False], [False, False]]])
    gids, mask = query_head_groups(jnp.asarray([[5], [1]], jnp.int32), 6, 1)
    np.testing.assert_array_equal(gids, [1, 5])
    np.testing.assert_array_equal(mask[..., 0], [[False, True], [True, False]])


@pytest.mark.parametrize("impl,G,splits,softcap", [
    ("interpret", 1, 2, None), ("interpret", 3, 1, None), ("reference", 2, None, None),
    ("interpret", 1, 2, 1.5), ("interpret", 3, 1, 1.5), ("reference", 2, None, 1.5)])
def test_row_head_attention_equals_numpy_per_row(rng, impl, G, splits, softcap):
    """Projected queries, each row with its own heads and a key mask: numpy's softmax
    attention of that row's selected heads (its logits soft-capped when `softcap` is
    given), zeros for its other heads; the groups a row does not select are NaN in its
    cache before pos (never read)."""
    from dejavu_jax.kernels import AttnConfig, row_head_attention
    B, n_kv, hd, S, pos = 3, 4, 16, 48, 37
    H = n_kv * G
    q = rng.standard_normal((B, H, hd)) / 4
    kc, vc = rng.standard_normal((2, B, n_kv, S, hd))
    kc[:, :, pos + 1:], vc[:, :, pos + 1:] = np.nan, np.nan
    mask = rng.random((B, n_kv, G)) > 0.5
    mask[0] = False
    mask[0, 2, 0] = True                                      # row 0: one head
    kv_mask = rng.random((B, S)) > 0.2
    want = np.zeros((B, H, hd))
    for b in range(B):
        ok = kv_mask[b, :pos + 1].copy()
        ok[pos] = True
        for g in range(n_kv):
            for j in np.nonzero(mask[b, g])[0]:
                s = kc[b, g, :pos + 1] @ q[b, g * G + j]
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.where(ok, np.exp(s - s[ok].max()), 0.0)
                want[b, g * G + j] = (p / p.sum()) @ vc[b, g, :pos + 1]
    pk, pv = kc.copy(), vc.copy()
    for b in range(B):
        idle = ~mask[b].any(1)
        pk[b, idle, :pos], pv[b, idle, :pos] = np.nan, np.nan
    f = lambda a: jnp.asarray(a, F32)
    cfg = None if splits is None else AttnConfig(seq_splits=splits, block_s=16)
    out, k2, v2 = row_head_attention(f(q), f(pk), f(pv), jnp.int32(pos), jnp.asarray(mask),
                                     kv_mask=jnp.asarray(kv_mask), softcap=softcap, impl=impl,
                                     config=cfg)
    assert_finite_close(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(k2)[:, :, pos], pk[:, :, pos].astype(np.float32))
