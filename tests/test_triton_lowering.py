"""Every Pallas kernel lowers through the Triton backend, checked on a CPU-only machine.

Lowering for the "cuda" platform runs the Pallas-to-Triton translation in Python, where
type errors of a kernel on the GPU path surface (the interpreter, which the numerical
tests use, does not see them). The GPU description is H200's; nothing is compiled or run.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

import dejavu_jax as dj
from dejavu_jax import kernels, model, sparse
from dejavu_jax.eval.kernel_parity import KERNELS_ON

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.fixture(autouse=True)
def h200_description(monkeypatch):
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)


def lowers(fn, *args):
    """The StableHLO text of fn lowered for CUDA (raises where a kernel cannot lower)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_launch_sites(text):
    """{kernel name: call sites} of the Triton launches in lowered text: a launch inside a
    private function counts once per call of that function, through any nesting."""
    funcs = {}
    for func in re.split(r"(?=func\.func )", text):
        header = re.match(r"func\.func (public|private) @([\w$.-]+)\(", func)
        if header is not None:
            funcs[header[2]] = (header[1], func)

    @functools.cache
    def calls(name):
        if funcs[name][0] == "public":
            return 1
        return sum(n * calls(caller) for caller, (_, body) in funcs.items()
                   if caller != name and (n := body.count(f"call @{name}(")))

    sites = {}
    for name, (_, body) in funcs.items():
        for line in body.splitlines():
            if "@__gpu$xla.gpu.triton" in line:
                kernel = re.search(r'\bname = "([^"]+)"', line)[1]
                sites[kernel] = sites.get(kernel, 0) + calls(name)
    return sites


def triton_kernels_ir(text):
    """[(kernel name, its Triton IR as text)] of the Triton launches in lowered text: the
    launch's bytecode attribute unescaped and parsed with the Triton dialect."""
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir
    ctx = ir.Context()
    triton.dialect.register_dialect(ctx)
    kernels_ir = []
    for line in text.splitlines():
        if "@__gpu$xla.gpu.triton" not in line:
            continue
        escaped = re.search(r'\bir = "((?:[^"\\]|\\.)*)"', line)[1]
        code = re.sub(rb"\\([0-9A-Fa-f]{2}|\\|\")",
                      lambda m: bytes([int(m[1], 16)]) if len(m[1]) == 2 else m[1],
                      escaped.encode("latin-1"))
        with ctx:
            kernels_ir.append((re.search(r'\bname = "([^"]+)"', line)[1],
                               str(ir.Module.parse(code))))
    return kernels_ir


def z(*shape, dtype=BF16):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("gated,residual,activation", [
    (False, False, "relu"), (False, True, "relu"), (True, True, "silu"),
    (False, True, "gelu"),                # OPT's exact gelu: erf from exp, no erf in Triton
    (True, True, "gelu_tanh")])
def test_sparse_mlp_lowers(B, gated, residual, activation):
    d, F, K = 576, 1536, 200
    args = [z(B, d), z(F, d), z(F), z(F, d), z(d), jnp.arange(K, dtype=jnp.int32),
            z(F, d) if gated else None, z(B, d, dtype=F32) if residual else None]
    text = lowers(lambda *a: kernels.sparse_mlp(*a[:6], w_gate=a[6], residual=a[7],
                                                activation=activation, impl="pallas"), *args)
    assert text.count("gather_matvec") >= 2


@pytest.mark.parametrize("B,n_kv,rope,window,residual,masked,softcap", [
    (1, 8, False, True, True, False, None),
    (2, 4, True, True, True, True, 50.0),       # a query-head mask (GQA), Gemma 2's cap
    (1, 4, True, True, True, True, None),
    (1, 8, False, False, False, False, 50.0),
    (3, 8, False, False, True, False, None),
    (16, 4, False, True, True, False, None)])
def test_head_sparse_attention_lowers(B, n_kv, rope, window, residual, masked, softcap):
    from dejavu_jax.kernels.gather_matvec import Segment
    d, H, hd, S, W = 512, 8, 64, 64, 16
    w = [z(H, hd, d), z(H, hd), z(n_kv, hd, d), z(n_kv, hd), z(n_kv, hd, d), z(n_kv, hd),
         z(d, H, hd), z(d)]
    hidx = jnp.asarray([0, 2], jnp.int32)
    win = None
    if window:
        win = kernels.KVWindow(x=z(B, W, d), current=jnp.int32(3),
                               extra_ids=jnp.asarray([1], jnp.int32),
                               need=jnp.ones((B, 3, W), bool),
                               slots=jnp.arange(W, dtype=jnp.int32),
                               cos=z(B, W, hd, dtype=F32) if rope else None,
                               sin=z(B, W, hd, dtype=F32) if rope else None)
    rope_now = (z(B, hd, dtype=F32), z(B, hd, dtype=F32)) if rope else None
    seg = Segment(z(3 * 512, d), jnp.asarray([1], jnp.int32), 512, x=z(1, d))
    head_mask = jnp.asarray([[True, False], [False, False]]) if masked else None

    def fn(x, caches, res):
        return kernels.head_sparse_attention(
            x, *w, *caches, jnp.int32(20), hidx, rope=rope_now, window=win, residual=res,
            extra_segments=(seg,) if B == 1 else (), head_mask=head_mask, softcap=softcap,
            impl="pallas")

    text = lowers(fn, z(B, d), (z(B, n_kv, S, hd), z(B, n_kv, S, hd)),
                  z(B, d, dtype=F32) if residual else None)
    assert "head_sparse_decode_attention" in text


@pytest.mark.parametrize("G,softcap", [(1, None), (2, 30.0)])
def test_row_head_attention_lowers(G, softcap):
    B, n_kv, hd, S = 4, 4, 64, 64
    mask = jnp.ones((B, n_kv, G), bool)
    text = lowers(lambda q, k, v: kernels.row_head_attention(
        q, k, v, jnp.int32(9), mask, softcap=softcap, impl="pallas"),
        z(B, n_kv * G, hd, dtype=F32), z(B, n_kv, S, hd), z(B, n_kv, S, hd))
    assert "head_sparse_decode_attention" in text


@pytest.mark.parametrize("B", [1, 3])
def test_column_gather_lowers(B):
    """Both out-projection loads: flat (any head width) and 3-D group view (power of two),
    with and without an id mask."""
    import functools
    from dejavu_jax.kernels.column_gather import gather_cols_matvec
    from dejavu_jax.kernels.gather_matvec import batch_pad
    from dejavu_jax.kernels.head_attention import merged_attention_loader
    load = functools.partial(merged_attention_loader, ns=0, B=B, Bp=batch_pad(B), hd=128)
    for group_view, mask in ((False, None), (True, None), (False, [1, 0, 1]), (True, [0, 1, 1])):
        id_mask = None if mask is None else jnp.asarray(mask, bool)
        text = lowers(lambda a, w, r: gather_cols_matvec(
            [a], load, w, jnp.asarray([3, 0, 5], jnp.int32), B=B, cols_per_id=128,
            group_view=group_view, residual=r, bias=w[:, 0], id_mask=id_mask),
            z(1, B, 384, dtype=F32), z(1000, 768), z(B, 1000, dtype=F32))
        assert "gather_cols_matvec" in text


def test_norms_top_k_and_predictor_select_lower():
    from dejavu_jax.kernels.predictor_select import predictor_select
    from dejavu_jax.kernels.top_k import top_k_indices_chunked, top_k_indices_local
    lowers(lambda x: kernels.layer_norm(x, x[0], None, 1e-5, impl="pallas"), z(2, 576))
    lowers(lambda x: kernels.layer_norm(x, x[0], x[0], 1e-5, rms_dtype=BF16, impl="pallas"),
           z(2, 768, dtype=F32))
    text = lowers(lambda x, ring, r: kernels.layer_norm(x, x[0], x[0], 1e-5, out_dtype=BF16,
                                                        rms_dtype=BF16, ring=ring, ring_row=r,
                                                        impl="pallas"),
                  z(2, 768, dtype=F32), z(2, 16, 768), jnp.int32(3))
    assert "layer_norm" in text
    s = z(28672, dtype=F32)
    for fn in (kernels.top_k_indices, top_k_indices_chunked, top_k_indices_local):
        lowers(lambda v, fn=fn: fn(v, 2867, impl="pallas"), s)
    from dejavu_jax.kernels.union_select import union_top_k_local
    for B in (4, 16):
        text = lowers(lambda v: union_top_k_local(v, 2867, impl="pallas"), z(B, 28672, dtype=F32))
        assert "union_top_k_local" in text
    from dejavu_jax.kernels.batch_predictor_select import batch_predictor_select
    for B in (4, 16):
        text = lowers(lambda *a: batch_predictor_select(*a, jnp.int32(1), 2867, 28,
                                                        impl="pallas"),
                      z(B, 7168), z(2, 512, 7168), z(2, 512, dtype=F32), z(2, 256, 28672),
                      z(2, 28672, dtype=F32), z(2, 256, 56), z(2, 56, dtype=F32))
        assert "batch_predictor_select" in text
    L, r, F, H = 2, 256, 28672, 56
    for deferred, warps in ((False, None), (True, 1)):
        lowers(lambda *a: predictor_select(*a, jnp.int32(1), 2867, 28, impl="pallas",
                                           deferred_sum=deferred, select_warps=warps),
               z(2, 1, 2 * r, dtype=F32), z(L, 2 * r, dtype=F32), z(L, r, F),
               z(L, F, dtype=F32), z(L, r, H), z(L, H, dtype=F32))


@pytest.mark.parametrize("preset,batch,split,stacked,unroll", [
    ("opt-tiny", 1, True, False, 1), ("opt-tiny", 2, False, False, 1),
    ("llama-tiny", 1, False, False, 1), ("opt-tiny", 1, True, True, 1),
    ("opt-tiny", 1, True, True, True), ("opt-tiny", 1, True, True, 4)])
def test_sparse_decode_step_lowers(preset, batch, split, stacked, unroll):
    """The whole sparse decode step on the GPU path: dense layers, fused norms, windowed
    attention, residual-accumulating launches, the split predictor; per-layer weights or
    stacked ones (a scan, kernels indexing all layers' weights by global ids, or with
    `layer_unroll` True every layer inlined: no device loop)."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.params import unstack_layers
    from dejavu_jax.train.predictor_model import decode_predictors
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(0), BF16)
    if not stacked:
        params = unstack_layers(params)
    # batch_policy "kernels": a batch would otherwise run XLA's dense layers
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.25, 0.5, dense_layers=1,
                                                    impl="pallas"), batch_policy="kernels",
                               layer_unroll=unroll)
    preds = decode_predictors(random_predictors(config, 16, jax.random.key(1)))
    select = sparse.predictor_selector(config.group_size, method="local", impl="pallas")
    assert select.splits(preds, batch) == split
    eng = sparse.sparse_engine(config, scfg, select)
    state = jax.eval_shape(lambda: eng.init_state(batch, 32, BF16, per_layer=not stacked))
    text = lowers(eng.step, (params, preds), state, jnp.zeros((batch,), jnp.int32))
    # the split selection rides in the MLP launches (the launches' names join their parts')
    batch1_launch = lambda name: re.search(rf"(?<!batch_){name}", text) is not None
    assert batch1_launch("predictor_scores_gather_matvec") == split
    assert batch1_launch("predictor_select_gather_matvec_t") == split
    assert "layer_norm" in text
    # a batch: the union of its rows' neurons and each row's heads, selected in the MLP
    # launches too (`kernels.batch_predictor_select`)
    assert ("batch_predictor_scores_gather_matvec" in text) == (batch > 1)
    assert ("batch_predictor_select_gather_matvec_t" in text) == (batch > 1)
    # whose first product rides in the MLP norm's launch (2 rows of 2 heads each: every
    # head, so the projection is XLA's)
    assert ("gather_matvec_layer_norm" in text) == (batch > 1)
    # the dense layer: XLA's products over per-layer weights; over stacked ones the kernels
    # with every unit selected, reading the stack in place (no XLA product of a layer's
    # MLP weights, which would copy its slice out of the stack first)
    products = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    mlp_weights = f"tensor<{config.ffn}x{config.hidden}xbf16>"
    assert any(mlp_weights in line for line in products) == (not stacked)
    if stacked:   # the window's rows are read in place among every layer's rings
        W, d = scfg.kv_window, config.hidden
        assert not re.findall(rf"stablehlo\.(?:dynamic_)?slice[^\n]*-> "
                              rf"tensor<{batch}x1x{W}x{d}xbf16>$", text, re.M)
    if stacked and split:   # the selection writes ids offset into the flattened weights:
        # no XLA add of the carried sets to the layer's offset inside the loop
        for k in (scfg.mlp_k[-1], scfg.head_k[-1]):
            assert not [line for line in text.splitlines() if "stablehlo.add" in line
                        and "iterArg" in line and f"tensor<{k}xi32>" in line]
    # one device loop per segment (the dense layer, the sparse ones), also where a segment
    # has no more layers than a scan turn runs (inlined, it would delay the step's start)
    assert text.count("stablehlo.while") == (2 if stacked and unroll is not True else 0)


def test_batch_heads_selected_in_the_fc1_launch_lower():
    """The benchmark variant with a batch's heads selected beside the score product: the
    fc1 launch holds the heads' program, the fc2 launch the union's chunk programs alone."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.params import unstack_layers
    from dejavu_jax.sparse_variants import variant_selector
    from dejavu_jax.train.predictor_model import decode_predictors
    config = dj.preset("opt-tiny")
    params = unstack_layers(dj.init_params(config, jax.random.key(0), BF16))
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.1, 0.25, dense_layers=1,
                                                    impl="pallas"), batch_policy="union")
    preds = decode_predictors(random_predictors(config, 16, jax.random.key(1)))
    launches = {}
    for name in ("local", "local-heads-in-fc1"):
        eng = sparse.sparse_engine(config, scfg, variant_selector(config.group_size, name,
                                                                 impl="pallas"))
        state = jax.eval_shape(lambda: eng.init_state(2, 32, BF16, per_layer=True))
        text = lowers(eng.step, (params, preds), state, jnp.zeros((2,), jnp.int32))
        launches[name] = set(re.findall(r'\bname = "([^"]+)"', text))
    assert {"batch_predictor_scores_gather_matvec",
            "batch_predictor_select_gather_matvec_t"} <= launches["local"]
    assert {"batch_predictor_scores_batch_predictor_heads_gather_matvec",
            "batch_predictor_union_gather_matvec_t"} <= launches["local-heads-in-fc1"]
    assert "batch_predictor_select_gather_matvec_t" not in launches["local-heads-in-fc1"]


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_dense_decode_step_lowers(preset, monkeypatch):
    """The dense decode step as a GPU runs it: `kernels._common.resolve_impl` picks Pallas
    when the default backend is a GPU, so the step's sublayer norms (`ops.norm_input`)
    become the Pallas layer-norm kernel, one Triton launch in the layer scan's body for
    the attention norm and one for the MLP norm."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(0), BF16)
    state = jax.eval_shape(lambda: model.init_state(config, 1, 32, BF16))
    text = lowers(lambda p, s, t: model.decode_step_fn(config, p, s, t), params, state,
                  jnp.zeros((1,), jnp.int32))
    assert triton_launch_sites(text) == {"layer_norm": 2}


def evict_first_loads(text):
    """{kernel name: its loads with the evict-first hint} in lowered text."""
    counts = {}
    for name, code in triton_kernels_ir(text):
        counts[name] = counts.get(name, 0) + code.count("evictionPolicy = evict_first")
    return counts


@pytest.mark.parametrize("B,masked", [(1, False), (3, True)])
def test_attention_evict_hint_reaches_the_weight_loads(B, masked):
    """`AttnConfig.evict_first` marks the q/k/v projection's and the out-projection's
    weight loads (not the attention's cache reads), and only when set."""
    d, H, n_kv, hd, S = 512, 8, 4, 64, 64
    w = [z(H, hd, d), z(H, hd), z(n_kv, hd, d), z(n_kv, hd), z(n_kv, hd, d), z(n_kv, hd),
         z(d, H, hd), z(d)]
    head_mask = jnp.asarray([[True, False], [True, True]]) if masked else None
    hints = []
    for evict in (False, True):
        fn = functools.partial(kernels.head_sparse_attention, impl="pallas",
                               head_mask=head_mask, config=kernels.AttnConfig(evict_first=evict))
        hints.append(evict_first_loads(lowers(
            fn, z(B, d), *w, z(B, n_kv, S, hd), z(B, n_kv, S, hd), jnp.int32(9),
            jnp.asarray([0, 2], jnp.int32))))
    assert set(hints[0].values()) == {0}
    assert hints[1]["head_sparse_decode_attention"] == 0
    assert hints[1]["gather_matvec"] >= 3 and hints[1]["gather_cols_matvec"] >= 1


@pytest.mark.parametrize("gated", [False, True])
def test_mlp_evict_hint_reaches_the_weight_loads(gated):
    """`MLPConfig.evict_first` marks fc1's (and the gate's) and fc2's row loads."""
    d, F, K = 576, 1536, 200
    args = [z(1, d), z(F, d), z(F), z(F, d), z(d), jnp.arange(K, dtype=jnp.int32),
            z(F, d) if gated else None]
    hints = [evict_first_loads(lowers(lambda *a: kernels.sparse_mlp(
        *a[:6], w_gate=a[6], activation="silu", impl="pallas",
        config=kernels.MLPConfig(evict_first=evict)), *args)) for evict in (False, True)]
    assert hints[0] and set(hints[0].values()) == {0}
    assert hints[1]["gather_matvec"] == (2 if gated else 1)   # fc1's rows (and the gate's)
    assert hints[1]["gather_matvec_t"] >= 1                   # fc2's rows


def test_input_sparse_gemv_loads_with_the_evict_hint_by_default():
    """The input-sparse GEMV's measured default: its weight rows carry the hint."""
    from dejavu_jax.kernels.threshold_matvec import threshold_matvec
    d, F = 1536, 8960
    on, off = (evict_first_loads(lowers(
        lambda x, w: threshold_matvec(x, w, jnp.float32(0.1), impl="pallas", **kw),
        z(1, d), z(d, F))) for kw in ({}, {"evict_first": False}))
    assert sum(on.values()) >= 1 and sum(off.values()) == 0


@pytest.mark.parametrize("B", [1, 3])
def test_threshold_kernels_lower(B):
    """The activation-sparse kernels at Qwen2.5-1.5B's MLP shapes: the input-sparse GEMV
    (partials and the residual path, also under the block switches), the row-masked GEMV
    and the gated MLP's unit finish."""
    from dejavu_jax.kernels.gated_hidden import gated_hidden
    from dejavu_jax.kernels.threshold_matvec import row_masked_matvec, threshold_matvec
    d, F = 1536, 8960
    t = jnp.float32(0.1)
    lowers(lambda x, w: threshold_matvec(x, w, t, impl="pallas"), z(B, d), z(d, F))
    lowers(lambda x, w, r, b: threshold_matvec(x, w, t, residual=r, bias=b, impl="pallas"),
           z(B, F), z(F, d), z(B, d, dtype=F32), z(d))
    lowers(lambda x, w, k: row_masked_matvec(x, w, k, impl="pallas"), z(B, d), z(F, d),
           jnp.zeros((F,), bool))
    lowers(lambda g, u, b, w: gated_hidden(g, u, t, activation="silu", b_in=b, gate_weight=w,
                                           impl="pallas"),
           z(64, B, F, dtype=F32), z(64, B, F, dtype=F32), z(F), z(F, dtype=F32))
    for atomics in (True, False):  # the block switches
        switched = functools.partial(threshold_matvec, impl="pallas", evict_first=True,
                                     columns_first=True, residual_atomics=atomics,
                                     deferred_sum=True)
        lowers(lambda x, w, r, b: switched(x, w, t, residual=r, bias=b),
               z(B, F), z(F, d), z(B, d, dtype=F32), z(d))


@pytest.mark.parametrize("up_rows,unrolled", [(False, True), (True, True), (False, False),
                                              (True, False)])
def test_threshold_decode_step_lowers(up_rows, unrolled):
    """The threshold decode step of a gated model on input-major weights: with TEAL's
    sites the gate and up projections share one launch, under the gate site the up
    projection reads neuron rows; q/k/v, the out-projection and the down projection one
    input-sparse launch each, in every layer. Over stacked weights (one `lax.scan` turn
    per layer on this host) each launch takes every layer's rows whole and the layer
    index, and no weight matrix is sliced."""
    from dejavu_jax.params import input_major, unstack_layers
    config = dj.preset("llama-tiny")
    params = input_major(dj.init_params(config, jax.random.key(0), BF16), up_rows=up_rows)
    if unrolled:
        params = unstack_layers(params)
    sites = ("qkv", "o", "gate_up", "down") + (("gate",) if up_rows else ())
    scfg = sparse.threshold_config(config, sites, impl="pallas")
    thresholds = jnp.full((config.n_layers, 5), 0.1, F32)

    def lowered(scfg):
        eng = sparse.sparse_engine(config, scfg, sparse.no_selector)
        state = jax.eval_shape(lambda: eng.init_state(1, 32, BF16, per_layer=unrolled))
        return lowers(eng.step, (params, thresholds), state, jnp.zeros((1,), jnp.int32))
    # by default and with every switch on, the gate and up's partials are finished in one
    # launch where both are input-sparse and the attention runs in the decode-attention
    # kernel; with both switches off, in XLA's ops. Under the gate site, the up rows and
    # the units in one launch with every switch on only
    off = dataclasses.replace(kernels.ThresholdConfig(), attention_kernel=False,
                              gated_kernel=False)
    text = lowered(dataclasses.replace(scfg, threshold_blocks=off))
    assert 'name = "gated_hidden"' not in text
    assert 'name = "head_sparse_decode_attention"' not in text
    on = lowered(dataclasses.replace(scfg, threshold_blocks=KERNELS_ON))
    assert ('name = "gated_rows"' in on) == up_rows
    assert 'name = "row_masked_matvec"' not in on
    text = lowered(scfg)
    assert 'name = "gated_rows"' not in text
    assert ('name = "row_masked_matvec"' in text) == up_rows
    for lowering in (on, text):
        assert ('name = "gated_hidden"' in lowering) == (not up_rows)
        assert 'name = "head_sparse_decode_attention"' in lowering
    launches = triton_launch_sites(text)
    L, d, F = config.n_layers, config.hidden, config.ffn
    # every input-sparse launch reads the whole threshold table, never a slice of it
    calls = [line for line in text.splitlines()
             if "@__gpu$xla.gpu.triton" in line and ('name = "threshold_matvec' in line
                                                     or 'name = "row_masked' in line)]
    assert calls and all(f"tensor<{L * 5}xf32>" in line and "tensor<1xf32>" not in line
                         for line in calls if 'name = "threshold_matvec' in line)
    per_call = 1 if unrolled else L   # stacked: every layer's rows, the layer as int32 [1]
    for line in calls:
        weights = re.findall(r"tensor<(\d+)x(\d+)xbf16>", line.split(" : (")[-1])
        assert weights and all(int(rows) in (per_call * d, per_call * F,
                                             per_call * config.n_heads * config.head_dim)
                               for rows, _ in weights), line
        assert ("tensor<1xi32>" in line) != unrolled
    slices = re.findall(r"stablehlo.dynamic_slice[^\n]*-> tensor<(?:1x)?(\d+x\d+)xbf16>", text)
    q_dim, kv_n = config.n_heads * config.head_dim, (config.n_heads + 2 * config.n_kv_heads)
    matrices = {f"{d}x{kv_n * config.head_dim}", f"{q_dim}x{d}", f"{d}x{F}", f"{F}x{d}"}
    assert not matrices & set(slices), slices
    n = L if unrolled else 1
    if up_rows:
        assert launches.get("threshold_matvec") == 4 * n
        assert launches.get("row_masked_matvec") == n
    else:
        assert launches.get("threshold_matvec") == 3 * n
        assert launches.get("threshold_matvec_threshold_matvec") == n
    if not unrolled:  # the scan's body: per layer only the layer's own work
        for lowering in (on, text):
            body = lowering[lowering.index("} do {"):]
            body = body[:body.index("stablehlo.return")]
            assert body.count("@__gpu$xla.gpu.triton") == 6  # q/k/v, attention, out, MLP 3
            assert "stablehlo.cosine" not in body   # the RoPE tables, once per step
            # the written bitmap, marked once for the segment
            assert not re.search(r"dynamic_update_slice[^\n]*xi1>", body)
            assert re.search(r"dynamic_update_slice[^\n]*xi1>", lowering)
            # with the switches on, no XLA merge of the attention's splits, no q/k/v sum
            merged = "stablehlo.exponential" in body
            assert merged == (lowering is text)
            assert not re.search(rf"stablehlo.reduce\([^\n]*tensor<\d+x1x{kv_n * config.head_dim}"
                                 rf"xf32>", body)
