"""The activation-sparse kernels (`kernels.threshold_matvec`) in the Pallas interpreter
against numpy: ragged shapes, one row and several, partials and the residual path."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

from dejavu_jax.kernels.threshold_matvec import (auto_row_blocks, row_masked_matvec,
                                                 threshold_matvec, threshold_matvecs)


def _numpy_threshold(x, w_t, t, residual=None, bias=None):
    xs = np.where(np.abs(x) > t, x, 0.0).astype(np.float64)
    out = xs @ w_t.astype(np.float64)
    if bias is not None:
        out = out + bias
    return out if residual is None else residual + out


@pytest.mark.parametrize("B,K,N,residual,row_blocks", [
    (1, 200, 300, False, 2), (3, 200, 300, False, 2), (1, 96, 640, True, 2),
    (2, 96, 640, True, 2), (1, 300, 200, True, 8), (2, 300, 200, False, 8)])
def test_threshold_matvec_equals_numpy(rng, B, K, N, residual, row_blocks):
    """K and N not multiples of the blocks; about 60% of the channels dropped per row;
    row_blocks 8 takes the kernel's loop over blocks (up to 4 are unrolled)."""
    x = rng.standard_normal((B, K)).astype(np.float32)
    w_t = rng.standard_normal((K, N)).astype(np.float32)
    t = float(np.quantile(np.abs(x), 0.6))
    res = rng.standard_normal((B, N)).astype(np.float32) if residual else None
    bias = rng.standard_normal(N).astype(np.float32) if residual else None
    got = threshold_matvec(jnp.asarray(x), jnp.asarray(w_t), jnp.float32(t),
                           residual=None if res is None else jnp.asarray(res),
                           bias=None if bias is None else jnp.asarray(bias),
                           block_rows=16, block_n=128, row_blocks=row_blocks,
                           impl="interpret")
    assert_finite_close(np.asarray(got), _numpy_threshold(x, w_t, t, res, bias), rtol=1e-5,
                        atol=1e-4)
    ref = threshold_matvec(jnp.asarray(x), jnp.asarray(w_t), jnp.float32(t),
                           residual=None if res is None else jnp.asarray(res),
                           bias=None if bias is None else jnp.asarray(bias),
                           impl="reference")
    assert_finite_close(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("B,residual", [(1, True), (2, True), (1, False), (3, False)])
@pytest.mark.parametrize("switches", [
    dict(columns_first=True), dict(evict_first=True), dict(residual_atomics=False),
    dict(deferred_sum=True),
    dict(columns_first=True, evict_first=True, residual_atomics=False, deferred_sum=True)])
def test_threshold_matvec_switches_equal_numpy(rng, B, residual, switches):
    """The block switches (column blocks first, the evict-first hint, partials summed into
    the residual by XLA, one sum of the rows per program) change how the kernel runs, not
    what it computes."""
    K, N = 200, 300
    x = rng.standard_normal((B, K)).astype(np.float32)
    w_t = rng.standard_normal((K, N)).astype(np.float32)
    t = float(np.quantile(np.abs(x), 0.5))
    res = rng.standard_normal((B, N)).astype(np.float32) if residual else None
    bias = rng.standard_normal(N).astype(np.float32)
    got = threshold_matvec(jnp.asarray(x), jnp.asarray(w_t), jnp.float32(t),
                           residual=None if res is None else jnp.asarray(res),
                           bias=jnp.asarray(bias), block_rows=16, block_n=128, row_blocks=2,
                           impl="interpret", **switches)
    assert got.shape == (B, N)
    assert_finite_close(np.asarray(got), _numpy_threshold(x, w_t, t, res, bias), rtol=1e-5,
                        atol=1e-4)
    if "columns_first" in switches:
        gate, up = threshold_matvecs(jnp.asarray(x), [jnp.asarray(w_t), jnp.asarray(w_t[:, :70])],
                                     jnp.float32(t), block_rows=16, block_n=64, row_blocks=8,
                                     impl="interpret", **switches)
        assert_finite_close(np.asarray(gate), _numpy_threshold(x, w_t, t), rtol=1e-5,
                            atol=1e-4)
        assert_finite_close(np.asarray(up), _numpy_threshold(x, w_t[:, :70], t), rtol=1e-5,
                            atol=1e-4)


@pytest.mark.parametrize("B", [1, 2])
def test_threshold_matvecs_equal_numpy(rng, B):
    """Two matrices of one masked input in one launch, each against numpy."""
    x = rng.standard_normal((B, 150)).astype(np.float32)
    ws = [rng.standard_normal((150, n)).astype(np.float32) for n in (200, 330)]
    t = float(np.quantile(np.abs(x), 0.5))
    got = threshold_matvecs(jnp.asarray(x), [jnp.asarray(w) for w in ws], jnp.float32(t),
                            block_rows=16, block_n=128, row_blocks=8, impl="interpret")
    assert len(got) == 2
    for g, w in zip(got, ws):
        assert_finite_close(np.asarray(g), _numpy_threshold(x, w, t), rtol=1e-5, atol=1e-4)


def test_threshold_matvec_skips_the_rows_it_drops(rng):
    """A dropped channel's weight row is never read: NaN there changes nothing (the
    interpreter's masked loads give the fill value)."""
    x = rng.standard_normal((1, 64)).astype(np.float32)
    x[0, ::2] = 0.01  # below the threshold
    w_t = rng.standard_normal((64, 128)).astype(np.float32)
    poisoned = w_t.copy()
    poisoned[::2] = np.nan
    got = threshold_matvec(jnp.asarray(x), jnp.asarray(poisoned), jnp.float32(0.05),
                           block_rows=16, block_n=128, impl="interpret")
    assert_finite_close(np.asarray(got), _numpy_threshold(x, w_t, 0.05), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("B,per_row", [(1, False), (3, False), (3, True)])
def test_row_masked_matvec_equals_numpy(rng, B, per_row):
    F, d = 300, 200
    x = rng.standard_normal((B, d)).astype(np.float32)
    w = rng.standard_normal((F, d)).astype(np.float32)
    keep = rng.random((B, F) if per_row else F) < 0.4
    w_poisoned = w.copy()
    unread = ~(keep.any(0) if per_row else keep)
    w_poisoned[unread] = np.nan  # rows nobody keeps are never read
    got = row_masked_matvec(jnp.asarray(x), jnp.asarray(w_poisoned), jnp.asarray(keep),
                            block_rows=16, block_d=64, d_chunks=2, impl="interpret")
    want = np.where(keep, x.astype(np.float64) @ w.T.astype(np.float64), 0.0)
    assert_finite_close(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def _numpy_merge(o, m, l):
    """The attention output [B, H * hd] of flash-decoding splits o [S, B, H * hd] with
    score maxima m and sums l [S, B, H], in float64."""
    S, B, K = o.shape
    H = m.shape[-1]
    w = np.exp(m - m.max(axis=0))
    den = (l * w).sum(axis=0)
    num = (o.reshape(S, B, H, K // H) * w[..., None]).sum(axis=0)
    return (num / np.where(den > 0, den, 1.0)[..., None]).reshape(B, K)


@pytest.mark.parametrize("S,B,H,hd,residual", [
    (1, 1, 4, 16, True), (3, 1, 6, 32, True), (5, 1, 3, 16, False), (2, 3, 4, 16, True),
    (7, 2, 2, 32, False)])
def test_threshold_matvec_merges_attention_splits(rng, S, B, H, hd, residual):
    """With `splits` the input is the merge of the attention's flash-decoding splits:
    equal to numpy's merge thresholded and multiplied, for one split and several (S not a
    power of two), one row and several; a split that saw no entry (m = -1e30, o = l = 0)
    adds nothing."""
    K, N = H * hd, 150
    o = rng.standard_normal((S, B, K)).astype(np.float32)
    m = rng.standard_normal((S, B, H)).astype(np.float32) * 3
    l = rng.uniform(0.5, 4.0, (S, B, H)).astype(np.float32)
    if S > 1:
        m[-1, 0, 1], l[-1, 0, 1], o[-1, 0, hd:2 * hd] = -1e30, 0.0, 0.0
    x = _numpy_merge(o.astype(np.float64), m.astype(np.float64), l.astype(np.float64))
    w_t = rng.standard_normal((K, N)).astype(np.float32)
    t = float(np.quantile(np.abs(x), 0.5))
    res = rng.standard_normal((B, N)).astype(np.float32) if residual else None
    for impl in ("interpret", "reference"):
        got = threshold_matvec(jnp.asarray(o), jnp.asarray(w_t), jnp.float32(t),
                               splits=(jnp.asarray(m), jnp.asarray(l)),
                               residual=None if res is None else jnp.asarray(res),
                               block_rows=16, block_n=64, impl=impl)
        assert got.shape == (B, N)
        # the batched kernel multiplies bf16 operands on the tensor cores
        tol = 1e-4 if B == 1 or impl == "reference" else 3e-2
        assert_finite_close(np.asarray(got), _numpy_threshold(x, w_t, t, res), rtol=tol,
                            atol=tol)


def test_bad_splits_are_errors():
    o, w = jnp.zeros((2, 1, 32)), jnp.zeros((32, 8))
    ml = jnp.zeros((2, 1, 4))
    with pytest.raises(ValueError, match="rank 3"):
        threshold_matvec(o[0], w, 0.1, splits=(ml, ml), impl="interpret")
    with pytest.raises(ValueError, match="H dividing"):
        threshold_matvec(o, w, 0.1, splits=(jnp.zeros((2, 1, 5)),) * 2, impl="interpret")
    with pytest.raises(ValueError, match="S=2, B=1"):
        threshold_matvec(o, w, 0.1, splits=(jnp.zeros((3, 1, 4)),) * 2, impl="interpret")
    with pytest.raises(ValueError, match="splits must be"):
        threshold_matvec(o, w, 0.1, splits=ml, impl="interpret")


def test_bad_shapes_are_errors():
    x, w = jnp.zeros((1, 8)), jnp.zeros((9, 4))
    with pytest.raises(ValueError, match="rows"):
        threshold_matvec(x, w, 0.1, impl="interpret")
    with pytest.raises(ValueError, match="keep must be"):
        row_masked_matvec(jnp.zeros((1, 4)), w, jnp.zeros(5, bool), impl="interpret")


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_a_threshold_table_is_read_at_its_index(rng, impl):
    """A [L, sites] table with threshold_index picks one entry, as that scalar would."""
    x = rng.standard_normal((1, 96)).astype(np.float32)
    w_t = rng.standard_normal((96, 160)).astype(np.float32)
    table = rng.uniform(0.1, 1.5, (3, 5)).astype(np.float32)
    for layer, site in ((0, 0), (1, 3), (2, 4)):
        t = float(table[layer, site])
        got = threshold_matvec(jnp.asarray(x), jnp.asarray(w_t), jnp.asarray(table),
                               threshold_index=layer * 5 + site, block_rows=16, block_n=64,
                               impl=impl)
        assert_finite_close(np.asarray(got), _numpy_threshold(x, w_t, t), rtol=1e-5, atol=1e-4)
        gate, up = threshold_matvecs(jnp.asarray(x), [jnp.asarray(w_t), jnp.asarray(w_t[:, :90])],
                                     jnp.asarray(table), threshold_index=layer * 5 + site,
                                     block_rows=16, block_n=64, impl=impl)
        assert_finite_close(np.asarray(up), _numpy_threshold(x, w_t[:, :90], t), rtol=1e-5,
                            atol=1e-4)
    with pytest.raises(ValueError, match="threshold_index=15"):
        threshold_matvec(jnp.asarray(x), jnp.asarray(w_t), jnp.asarray(table),
                         threshold_index=15, impl=impl)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("B", [1, 3])
def test_stacked_weights_are_read_at_the_traced_layer(rng, impl, B):
    """With `layer`, every layer's rows [L * K, N] pass whole and the kernels read one
    layer's (the index traced under jit, as in a scan over layers) with that layer's row of
    the threshold table: each call equals numpy on that layer's matrix; a NaN in every
    other layer's rows changes nothing, so only this layer's rows are fetched."""
    import jax
    L, K, N, F = 3, 100, 90, 70
    x = rng.standard_normal((B, K)).astype(np.float32)
    ws = rng.standard_normal((L, K, N)).astype(np.float32)
    ups = rng.standard_normal((L, K, 40)).astype(np.float32)
    rows = rng.standard_normal((L, F, K)).astype(np.float32)
    keep = rng.random(F) < 0.5
    table = rng.uniform(0.3, 1.2, (L, 4)).astype(np.float32)
    res = rng.standard_normal((B, N)).astype(np.float32)

    @jax.jit
    def calls(layer, ws, ups, rows):
        one = threshold_matvec(jnp.asarray(x), ws.reshape(L * K, N), jnp.asarray(table),
                               threshold_index=2, layer=layer, residual=jnp.asarray(res),
                               block_rows=16, block_n=64, row_blocks=8, impl=impl)
        both = threshold_matvecs(jnp.asarray(x), [ws.reshape(L * K, N), ups.reshape(L * K, 40)],
                                 jnp.asarray(table), threshold_index=1, layer=layer,
                                 block_rows=16, block_n=64, impl=impl)
        masked = row_masked_matvec(jnp.asarray(x), rows.reshape(L * F, K), jnp.asarray(keep),
                                   layer=layer, block_d=64, impl=impl)
        return one, both, masked

    for layer in range(L):
        poison = np.arange(L) != layer
        nan_ws, nan_ups, nan_rows = (np.where(poison[:, None, None], np.nan, w)
                                     for w in (ws, ups, rows))
        for args in ((ws, ups, rows), (nan_ws, nan_ups, nan_rows)):
            if impl == "reference" and args[0] is nan_ws:
                continue   # the reference slices the layer: no claim about what it reads
            one, (gate, up), masked = calls(jnp.int32(layer), *map(jnp.asarray, args))
            assert_finite_close(np.asarray(one), _numpy_threshold(x, ws[layer], table[layer, 2],
                                                                  res), rtol=1e-5, atol=1e-4)
            assert_finite_close(np.asarray(gate), _numpy_threshold(x, ws[layer], table[layer, 1]),
                                rtol=1e-5, atol=1e-4)
            assert_finite_close(np.asarray(up), _numpy_threshold(x, ups[layer], table[layer, 1]),
                                rtol=1e-5, atol=1e-4)
            expected = np.where(keep, x.astype(np.float64) @ rows[layer].T.astype(np.float64), 0)
            assert_finite_close(np.asarray(masked), expected, rtol=1e-5, atol=1e-4)


def test_stacked_weights_refuse_bad_shapes():
    """A layer needs a [L, S] table and rows a whole number of layers."""
    x, w = jnp.zeros((1, 8)), jnp.zeros((24, 4))
    with pytest.raises(ValueError, match=r"table \[L, S\]"):
        threshold_matvec(x, w, jnp.float32(0.1), layer=1, impl="interpret")
    with pytest.raises(ValueError, match="every layer's rows"):
        threshold_matvec(x, jnp.zeros((20, 4)), jnp.ones((3, 4)), layer=1, impl="interpret")
    with pytest.raises(ValueError, match="one index"):
        threshold_matvec(x, w, jnp.ones((3, 4)), layer=jnp.zeros(2, jnp.int32),
                         impl="interpret")
    with pytest.raises(ValueError, match="every layer's rows"):
        row_masked_matvec(x, jnp.zeros((10, 8)), jnp.zeros(4, bool), layer=0, impl="interpret")
    for bad in (3, -1):   # weights of 3 layers: a kernel would read past them
        with pytest.raises(ValueError, match=f"layer={bad} is outside the 3 layers"):
            threshold_matvec(x, w, jnp.ones((3, 4)), layer=bad, impl="interpret")
        with pytest.raises(ValueError, match=f"layer={bad} is outside the 3 layers"):
            row_masked_matvec(x, jnp.zeros((12, 8)), jnp.zeros(4, bool), layer=bad,
                              impl="interpret")
    with pytest.raises(ValueError, match="table has 2 rows for weights of 3 layers"):
        threshold_matvecs(x, [w], jnp.ones((2, 4)), layer=1, impl="interpret")
    with pytest.raises(ValueError, match="no channels"):
        threshold_matvec(jnp.zeros((1, 0)), jnp.zeros((0, 4)), 0.1, impl="interpret")
    with pytest.raises(ValueError, match="no rows"):
        row_masked_matvec(x, jnp.zeros((0, 8)), jnp.zeros(0, bool), layer=0, impl="interpret")


def test_small_matrices_take_fewer_blocks_per_program():
    """Four blocks a program where that leaves two programs per multiprocessor (132 on the
    H200 and off the GPU), fewer for an attention projection of a small model."""
    assert auto_row_blocks(8960, 1536, 16, 512) == 4     # qwen2.5-1.5b down: 140 x 3
    assert auto_row_blocks(4096, 4096, 16, 512) == 4     # llama3-8b o: 64 x 8
    assert auto_row_blocks(4864, 896, 16, 512) == 2      # qwen2.5-0.5b down: 152 x 2
    assert auto_row_blocks(1536, 2048, 16, 512) == 1     # qwen2.5-1.5b q/k/v: 96 x 4
    assert auto_row_blocks(1536, 1536, 16, 512) == 1     # qwen2.5-1.5b o: 96 x 3


def test_block_settings_parse_and_refuse_bad_ones():
    """`bench_thresholds.with_settings` replaces the named sites' fields only, and a bad
    site, field, value or block size is a ValueError naming it."""
    from dejavu_jax.eval.bench_thresholds import block_variants, with_settings
    from dejavu_jax.kernels import ThresholdBlocks, ThresholdConfig
    cfg = with_settings(ThresholdConfig(), "down.row_blocks=8, down.num_stages=3,o.block_n=128")
    assert cfg.down == ThresholdBlocks(row_blocks=8, max_row_blocks=8, num_stages=3)
    assert cfg.o == ThresholdBlocks(block_n=128) and cfg.qkv == cfg.gate_up == ThresholdBlocks()
    assert with_settings(cfg, "down.row_blocks=None").down.row_blocks is None
    switched = with_settings(cfg, "o.evict_first=1,down.residual_atomics=0")
    assert switched.o.evict_first is True and switched.down.residual_atomics is False
    assert switched.qkv == ThresholdBlocks()
    assert ThresholdConfig().attention_kernel is ThresholdConfig().gated_kernel is True
    assert ThresholdConfig().gate_rows_kernel is False
    off = with_settings(cfg, "attention_kernel=0,gated_kernel=0,down.deferred_sum=1,"
                             "gate_rows_kernel=1")
    assert off.attention_kernel is off.gated_kernel is False and off.down.deferred_sum is True
    assert off.gate_rows_kernel is True
    assert off.o == cfg.o and off.down.num_stages == 3
    for bad, match in (("attention_kernel=2", "0 or 1"), ("attention_kernel.x=1", "SWITCH"),
                       ("mlp.row_blocks=8", "SITE.FIELD"), ("down.rows=8", "SITE.FIELD"),
                       ("down.row_blocks", "SITE.FIELD"), ("down.row_blocks=x", "'x'"),
                       ("down.num_stages=None", "'None'"), ("down.block_n=300", "powers of 2"),
                       ("o.row_blocks=0", "at least 1"), ("o.max_row_blocks=0", "at least 1"),
                       ("qkv.num_warps=3", "num_warps"), ("o.evict_first=2", "0 or 1"),
                       ("o.columns_first=yes", "0 or 1")):
        with pytest.raises(ValueError, match=match):
            with_settings(ThresholdConfig(), bad)
    variants = block_variants("a:down.row_blocks=8;b:o.num_stages=3")
    assert [n for n, _ in variants] == ["default", "a", "b"]
    assert variants[0][1] == ThresholdConfig() and variants[1][1].down.row_blocks == 8
    with pytest.raises(ValueError, match="NAME:SETTINGS"):
        block_variants("a:down.row_blocks=8;a:o.num_stages=3")


def test_block_defaults_are_the_kernels_own():
    """`ThresholdBlocks()` passes the kernels' own keyword defaults, so q/k/v, the
    gate and up projections run as the kernels do by default; the out-projection takes 256
    columns a program and the down projection up to 8 blocks in 4 stages."""
    import inspect

    from dejavu_jax.kernels import ThresholdBlocks, ThresholdConfig
    for fn in (threshold_matvec, threshold_matvecs):
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
        assert all(defaults[k] == v for k, v in ThresholdBlocks().kwargs().items())
    cfg = ThresholdConfig()
    assert cfg.qkv == cfg.gate_up == ThresholdBlocks()
    assert cfg.o == ThresholdBlocks(block_n=256)
    # the measured switches: the evict-first hint on, the grid and the residual as before
    assert ThresholdBlocks().evict_first and ThresholdBlocks().residual_atomics
    assert not ThresholdBlocks().columns_first
    assert cfg.down == ThresholdBlocks(max_row_blocks=8, num_stages=4)


@pytest.mark.parametrize("K,N,most,expected", [
    (14336, 4096, 8, 8), (4096, 14336, 4, 4), (8960, 1536, 8, 4), (1536, 2048, 4, 1),
    (576, 1536, 8, 1), (18944, 3584, 8, 8)])
def test_auto_row_blocks_halve_until_every_sm_has_two_programs(monkeypatch, K, N, most,
                                                               expected):
    """`auto_row_blocks` takes `most` blocks a program, or half as many (down to one) where
    more would leave fewer than two programs per multiprocessor (132 here, an H100's or an
    H200's): Llama-3-8B's down projection 8, Qwen2.5-1.5B's 4, its q/k/v 1."""
    from dejavu_jax.kernels import threshold_matvec as module
    monkeypatch.setattr(module, "sm_count", lambda: 132)
    assert auto_row_blocks(K, N, 16, 512, most) == expected
