"""Sparse kernels (Pallas in interpret mode and the jnp references) vs float64 numpy.

Every test draws fresh random inputs.  Weights and cache entries the kernels must NOT
read (unselected neurons/heads, cache positions after ``pos``) are poisoned with NaN,
and the Pallas interpreter fills every kernel output with NaN before the kernel runs,
so a missed write or a stray read shows up as NaN.
"""
import dataclasses
import math

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from conftest import assert_finite_close

from dejavu_jax.kernels import AttnConfig, head_sparse_attention, sparse_mlp
from dejavu_jax.kernels._common import activation_fn, resolve_impl
from dejavu_jax.kernels.gather_matvec import Segment, check_segment, gather_matvec
from dejavu_jax.kernels.sparse_mlp import MLPConfig

BF16 = jnp.bfloat16
F32 = jnp.float32


def _tol(dtype):
    return 2e-2 if dtype == BF16 else 1e-5


def _q(a, dtype):
    """Round a float64 array to ``dtype`` and back (so numpy sees what the kernel sees)."""
    return np.asarray(jnp.asarray(a, dtype), np.float64)


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element or stray read)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# ----------------------------------------------------------------------------
# sparse MLP
# ----------------------------------------------------------------------------

NP_ACTIVATIONS = {
    "relu": lambda v: np.maximum(v, 0),
    "silu": lambda v: v / (1 + np.exp(-v)),
    "gelu": lambda v: 0.5 * v * (1 + np.frompyfunc(math.erf, 1, 1)(v / math.sqrt(2)).astype(
        np.float64)),
    "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi)
                                                  * (v + 0.044715 * v ** 3))),
}


def _np_mlp(x, w1, b1, w2t, b2, idx, act, wg):
    h = x @ w1[idx].T + (0 if b1 is None else b1[idx])
    a = h * NP_ACTIVATIONS[act](x @ wg[idx].T) if wg is not None else NP_ACTIVATIONS[act](h)
    return a @ w2t[idx] + (0 if b2 is None else b2)


def test_kernel_activations_equal_numpy():
    """The kernels' activations (exp and a polynomial, no erf in Triton) against numpy's
    exact functions, over [-8, 8]: OPT's "gelu" is the erf form, Gemma's the tanh one."""
    v = np.linspace(-8, 8, 4001)
    for name, ref in NP_ACTIVATIONS.items():
        got = np.asarray(activation_fn(name)(jnp.asarray(v, F32)), np.float64)
        assert_finite_close(got, ref(v), rtol=1e-6, atol=1e-6, err_msg=name)
    exact, tanh = NP_ACTIVATIONS["gelu"](v), NP_ACTIVATIONS["gelu_tanh"](v)
    assert np.abs(exact - tanh).max() > 1e-4  # the two forms differ where it is checked


MLP_CASES = [  # B, d, F, K, dtype, activation, gated, biases, config
    (1, 96, 384, 37, F32, "relu", False, True, None),
    (3, 96, 384, 384, BF16, "relu", False, True, None),               # K = F
    (2, 96, 384, 1, F32, "relu", False, True, None),                  # K = 1
    (1, 1536, 6144, 100, BF16, "relu", False, True, None),
    (2, 1536, 6144, 45, F32, "silu", True, False, None),              # SwiGLU, no biases
    (1, 5120, 512, 40, BF16, "relu", False, True, None),
    (17, 96, 200, 33, F32, "silu", True, True,                        # B > 16, odd blocks
     MLPConfig(fc1_block_d=32, fc1_d_chunks=2, fc2_block_d=64, fc2_row_blocks=2)),
    (2, 96, 200, 37, F32, "gelu", False, True, None),                 # OPT's exact gelu
    (1, 96, 200, 37, F32, "gelu_tanh", True, False, None),            # Gemma's GeGLU
    (1, 96, 200, 37, F32, "relu", False, True,                        # odd blocks, batch 1
     MLPConfig(fc1_block_d=32, fc1_d_chunks=2, fc2_block_d=32, fc2_row_blocks=3)),
    (1, 96, 384, 37, BF16, "relu", False, True, MLPConfig(evict_first=True)),
    (3, 96, 384, 37, F32, "silu", True, False, MLPConfig(evict_first=True)),
]


# block-size configs only affect the Pallas path, so the reference runs the config-free cases
MLP_IMPL_CASES = [("interpret", *case) for case in MLP_CASES] + [
    ("reference", *case) for case in MLP_CASES if case[-1] is None]


@pytest.mark.parametrize("impl,B,d,F,K,dtype,act,gated,biases,config", MLP_IMPL_CASES)
def test_sparse_mlp_matches_numpy(rng, impl, B, d, F, K, dtype, act, gated, biases, config):
    idx = rng.permutation(F)[:K].astype(np.int32)
    unsel = np.setdiff1d(np.arange(F), idx)
    x = _q(rng.standard_normal((B, d)), dtype)
    mats = []
    for scale in (d ** -0.5, K ** -0.5, d ** -0.5):
        w = np.full((F, d), np.nan)                        # never read unselected rows
        w[idx] = _q(rng.standard_normal((K, d)) * scale, dtype)  # (only these drawn)
        mats.append(w)
    w1, w2t, wg = mats
    wg = wg if gated else None
    b1 = _q(rng.standard_normal(F), dtype) if biases else None
    b2 = _q(rng.standard_normal(d), dtype) if biases else None
    if b1 is not None:
        b1[unsel] = np.nan
    ref = _np_mlp(x, w1, b1, w2t, b2, idx, act, wg)
    c = lambda a: None if a is None else jnp.asarray(a, dtype)
    out = sparse_mlp(c(x), c(w1), c(b1), c(w2t), c(b2), jnp.asarray(idx), activation=act,
                     w_gate=c(wg), impl=impl, config=config)
    assert out.shape == (B, d) and out.dtype == dtype
    assert _rel(out, ref) < _tol(dtype)


def test_sparse_mlp_under_jit_with_traced_indices(rng):
    B, d, F, K = 2, 96, 300, 20
    x, w1, w2t = (rng.standard_normal(s) for s in ((B, d), (F, d), (F, d)))
    b1, b2 = rng.standard_normal(F), rng.standard_normal(d)
    idx = rng.permutation(F)[:K].astype(np.int32)
    f = jax.jit(lambda *a: sparse_mlp(*a, impl="interpret"))
    out = f(*(jnp.asarray(a, F32) for a in (x, w1, b1, w2t, b2)), jnp.asarray(idx))
    assert _rel(out, _np_mlp(x, w1, b1, w2t, b2, idx, "relu", None)) < 1e-5


def test_gather_matvec_writes_every_partial(rng):
    # The interpreter initialises outputs with NaN: every element (padded rows too) is written.
    B, d, F, K = 3, 100, 64, 21
    x = jnp.asarray(rng.standard_normal((B, d)), F32)
    w = rng.standard_normal((F, d))
    idx = rng.permutation(F)[:K].astype(np.int32)
    (parts,) = gather_matvec(x, [Segment(jnp.asarray(w, F32), jnp.asarray(idx))],
                             block_rows=16, block_d=32, d_chunks=1, interpret=True)
    parts = np.asarray(parts)
    assert np.isfinite(parts).all()
    np.testing.assert_allclose(parts.sum(0)[:, :K], np.asarray(x, np.float64) @ w[idx].T,
                               rtol=1e-5, atol=1e-5)


def test_gather_matvec_windowed_segment_skips_unflagged_past_rows(rng):
    """Three windows of 4 rows, current row 2: ids flagged 0 get only their current rows
    (the others stay unwritten: NaN in the interpreter), flagged ids every row; the
    window's rows load 8 columns at a time, the current rows alone the call's 32."""
    d, W, nwin, m = 64, 4, 3, 16
    xs = rng.standard_normal((nwin * W, d))
    w = rng.standard_normal((6 * m, d))
    ids = np.asarray([4, 1, 3, 0], np.int32)
    flags = np.asarray([0, 1, 0, 0], np.int32)     # one program per id (16 rows each)
    seg = Segment(jnp.asarray(w, F32), jnp.asarray(ids), m, x=jnp.asarray(xs, F32),
                  window=W, current=jnp.asarray([2], jnp.int32),
                  past_flags=jnp.asarray(flags), block_d=8)
    (p,) = gather_matvec(jnp.zeros((1, d), F32), [seg], block_rows=16, block_d=32,
                         d_chunks=1, interpret=True)
    got = np.asarray(p).sum(0)
    rows = (ids[:, None] * m + np.arange(m)).reshape(-1)
    want = xs @ w[rows].T
    current = np.arange(nwin) * W + 2
    for slot, flag in enumerate(flags):
        cols = slice(slot * m, slot * m + m)
        done = np.arange(nwin * W) if flag else current
        np.testing.assert_allclose(got[done, cols], want[done, cols], rtol=1e-5, atol=1e-5)
        if not flag:
            assert np.isnan(np.delete(got[:, cols], current, axis=0)).all()
    for bad, match in ((dict(past_flags=None), "needs past_flags"),
                       (dict(past_flags=jnp.zeros(2, jnp.int32)), "past_flags has shape"),
                       (dict(current=jnp.asarray([4], jnp.int32)), "not a row of a 4-row"),
                       (dict(window=5), "two or more 5-row windows")):
        with pytest.raises(ValueError, match=match):
            gather_matvec(jnp.zeros((1, d), F32), [dataclasses.replace(seg, **bad)],
                          block_d=32, interpret=True)


def test_gather_matvec_segment_reads_its_rows_in_place(rng):
    """x_row0 / x_span: the segment's input is rows row0..row0+n-1 of each batch row's
    stride rows of x, read in place (the other rows NaN: none is read); one batch row takes
    the vector path's loads, several the tensor-core path's."""
    d, n, stride, m = 48, 4, 12, 8
    w = rng.standard_normal((5 * m, d))
    ids = np.asarray([3, 0, 4], np.int32)
    rows = (ids[:, None] * m + np.arange(m)).reshape(-1)
    for batch, n_rows in ((1, 1), (3, n)):
        x = np.full((batch * stride, d), np.nan)
        inputs = rng.standard_normal((batch, n_rows, d))
        x.reshape(batch, stride, d)[:, 5:5 + n_rows] = inputs
        seg = Segment(jnp.asarray(w, F32), jnp.asarray(ids), m, x=jnp.asarray(x, F32),
                      x_row0=jnp.asarray([5], jnp.int32), x_span=(n_rows, stride))
        (p,) = gather_matvec(jnp.zeros((1, d), F32), [seg], block_rows=16, block_d=16,
                             d_chunks=1, interpret=True)
        got = np.asarray(p).sum(0)[:, :rows.size]
        want = inputs.reshape(-1, d) @ w[rows].T
        assert_finite_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x_span"):
        check_segment(dataclasses.replace(seg, x_span=(n, 5)), jnp.zeros((1, d), F32))


def test_gather_matvec_segment_with_its_own_block_d(rng):
    """A many-row segment loading 8 columns at a time beside a one-row segment loading 32:
    both sums are numpy's, over every d-split; a block_d above the call's is refused."""
    d = 100
    x = jnp.asarray(rng.standard_normal((1, d)), F32)
    xs = rng.standard_normal((40, d))
    w1, w2 = rng.standard_normal((24, d)), rng.standard_normal((30, d))
    i1, i2 = np.asarray([3, 0, 7], np.int32), np.asarray([2, 5], np.int32)
    segs = [Segment(jnp.asarray(w1, F32), jnp.asarray(i1), 3),
            Segment(jnp.asarray(w2, F32), jnp.asarray(i2), 5, x=jnp.asarray(xs, F32),
                    block_d=8)]
    p1, p2 = gather_matvec(x, segs, block_rows=16, block_d=32, d_chunks=2, interpret=True)
    r1 = (i1[:, None] * 3 + np.arange(3)).reshape(-1)
    r2 = (i2[:, None] * 5 + np.arange(5)).reshape(-1)
    np.testing.assert_allclose(np.asarray(p1).sum(0)[:, :r1.size],
                               np.asarray(x, np.float64) @ w1[r1].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p2).sum(0)[:, :r2.size], xs @ w2[r2].T,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_d=64 must be a power of two"):
        gather_matvec(x, [Segment(jnp.asarray(w1, F32), jnp.asarray(i1), 3, block_d=64)],
                      block_d=32, interpret=True)


# ----------------------------------------------------------------------------
# head-sparse attention
# ----------------------------------------------------------------------------

def _rotate_half(t):
    h = t.shape[-1] // 2
    return np.concatenate([-t[..., h:], t[..., :h]], -1)


def _np_attention(x, wq, bq, wk, bk, wv, bv, wo, bo, kc, vc, pos, hidx, cos, sin, mask):
    B, d = x.shape
    H, hd, _ = wq.shape
    n_kv = wk.shape[0]
    G = H // n_kv
    S = kc.shape[2]
    kc, vc = kc.copy(), vc.copy()
    out = np.zeros((B, d)) + (0 if bo is None else bo)
    rot = (lambda t: t) if cos is None else (lambda t: t * cos + _rotate_half(t) * sin)
    bias = lambda b, h: 0 if b is None else b[h]
    valid = np.arange(S)[None, :] <= pos
    if mask is not None:
        valid = valid & (mask | (np.arange(S) == pos)[None, :])
    for g in hidx:
        kc[:, g, pos] = rot(x @ wk[g].T + bias(bk, g))
        vc[:, g, pos] = x @ wv[g].T + bias(bv, g)
        for j in range(G):
            h = g * G + j
            q = rot(x @ wq[h].T + bias(bq, h)) / np.sqrt(hd)
            s = np.where(valid, np.einsum("bk,bsk->bs", q, np.nan_to_num(kc[:, g])), -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out += np.einsum("bs,bsk->bk", p, np.nan_to_num(vc[:, g])) @ wo[:, h].T
    return out, kc, vc


ATTN_CASES = [  # B, d, H, n_kv, hd, S, Kh, pos, dtype, rope, mask, biases
    (1, 96, 6, 6, 16, 40, 3, 0, F32, None, False, True),
    (2, 96, 6, 6, 16, 40, 6, 39, BF16, None, False, True),            # all heads, pos = S-1
    (3, 64, 8, 2, 8, 33, 1, 17, F32, "arrays", True, True),           # GQA, rope, left-pad mask
    (2, 128, 8, 4, 32, 100, 3, 99, BF16, "callable", False, False),  # GQA, no biases
    (1, 1536, 12, 12, 128, 48, 5, 30, BF16, None, False, True),
    (1, 5120, 4, 4, 64, 24, 2, 7, F32, "batched", False, True),
]


def _attn_inputs(rng, B, d, H, n_kv, hd, S, Kh, pos, dtype, biases):
    r = lambda *s: rng.standard_normal(s)
    hidx = rng.permutation(n_kv)[:Kh].astype(np.int32)
    unsel = np.setdiff1d(np.arange(n_kv), hidx)
    G = H // n_kv
    unsel_q = (unsel[:, None] * G + np.arange(G)).reshape(-1)
    x = _q(r(B, d), dtype)
    wq, wo = _q(r(H, hd, d) / np.sqrt(d), dtype), _q(r(d, H, hd) / np.sqrt(H * hd), dtype)
    wk, wv = _q(r(n_kv, hd, d) / np.sqrt(d), dtype), _q(r(n_kv, hd, d) / np.sqrt(d), dtype)
    bq, bk, bv, bo = ((_q(r(*s), dtype) if biases else None)
                      for s in ((H, hd), (n_kv, hd), (n_kv, hd), (d,)))
    for w in (wq,) + ((bq,) if biases else ()):
        w[unsel_q] = np.nan                                   # unselected heads: never read
    wo[:, unsel_q] = np.nan
    for w in (wk, wv) + ((bk, bv) if biases else ()):
        w[unsel] = np.nan
    kc, vc = _q(r(B, n_kv, S, hd), dtype), _q(r(B, n_kv, S, hd), dtype)
    for c in (kc, vc):
        c[:, unsel] = np.nan                                  # must stay untouched (NaN)
        c[:, :, pos:] = np.nan                                # pos is written; > pos unread
    return hidx, (x, wq, bq, wk, bk, wv, bv, wo, bo, kc, vc)


@pytest.mark.parametrize("B,d,H,n_kv,hd,S,Kh,pos,dtype,rope,mask,biases", ATTN_CASES)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_head_sparse_attention_matches_numpy(rng, impl, B, d, H, n_kv, hd, S, Kh, pos, dtype,
                                             rope, mask, biases):
    hidx, arrs = _attn_inputs(rng, B, d, H, n_kv, hd, S, Kh, pos, dtype, biases)
    ang = rng.standard_normal((B, hd // 2) if rope == "batched" else hd // 2)
    cos = np.cos(np.concatenate([ang, ang], -1)) if rope else None
    sin = np.sin(np.concatenate([ang, ang], -1)) if rope else None
    cos_np, sin_np = cos, sin          # numpy applies them to [B, hd] per head
    km = rng.random((B, S)) > 0.4 if mask else None
    ref, rk, rv = _np_attention(*arrs, pos, hidx, cos_np, sin_np, km)
    if rope == "callable":
        c_, s_ = jnp.asarray(cos, F32), jnp.asarray(sin, F32)
        rope_arg = lambda t: t * c_ + jnp.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * s_
    elif rope:
        rope_arg = (jnp.asarray(cos, F32), jnp.asarray(sin, F32))
    else:
        rope_arg = None
    c = lambda a: None if a is None else jnp.asarray(a, dtype)
    out, k2, v2 = head_sparse_attention(*(c(a) for a in arrs), jnp.int32(pos), jnp.asarray(hidx),
                                        rope=rope_arg, kv_mask=None if km is None else jnp.asarray(km),
                                        impl=impl)
    assert out.shape == (B, d) and out.dtype == dtype
    assert _rel(out, ref) < _tol(dtype)
    k2, v2 = np.asarray(k2, np.float64), np.asarray(v2, np.float64)
    for got, want in ((k2, rk), (v2, rv)):
        # Selected heads' rows at pos written; everything else bit-identical: the NaN
        # entries (unselected heads, slots >= pos) stay NaN, the others keep their values.
        assert_finite_close(got[:, hidx, pos], want[:, hidx, pos], rtol=_tol(dtype),
                            atol=_tol(dtype))
        keep = np.ones(got.shape, bool)
        keep[:, hidx, pos] = False
        poisoned = np.isnan(want) & keep
        assert np.isnan(got[poisoned]).all()
        values = keep & ~poisoned
        np.testing.assert_array_equal(got[values], want[values])


@pytest.mark.parametrize("B,n_kv,dtype", [(1, 6, BF16), (3, 2, F32)])
def test_head_sparse_attention_evict_hint_matches_numpy(rng, B, n_kv, dtype):
    """The evict-first hint on the q/k/v and out-projection weight loads
    (`AttnConfig.evict_first`) changes how the weights stream, not the result."""
    d, H, hd, S, Kh, pos = 96, 6, 16, 40, max(1, n_kv // 2), 21
    hidx, arrs = _attn_inputs(rng, B, d, H, n_kv, hd, S, Kh, pos, dtype, True)
    ref, rk, rv = _np_attention(*arrs, pos, hidx, None, None, None)
    c = lambda a: jnp.asarray(a, dtype)
    out, k2, v2 = head_sparse_attention(*(c(a) for a in arrs), jnp.int32(pos),
                                        jnp.asarray(hidx), impl="interpret",
                                        config=AttnConfig(evict_first=True))
    assert out.shape == (B, d) and _rel(out, ref) < _tol(dtype)
    for got, want in ((k2, rk), (v2, rv)):
        assert_finite_close(np.asarray(got, np.float64)[:, hidx, pos], want[:, hidx, pos],
                            rtol=_tol(dtype), atol=_tol(dtype))


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_head_sparse_attention_with_qk_norms_and_a_query_scale(rng, impl, softcap):
    """Gemma's attention: RMSNorm over each query and key head (own weights, after the
    biases, before the rotary embedding), a logit scale other than hd^-0.5 and, as Gemma 2,
    the scaled logits soft-capped (cap * tanh(logits / cap)), against numpy; GQA with 2 of
    4 KV groups selected, a key mask."""
    B, d, H, n_kv, hd, S, Kh, pos, eps, scale = 2, 64, 8, 4, 16, 20, 2, 11, 1e-6, 0.3
    hidx, arrs = _attn_inputs(rng, B, d, H, n_kv, hd, S, Kh, pos, F32, True)
    x, wq, bq, wk, bk, wv, bv, wo, bo, kc, vc = arrs
    qw, kw = 1 + 0.3 * rng.standard_normal(hd), 1 + 0.3 * rng.standard_normal(hd)
    ang = rng.standard_normal(hd // 2)
    cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    km = rng.random((B, S)) > 0.3
    rms = lambda t, w: t / np.sqrt(np.mean(t * t, -1, keepdims=True) + eps) * w
    rot = lambda t: t * cos + _rotate_half(t) * sin
    valid = (np.arange(S)[None] < pos) & km | (np.arange(S) == pos)[None]
    want = np.zeros((B, d)) + bo
    largest = 0.0
    for g in hidx:
        k_new = rot(rms(x @ wk[g].T + bk[g], kw))
        keys = np.where(valid[..., None], np.nan_to_num(kc[:, g]), 0)
        keys[:, pos] = k_new
        vals = np.where(valid[..., None], np.nan_to_num(vc[:, g]), 0)
        vals[:, pos] = x @ wv[g].T + bv[g]
        for h in range(g * (H // n_kv), (g + 1) * (H // n_kv)):
            q = rot(rms(x @ wq[h].T + bq[h], qw)) * scale
            s = np.einsum("bk,bsk->bs", q, keys)
            largest = max(largest, np.abs(s).max())
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            s = np.where(valid, s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            want += np.einsum("bs,bsk->bk", p / p.sum(1, keepdims=True), vals) @ wo[:, h].T
    c = lambda a: jnp.asarray(a, F32)
    out, k2, _ = head_sparse_attention(
        *(c(a) for a in arrs), jnp.int32(pos), jnp.asarray(hidx),
        rope=(c(cos), c(sin)), kv_mask=jnp.asarray(km), impl=impl,
        qk_norm=(c(qw), c(kw)), norm_eps=eps, scale=scale, softcap=softcap)
    assert softcap is None or largest > 2 * softcap, "the cap must bend the logits"
    assert _rel(out, want) < _tol(F32)
    assert_finite_close(np.asarray(k2)[:, hidx, pos],
                        np.stack([rot(rms(x @ wk[g].T + bk[g], kw)) for g in hidx], 1),
                        rtol=_tol(F32), atol=_tol(F32))


WINDOW_CASES = [  # B, d, H, n_kv, hd, S, W, pos, Kh, extra, rope, biases
    (1, 64, 8, 4, 16, 24, 4, 9, 2, (1,), True, False),       # GQA, rope, a refresh head
    (2, 96, 6, 6, 16, 30, 5, 12, 3, None, False, True),      # MHA, biases, no extra heads
    (2, 96, 6, 6, 16, 30, 5, 12, 2, (0, 4), False, True),    # extra heads, one also selected
    (2, 64, 8, 4, 16, 24, 5, 2, 2, (3,), True, True),        # early step: slots clamp to 0
]


WINDOW_VARIANTS = [  # impl, ring_shift, split, bitmap
    ("interpret", 0, False, False), ("interpret", 3, False, False),
    ("interpret", 1, True, False), ("reference", 0, False, False),
    ("reference", 2, True, False), ("interpret", 0, False, True),
    ("interpret", 1, True, True), ("reference", 2, True, True)]
# each variant on two cases, each case under four variants (interpreted and reference, one
# with sequence splits, one with a written-entries bitmap): a cover of the cross product
WINDOW_GRID = [v + c for i, v in enumerate(WINDOW_VARIANTS)
               for c in (WINDOW_CASES[i % 4], WINDOW_CASES[(i + 2) % 4])]


@pytest.mark.parametrize("impl,ring_shift,split,bitmap,B,d,H,n_kv,hd,S,W,pos,Kh,extra,rope,"
                         "biases", WINDOW_GRID)
def test_window_recompute_writes_needed_entries_then_attends(rng, impl, ring_shift, split,
                                                             bitmap, B, d, H, n_kv, hd, S, W,
                                                             pos, Kh, extra, rope, biases):
    """Missing-KV recomputation: the needed window entries equal numpy's projections of the
    stored inputs, other entries keep their values, and attention sees the new entries.
    The window's rows come rotated by ring_shift (a ring buffer), the current token's in
    row `current`. split: sequence splits of 8 slots (window slots on both sides of a
    split boundary) and a key mask with holes, one of them on a needed window entry
    (written, not attended). bitmap: the same needs given as a written-entries bitmap
    (rows offset by a base, unrelated bits random), which must come back with exactly the
    needed entries set, and whose window rows are read in place among other layers'."""
    from dejavu_jax.kernels import KVWindow
    r = lambda *s: rng.standard_normal(s)
    hidx = rng.permutation(n_kv)[:Kh].astype(np.int32)
    if extra is not None and 4 in extra and 4 not in hidx:
        hidx[0] = 4                                           # overlap with the refresh set
    ids = np.concatenate([hidx, np.asarray(extra or (), np.int32)])
    x, x_prev = r(B, d), r(B, W - 1, d)
    wq, wo = r(H, hd, d) / np.sqrt(d), r(d, H, hd) / np.sqrt(H * hd)
    wk, wv = r(n_kv, hd, d) / np.sqrt(d), r(n_kv, hd, d) / np.sqrt(d)
    bq, bk, bv, bo = ((r(*s) if biases else None) for s in ((H, hd), (n_kv, hd), (n_kv, hd), (d,)))
    kc, vc = r(B, n_kv, S, hd), r(B, n_kv, S, hd)
    kc[:, :, pos + 1:] = np.nan                               # never read
    vc[:, :, pos + 1:] = np.nan
    raw = np.arange(pos - W + 1, pos + 1)
    slots = np.maximum(raw, 0).astype(np.int32)               # early steps repeat slot 0
    need = rng.random((B, len(ids), W)) > 0.5
    need[:, :, -1] = True                                     # the current token is missing
    need[:, :, raw == 0] = True                               # the real slot 0 is needed ...
    need[:, :, raw < 0] = False                               # ... its clamped copies not
    if B > 1:   # head slots 0 and 1 miss nothing earlier: the program of their 32 rows
        need[:, :2, :-1] = False  # multiplies the current rows alone
    first = {}
    for i, h in enumerate(ids):                               # duplicates agree on need
        need[:, i] = need[:, first.setdefault(int(h), i)]
    cos = sin = None
    if rope:
        ang = r(B, W, hd // 2)
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    # numpy: write the needed entries, then attend (the current token through _np_attention)
    xs = np.concatenate([x_prev, x[:, None]], axis=1)
    want_k, want_v = kc.copy(), vc.copy()
    for b in range(B):
        for i, h in enumerate(ids):
            for w in range(W):
                if need[b, i, w]:
                    k = xs[b, w] @ wk[h].T + (0 if bk is None else bk[h])
                    if rope:
                        k = k * cos[b, w] + _rotate_half(k) * sin[b, w]
                    want_k[b, h, slots[w]] = k
                    want_v[b, h, slots[w]] = xs[b, w] @ wv[h].T + (0 if bv is None else bv[h])
    mask = None
    if split:
        mask = rng.random((B, S)) > 0.3
        mask[:, slots[np.argmax(need[0, 0])]] = False   # a needed entry, masked out
    ref, want_k, want_v = _np_attention(x, wq, bq, wk, bk, wv, bv, wo, bo, want_k, want_v, pos,
                                        hidx, None if cos is None else cos[:, -1],
                                        None if sin is None else sin[:, -1], mask)
    f = lambda a: None if a is None else jnp.asarray(a, F32)
    ring = lambda a, axis=1: None if a is None else np.roll(a, ring_shift, axis=axis)
    window = KVWindow(x=f(ring(xs)), current=jnp.int32((W - 1 + ring_shift) % W),
                      extra_ids=None if extra is None else jnp.asarray(extra, jnp.int32),
                      need=jnp.asarray(ring(need, 2)), slots=jnp.asarray(ring(slots, 0)),
                      cos=f(ring(cos)), sin=f(ring(sin)))
    if bitmap:
        base = n_kv                                           # this layer's bitmap rows
        written = rng.random((B, 3 * n_kv, S)) > 0.5
        row_valid = np.broadcast_to(raw >= 0, (B, W)).copy()
        for b in range(B):
            for i, h in enumerate(ids):
                for w in np.nonzero(row_valid[b])[0]:
                    written[b, base + h, slots[w]] = not need[b, i, w]
        want_written = written.copy()
        for b, i, w in zip(*np.nonzero(need)):
            want_written[b, base + ids[i], slots[w]] = True
        # and the window's rows read in place from every layer's rings (rows W..2W-1 of
        # 3W per batch row; the other layers' rows NaN, so reading one would show)
        rings = np.full((B, 3 * W, d), np.nan)
        rings[:, W:2 * W] = ring(xs)
        window = dataclasses.replace(window, need=None, written=jnp.asarray(written),
                                     written_base=jnp.int32(base),
                                     row_valid=jnp.asarray(ring(row_valid, 1)),
                                     x=f(rings), x_row0=jnp.int32(W))
    rope_arg = None if cos is None else (f(cos[:, -1]), f(sin[:, -1]))
    config = AttnConfig(block_s=4, seq_splits=4) if split else None
    out, k2, v2, *rest = head_sparse_attention(
        f(x), f(wq), f(bq), f(wk), f(bk), f(wv), f(bv), f(wo), f(bo), f(kc), f(vc),
        jnp.int32(pos), jnp.asarray(hidx), rope=rope_arg, impl=impl, window=window,
        config=config, kv_mask=None if mask is None else jnp.asarray(mask))
    assert len(rest) == int(bitmap)
    if bitmap:
        np.testing.assert_array_equal(np.asarray(rest[0]), want_written)
    assert _rel(out, ref) < 1e-5
    for got, want in ((k2, want_k), (v2, want_v)):
        got = np.asarray(got, np.float64)
        assert_finite_close(got[:, :, :pos + 1], want[:, :, :pos + 1], rtol=1e-5, atol=1e-5)
        assert np.isnan(got[:, :, pos + 1:]).all()


def _window_call(rng, B=1, d=32, H=4, hd=8, S=16):
    """Positional head_sparse_attention arguments (no biases, heads 0 and 2, pos 5) and a
    random-array maker."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
    return (f(B, d), f(H, hd, d), None, f(H, hd, d), None, f(H, hd, d), None, f(d, H, hd), None,
            f(B, H, S, hd), f(B, H, S, hd), jnp.int32(5), jnp.asarray([0, 2], jnp.int32)), f


def test_window_validation(rng):
    from dejavu_jax.kernels import KVWindow
    B, d = 1, 32
    args, f = _window_call(rng)
    ok = dict(x=f(B, 4, d), current=jnp.int32(3), extra_ids=None,
              need=jnp.ones((B, 2, 4), bool), slots=jnp.arange(2, 6, dtype=jnp.int32))
    head_sparse_attention(*args, window=KVWindow(**ok))
    with pytest.raises(ValueError, match="need"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "need": jnp.ones((B, 3, 4), bool)}))
    with pytest.raises(ValueError, match="window.x"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "x": f(B, 4, d + 1)}))
    with pytest.raises(ValueError, match="current"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "current": jnp.zeros(2, jnp.int32)}))
    with pytest.raises(ValueError, match=r"window.current must lie in \[0, 4\)"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "current": jnp.int32(4)}))
    with pytest.raises(ValueError, match=r"window.slots must lie in \[0, 16\)"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "slots": jnp.arange(14, 18,
                                                                               dtype=jnp.int32)}))
    with pytest.raises(TypeError, match="integer"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "current": jnp.float32(3)}))
    with pytest.raises(ValueError, match="extra_ids"):
        head_sparse_attention(*args, window=KVWindow(**{**ok, "extra_ids": jnp.asarray([9], jnp.int32),
                                                        "need": jnp.ones((B, 3, 4), bool)}))
    with pytest.raises(TypeError, match="KVWindow"):
        head_sparse_attention(*args, window=(1, 2))


def test_head_sparse_attention_traced_pos_in_jit(rng):
    B, d, H, hd, S, Kh = 2, 96, 6, 16, 30, 2
    hidx, arrs = _attn_inputs(rng, B, d, H, H, hd, S, Kh, S, F32, True)  # no position poisoned
    step = jax.jit(lambda pos, *a: head_sparse_attention(*a[:-1], pos, a[-1], impl="interpret"))
    cache_k, cache_v = arrs[9], arrs[10]
    for pos in (0, 13, S - 1):
        ref, _, _ = _np_attention(*arrs[:9], cache_k, cache_v, pos, hidx, None, None, None)
        out, k2, v2 = step(jnp.int32(pos), *(jnp.asarray(a, F32) for a in arrs[:9]),
                           jnp.asarray(cache_k, F32), jnp.asarray(cache_v, F32), jnp.asarray(hidx))
        assert _rel(out, ref) < 1e-5


# ----------------------------------------------------------------------------
# dispatch and input validation
# ----------------------------------------------------------------------------

def test_auto_impl_is_reference_on_cpu():
    assert resolve_impl(None) == "reference"
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda")


def _mlp_args(rng, B=2, d=16, F=40, K=5):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
    return [f(B, d), f(F, d), f(F), f(F, d), f(d), jnp.asarray(rng.permutation(F)[:K], jnp.int32)]


@pytest.mark.parametrize("pos_arg,change,exc,match", [
    (5, lambda a: jnp.asarray([1.0, 2.0]), TypeError, "idx"),               # float indices
    (5, lambda a: jnp.asarray([0, 40], jnp.int32), ValueError, "idx"),     # out of range
    (5, lambda a: jnp.asarray([-1, 3], jnp.int32), ValueError, "idx"),     # negative
    (5, lambda a: jnp.asarray([3, 3], jnp.int32), ValueError, "distinct"),
    (5, lambda a: jnp.zeros((2, 2), jnp.int32), ValueError, "idx"),        # rank 2
    (3, lambda a: a[:, :8], ValueError, "w2t"),                            # w2t width
    (0, lambda a: a[0], ValueError, "x"),                                   # x rank 1
    (1, lambda a: a[:, :15], ValueError, "x"),                              # w1 width vs x
    (2, lambda a: a[:7], ValueError, "b1"),
    (4, lambda a: a[:3], ValueError, "b2"),
])
def test_sparse_mlp_rejects_bad_inputs(rng, pos_arg, change, exc, match):
    args = _mlp_args(rng)
    args[pos_arg] = change(args[pos_arg])
    with pytest.raises(exc, match=match):
        sparse_mlp(*args)


def test_sparse_mlp_rejects_bad_options(rng):
    args = _mlp_args(rng)
    with pytest.raises(ValueError, match="activation"):
        sparse_mlp(*args, activation="tanh")
    with pytest.raises(ValueError, match="w_gate"):
        sparse_mlp(*args, w_gate=args[1][:, :3])
    with pytest.raises(ValueError, match="impl"):
        sparse_mlp(*args, impl="gpu")


def _attn_args(rng, B=2, d=32, H=4, n_kv=4, hd=8, S=10, Kh=2):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
    return [f(B, d), f(H, hd, d), f(H, hd), f(n_kv, hd, d), f(n_kv, hd), f(n_kv, hd, d),
            f(n_kv, hd), f(d, H, hd), f(d), f(B, n_kv, S, hd), f(B, n_kv, S, hd), 3,
            jnp.asarray(rng.permutation(n_kv)[:Kh], jnp.int32)]


@pytest.mark.parametrize("i,change,exc,match", [
    (12, lambda a: jnp.asarray([0, 4], jnp.int32), ValueError, "head_idx"),
    (12, lambda a: a.astype(F32), TypeError, "head_idx"),
    (11, lambda a: 10, ValueError, "pos"),
    (11, lambda a: -1, ValueError, "pos"),
    (11, lambda a: 2.0, TypeError, "pos"),
    (9, lambda a: a[:, :, :, :4], ValueError, "k_cache"),
    (10, lambda a: a[:1], ValueError, "v_cache"),
    (3, lambda a: a[:3], ValueError, "KV heads"),          # 3 KV heads do not divide 4
    (7, lambda a: a[:, :2], ValueError, "wo"),
    (2, lambda a: a[:, :3], ValueError, "bq"),
    (0, lambda a: a[:, :16], ValueError, "wq"),
    (1, lambda a: a[0], ValueError, "wq"),
])
def test_head_sparse_attention_rejects_bad_inputs(rng, i, change, exc, match):
    args = _attn_args(rng)
    args[i] = change(args[i])
    with pytest.raises(exc, match=match):
        head_sparse_attention(*args)


def test_head_sparse_attention_rejects_bad_rope_and_mask(rng):
    args = _attn_args(rng)
    with pytest.raises(ValueError, match="rope"):
        head_sparse_attention(*args, rope=(jnp.ones(5), jnp.ones(5)))
    with pytest.raises(ValueError, match="kv_mask"):
        head_sparse_attention(*args, kv_mask=jnp.ones((2, 9), bool))


@pytest.mark.parametrize("B,seq_splits,hd", [
    (2, 4, 16), (1, 4, 16), (1, 1, 16), (2, 1, 16), (1, 4, 12), (2, 1, 12)])
def test_head_sparse_attention_many_splits(rng, B, seq_splits, hd):
    """Several splits merged in XLA before the out-projection, one split normalised inside
    it; the out-projection's 3-D group-view loads (a power-of-two head width) and its flat
    loads (hd 12), at batch 1 and 2."""
    from dejavu_jax.kernels import AttnConfig
    d, H, S, Kh, pos = 96, 6, 70, 3, 52
    hidx, arrs = _attn_inputs(rng, B, d, H, H, hd, S, Kh, pos, F32, True)
    ref, _, _ = _np_attention(*arrs, pos, hidx, None, None, None)
    cfg = AttnConfig(block_s=16, seq_splits=seq_splits, proj_block_d=32, out_block_d=32)
    out, _, _ = head_sparse_attention(*(None if a is None else jnp.asarray(a, F32) for a in arrs),
                                      pos, jnp.asarray(hidx), impl="interpret", config=cfg)
    assert _rel(out, ref) < 1e-5


# ----------------------------------------------------------------------------
# top-k selection
# ----------------------------------------------------------------------------

def _np_top_k(scores, k):
    """Numpy: top-k of the scores truncated to their upper 16 bits, ties to the lower id."""
    trunc = (np.asarray(scores, np.float32).view(np.int32) & np.int32(-65536)).view(np.float32)
    trunc = trunc.astype(np.float64) + 0.0              # one zero: -0.0 ties with +0.0
    order = np.lexsort((np.arange(len(trunc)), -trunc))
    return np.sort(order[:k])


@pytest.mark.parametrize("n,k,ties", [(1000, 100, False), (37, 1, False), (37, 37, False),
                                      (4096, 410, True), (300, 150, True), (3000, 1500, True)])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("kernel", ["radix", "chunked"])
def test_top_k_indices_matches_numpy(rng, kernel, impl, n, k, ties):
    from dejavu_jax.kernels.top_k import top_k_indices, top_k_indices_chunked
    select = top_k_indices if kernel == "radix" else top_k_indices_chunked
    scores = rng.standard_normal(n).astype(np.float32) * 3
    if ties:  # many equal scores straddle the k-th
        scores = np.round(scores * 2) / 2
    got = np.asarray(select(jnp.asarray(scores), k, impl=impl))
    assert got.dtype == np.int32 and got.shape == (k,)
    np.testing.assert_array_equal(got, _np_top_k(scores, k))
    if not ties:  # against the fp32 top-k it differs only among scores truncating to the k-th
        exact = np.sort(np.argsort(-scores, kind="stable")[:k])
        trunc = (scores.view(np.int32) & np.int32(-65536)).view(np.float32)
        kth = np.sort(trunc)[::-1][k - 1]
        assert (trunc[np.setxor1d(got, exact)] == kth).all()


def test_kth_keys_equal_numpy_per_row(rng):
    """The k-th largest key's search gives numpy's value in every row, with ignored lanes
    (key -1), ties, keys at both ends of the range and k from 1 to all lanes."""
    from dejavu_jax.kernels import top_k
    for lanes, k in [(2048, 205), (300, 1), (300, 300), (64, 17)]:
        keys = rng.integers(0, 1 << 16, size=(6, lanes)).astype(np.int32)
        keys[5] = np.where(np.arange(lanes) < k, 40000, 100)    # a count of exactly k
        keys[1] = rng.integers(32760, 32770, size=lanes)        # many ties
        keys[2, : lanes // 2] = 0
        keys[2, lanes // 2:] = (1 << 16) - 1
        keys[3, k:] = -1                                         # exactly k lanes counted
        keys[4] = rng.integers(0, 3, size=lanes) * 30000
        got = np.asarray(top_k.kth_keys(jnp.asarray(keys), k))
        want = np.sort(keys, axis=1)[:, ::-1][:, k - 1]
        np.testing.assert_array_equal(got, want, err_msg=f"{lanes} {k}")
        one = [int(top_k.kth_keys(jnp.asarray(row), k)) for row in keys]   # row_kth_key
        np.testing.assert_array_equal(one, want, err_msg=f"one row, {lanes} {k}")


def test_one_rows_search_narrow_and_full_ranges_equal_numpy(rng):
    """The one-row search gives numpy's k-th key whether it starts from the range below
    the largest key (Gaussian scores, top 10%) or falls back to the whole range (an
    outlier far above the rest, or the k-th key across zero)."""
    from dejavu_jax.kernels import top_k
    gauss = rng.standard_normal(2048).astype(np.float32)
    outlier = gauss.copy()
    outlier[7] = 1e6
    shifted = gauss - 1.5
    for scores, k, narrow in [(gauss, 205, True), (outlier, 205, False),
                              (shifted, 205, False), (gauss, 1, True), (gauss, 2048, False)]:
        keys = np.asarray(top_k.score_keys(jnp.asarray(scores)))
        want = np.sort(keys)[::-1][k - 1]
        assert ((keys >= keys.max() - top_k.NARROW_KEYS).sum() >= k) == narrow
        assert int(top_k.row_kth_key(jnp.asarray(keys), k)) == want


def test_top_k_indices_validation():
    from dejavu_jax.kernels.top_k import top_k_indices
    with pytest.raises(ValueError, match="k=0"):
        top_k_indices(jnp.ones(5), 0)
    with pytest.raises(ValueError, match="rank 1"):
        top_k_indices(jnp.ones((2, 5)), 1)


def test_window_rejects_a_callable_rope_and_missing_tables(rng):
    from dejavu_jax.kernels import KVWindow
    B, d, hd = 1, 32, 8
    args, f = _window_call(rng)
    window = KVWindow(x=f(B, 4, d), current=jnp.int32(3), extra_ids=None,
                      need=jnp.ones((B, 2, 4), bool), slots=jnp.arange(2, 6, dtype=jnp.int32))
    with pytest.raises(ValueError, match="callable rope"):
        head_sparse_attention(*args, rope=lambda t: t, window=window)
    with pytest.raises(ValueError, match="exactly when rope"):
        head_sparse_attention(*args, rope=(jnp.ones(hd), jnp.zeros(hd)), window=window)


def _np_norm(x, scale, bias, eps=1e-5):
    """Numpy LayerNorm (bias given) or RMSNorm (None) of the rows of x, times scale."""
    if bias is None:
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale
    xc = x - x.mean(-1, keepdims=True)
    return xc / np.sqrt(np.mean(xc * xc, -1, keepdims=True) + eps) * scale + bias


@pytest.mark.parametrize("rows,d,rms,out", [(1, 7168 // 64, False, jnp.bfloat16),
                                            (3, 100, True, F32), (2, 64, False, F32),
                                            (1, 576, True, jnp.bfloat16)])
def test_layer_norm_kernel_equals_numpy(rng, rows, d, rms, out):
    from dejavu_jax.kernels import layer_norm
    x = rng.standard_normal((rows, d)) * 3 + 1.5
    scale, bias = rng.standard_normal(d), None if rms else rng.standard_normal(d)
    want = _np_norm(x, scale, bias)
    f = lambda a: None if a is None else jnp.asarray(a, F32)
    for impl in ("interpret", "reference"):
        got = layer_norm(f(x), f(scale), f(bias), 1e-5, out_dtype=out, impl=impl)
        assert got.dtype == out and got.shape == x.shape
        tol = 1e-5 if out == F32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    # leading axes are rows too
    got = layer_norm(f(x)[None], f(scale), f(bias), 1e-5, impl="interpret")
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want, rtol=1e-5, atol=1e-5)


def test_layer_norm_rejects_bad_shapes():
    from dejavu_jax.kernels import layer_norm
    with pytest.raises(ValueError, match="scale"):
        layer_norm(jnp.ones((2, 8)), jnp.ones(7), None, 1e-5)
    with pytest.raises(ValueError, match="bias"):
        layer_norm(jnp.ones((2, 8)), jnp.ones(8), jnp.ones(9), 1e-5)


@pytest.mark.parametrize("B,d", [(3, 100), (1, 64)])
def test_layer_norm_runs_riders_in_its_launch(rng, B, d):
    """Another kernel's launch part (a gathered product on its own input) rides in the
    norm's launch: both results equal numpy; the jnp path refuses riders."""
    from dejavu_jax.kernels import layer_norm
    from dejavu_jax.kernels.gather_matvec import Segment, gather_matvec_part
    x = rng.standard_normal((B, d)) * 2 + 0.5
    scale, bias = rng.standard_normal(d), rng.standard_normal(d)
    w, u = rng.standard_normal((48, d)), rng.standard_normal((B, d))
    ids = np.array([2, 0], np.int32)          # rows 32..47 and 0..15 of w, 16 per id
    part = gather_matvec_part(jnp.asarray(u, F32), [Segment(jnp.asarray(w, F32),
                                                            jnp.asarray(ids), 16)],
                              block_rows=16, block_d=32)
    y, ((parts,),) = layer_norm(jnp.asarray(x, F32), jnp.asarray(scale, F32),
                                jnp.asarray(bias, F32), 1e-5, impl="interpret", riders=[part])
    np.testing.assert_allclose(np.asarray(y, np.float64), _np_norm(x, scale, bias),
                               rtol=1e-5, atol=1e-5)
    want = u @ np.concatenate([w[32:48], w[0:16]]).T
    got = np.asarray(parts, np.float64).sum(0)[:, :32]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="Pallas"):
        layer_norm(jnp.asarray(x, F32), jnp.asarray(scale, F32), None, 1e-5,
                   impl="reference", riders=[part])


@pytest.mark.parametrize("B,d,rms_norm,out", [(1, 7168 // 64, False, F32), (2, 100, True, F32),
                                              (3, 64, False, jnp.bfloat16), (1, 576, True, F32)])
def test_layer_norm_rms_output_equals_numpy(rng, B, d, rms_norm, out):
    """The optional second output: the rows over their RMS (the predictors' input)."""
    from dejavu_jax.kernels import layer_norm
    x = rng.standard_normal((B, d)) * 3 + 1.5
    scale, nbias = rng.standard_normal(d), None if rms_norm else rng.standard_normal(d)
    want = _np_norm(x, scale, nbias)
    want_rms = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    f = lambda a: None if a is None else jnp.asarray(a, F32)
    for impl in ("interpret", "reference"):
        y, rms = layer_norm(f(x), f(scale), f(nbias), 1e-5, out_dtype=out,
                            rms_dtype=jnp.bfloat16, impl=impl)
        assert y.dtype == out and rms.dtype == jnp.bfloat16
        tol = 1e-4 if out == F32 else 1e-2
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(rms, np.float64), want_rms, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("B,d,R,row,rms,ring_dtype", [(1, 100, 16, 5, True, jnp.bfloat16),
                                                      (3, 64, 4, 3, False, F32)])
def test_layer_norm_writes_the_ring_row(rng, impl, B, d, R, row, rms, ring_dtype):
    """With a ring, the launch also writes the normed rows (rounded to out_dtype, then the
    ring's dtype) at ring_row, a traced index; every other ring row is left as it was."""
    from dejavu_jax.kernels import layer_norm
    x = rng.standard_normal((B, d)) * 2 + 0.5
    scale, nbias = rng.standard_normal(d), rng.standard_normal(d)
    ring = rng.standard_normal((B, R, d))
    f = lambda a: jnp.asarray(a, F32)
    fn = jax.jit(lambda x, ring, r: layer_norm(
        x, f(scale), f(nbias), 1e-5, out_dtype=jnp.bfloat16,
        rms_dtype=jnp.bfloat16 if rms else None, ring=ring, ring_row=r, impl=impl))
    *first, new_ring = fn(f(x), jnp.asarray(ring, ring_dtype), jnp.int32(row))
    assert len(first) == 1 + rms and new_ring.dtype == ring_dtype
    y = np.asarray(first[0].astype(F32), np.float64)
    want = _np_norm(x, scale, nbias)
    np.testing.assert_allclose(y, want, rtol=1e-2, atol=1e-2)
    got = np.asarray(new_ring.astype(F32), np.float64)
    np.testing.assert_array_equal(got[:, row], y)                # the out_dtype values
    keep = np.arange(R) != row
    np.testing.assert_array_equal(got[:, keep],
                                  np.asarray(jnp.asarray(ring, ring_dtype).astype(F32))[:, keep])


def test_layer_norm_ring_validation():
    from dejavu_jax.kernels import layer_norm
    x, s = jnp.zeros((2, 8)), jnp.ones(8)
    with pytest.raises(ValueError, match="ring must be"):
        layer_norm(x, s, None, 1e-5, ring=jnp.zeros((2, 4, 7)), ring_row=0)
    with pytest.raises(ValueError, match="needs ring_row"):
        layer_norm(x, s, None, 1e-5, ring=jnp.zeros((2, 4, 8)))
    with pytest.raises(ValueError, match=r"\[B, d\]"):
        layer_norm(x[None], s, None, 1e-5, ring=jnp.zeros((2, 4, 8)), ring_row=0)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("B", [1, 3])
def test_residual_outputs_add_into_the_rows(rng, impl, B):
    """With residual rows, the MLP and attention outputs come back added to them (fp32),
    the out-projection / fc2 chunks accumulated in the launch; extra projection segments
    return their own products."""
    from dejavu_jax.kernels import head_sparse_attention, sparse_mlp
    from dejavu_jax.kernels.gather_matvec import Segment
    d, F, K, H, hd, S = 64, 256, 40, 4, 16, 8
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
    x, res = f(B, d), f(B, d) * 3
    w1, b1, w2t, b2 = f(F, d) * 0.2, f(F), f(F, d) * 0.2, f(d)
    idx = jnp.asarray(np.sort(rng.choice(F, K, replace=False)), jnp.int32)
    xn, w1n, w2n = (np.asarray(a, np.float64) for a in (x, w1, w2t))
    hidden = np.maximum(xn @ w1n[np.asarray(idx)].T + np.asarray(b1)[np.asarray(idx)], 0)
    want = np.asarray(res) + hidden @ w2n[np.asarray(idx)] + np.asarray(b2)
    got = sparse_mlp(x, w1, b1, w2t, b2, idx, residual=res, impl=impl)
    assert got.dtype == F32 and got.shape == (B, d)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)

    w = [f(H, hd, d) * 0.2, f(H, hd), f(H, hd, d) * 0.2, f(H, hd), f(H, hd, d) * 0.2,
         f(H, hd), f(d, H, hd) * 0.2, f(d)]
    kc, vc = f(B, H, S, hd), f(B, H, S, hd)
    hidx = jnp.asarray([0, 2], jnp.int32)
    plain = head_sparse_attention(x, *w, kc, vc, jnp.int32(5), hidx, impl="reference")
    seg_w, seg_x = f(12, d), f(1, d)
    seg = Segment(seg_w, jnp.asarray([2], jnp.int32), 4, x=seg_x)
    out, k2, v2, extras = head_sparse_attention(x, *w, kc, vc, jnp.int32(5), hidx,
                                                residual=res, extra_segments=(seg,), impl=impl)
    assert out.dtype == F32
    np.testing.assert_allclose(np.asarray(out), np.asarray(res) + np.asarray(plain[0]),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(k2), np.asarray(plain[1]), rtol=1e-5, atol=1e-5)
    seg_want = np.asarray(seg_x, np.float64) @ np.asarray(seg_w, np.float64)[8:12].T
    np.testing.assert_allclose(np.asarray(extras[0]).sum(0)[:, :4], seg_want, rtol=1e-4,
                               atol=1e-4)
    with pytest.raises(TypeError, match="float32"):
        sparse_mlp(x, w1, b1, w2t, b2, idx, residual=res.astype(jnp.bfloat16), impl=impl)
    with pytest.raises(ValueError, match="residual"):
        head_sparse_attention(x, *w, kc, vc, jnp.int32(5), hidx, residual=res[:, :8], impl=impl)


def test_balanced_chunks_split_evenly():
    from dejavu_jax.kernels._common import balanced_chunks
    for n in range(1, 40):
        for want in range(0, 45):
            c = balanced_chunks(n, want)
            runs = -(-n // c)
            assert 1 <= c <= max(1, min(n, want)) or (want < 1 and c == 1)
            assert runs == -(-n // max(1, min(n, want)))   # no more runs than needed
            assert n - (runs - 1) * c <= c                 # the last run is no longer
    assert balanced_chunks(14, 9) == 7 and balanced_chunks(14, 100) == 14


def test_layer_norm_wide_rows_take_the_reference():
    from dejavu_jax.kernels import layer_norm
    from dejavu_jax.kernels.layer_norm import MAX_WIDTH
    d = MAX_WIDTH + 8
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, d)), F32)
    y = layer_norm(x, jnp.ones(d), None, 1e-5, impl="interpret")
    want = np.asarray(x) / np.sqrt(np.mean(np.asarray(x, np.float64) ** 2) + 1e-5)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
