"""Sparse decode parity against dense: density 1.0, oracle masking, lookahead, missing KV."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import model, sparse
from dejavu_jax.generation import dense_engine, generate_tokens

HF = Path(__file__).parent / "fixtures" / "hf"


def _full_sets(config):
    L = config.n_layers
    return (jnp.tile(jnp.arange(config.ffn, dtype=jnp.int32), (L, 1)),
            jnp.tile(jnp.arange(config.n_heads, dtype=jnp.int32), (L, 1)))


def _full_sparse(config, **kw):
    L = config.n_layers
    return sparse.SparseConfig((config.ffn,) * L, (config.n_heads,) * L, dense_layers=1, **kw)


def _run_both(config, params, scfg, sets, prompts, steps, selector=sparse.fixed_selector,
              dense=True):
    """Dense and sparse step logits for teacher-forced random continuation tokens (`sets`:
    the selector's params); dense=False: the sparse ones only (None for the dense)."""
    ids, mask = (jnp.asarray(a) for a in __import__(
        "dejavu_jax.generation", fromlist=["left_pad"]).left_pad(prompts))
    B = ids.shape[0]
    eng = sparse.sparse_engine(config, scfg, selector)
    s_state = eng.init_state(B, 64, jnp.float32)
    d_logits = None
    if dense:
        d_state = model.init_state(config, B, 64, jnp.float32)
        d_logits, d_state = model.prefill(config, params, ids, mask, d_state)
    s_logits, s_state = jax.jit(eng.prefill)((params, sets), ids, mask, s_state)
    step = jax.jit(eng.step)
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (steps, B))
    out = [(None if d_logits is None else np.asarray(d_logits), np.asarray(s_logits))]
    for t in range(steps):
        tok = jnp.asarray(tokens[t], jnp.int32)
        if dense:
            d_logits, d_state = model.decode_step(config, params, d_state, tok)
        s_logits, s_state = step((params, sets), s_state, tok)
        out.append((None if d_logits is None else np.asarray(d_logits), np.asarray(s_logits)))
    return out


@pytest.mark.parametrize("preset,policy", [("opt-tiny", "kernels"), ("llama-tiny", "kernels"),
                                           ("opt-tiny", "union"), ("llama-tiny", "dense"),
                                           ("opt-tiny-gelu", "kernels")],
                         ids=["opt-kernels", "llama-kernels", "opt-union-dense-layer",
                              "llama-batch-dense", "opt-gelu-kernels"])
def test_density_one_equals_dense_every_step(preset, policy):
    """Two prompts, every unit selected: through the kernels' batch path (policy
    "kernels"), through XLA's dense layer, which a union of everything runs under "union",
    and under "dense", where a batch runs every layer dense. OPT with the exact gelu: the
    kernels' activation is the dense model's."""
    config = (dj.preset("opt-tiny").replace(activation="gelu") if preset == "opt-tiny-gelu"
              else dj.preset(preset))
    params = dj.init_params(config, jax.random.key(1), jnp.float32, std=0.1)
    scfg = _full_sparse(config, kv_window=4, batch_policy=policy)
    for dense_logits, sparse_logits in _run_both(config, params, scfg, _full_sets(config),
                                                 [[5, 9, 14, 3], [8, 2]], steps=9):
        assert np.abs(dense_logits - sparse_logits).max() <= 1e-5


@pytest.mark.parametrize("prompts", [[[5, 9, 14, 3]], [[5, 9, 14, 3], [8, 2]]],
                         ids=["batch1", "batch2"])
def test_local_predictor_selection_at_density_one_equals_dense(prompts):
    """Predictors choosing with the "local" method at density 1, on an FFN width (2,101)
    whose last chunk of 2,048 scores is the shorter: every neuron runs, so each step's
    logits are the dense model's."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    config = dj.preset("opt-tiny").replace(ffn=2101, n_layers=3)
    params = dj.init_params(config, jax.random.key(6), jnp.float32, std=0.1)
    preds = decode_predictors(random_predictors(config, 8, jax.random.key(7)))
    scfg = _full_sparse(config)
    select = sparse.predictor_selector(config.group_size, method="local")
    for dense_logits, sparse_logits in _run_both(config, params, scfg, preds, prompts,
                                                 steps=3, selector=select):
        assert_finite_close(sparse_logits, dense_logits, atol=1e-5)


def test_density_one_through_pallas_interpret_kernels():
    config = dj.preset("llama-tiny").replace(n_layers=2)
    params = dj.init_params(config, jax.random.key(2), jnp.float32, std=0.1)
    scfg = _full_sparse(config, impl="interpret")
    for dense_logits, sparse_logits in _run_both(config, params, scfg, _full_sets(config),
                                                 [[5, 9, 14]], steps=2):
        assert np.abs(dense_logits - sparse_logits).max() <= 1e-5


def _silence_group0(config, params):
    """Zero the out-projection of KV group 0's query heads: skipping them changes nothing
    downstream, so the sparse run's residual stream equals the dense run's, and the
    group's recomputed K/V can be compared with the dense cache exactly."""
    wo = params.layers.wo.at[:, :, :config.group_size].set(0.0)
    return params.replace(layers=params.layers.replace(wo=wo))


@pytest.mark.parametrize("impl", [None, "interpret"])
def test_missing_kv_is_recomputed_when_a_head_returns(impl):
    """Through the jnp reference and through the Pallas kernels (interpreted), where the
    window rides on the projection launch."""
    config = dj.preset("opt-tiny")
    if impl == "interpret":
        config = config.replace(n_layers=2)
    params = _silence_group0(config, dj.init_params(config, jax.random.key(3), jnp.float32,
                                                    std=0.1))
    L, F, H = config.n_layers, config.ffn, config.n_heads
    # no round-robin refresh, so head 0's entries stay missing until it is selected
    scfg = sparse.SparseConfig((F,) * L, (H - 1,) * L + (), dense_layers=1, kv_window=16,
                               kv_refresh=0, impl=impl)
    scfg_all = sparse.SparseConfig((F,) * L, (H,) * L, dense_layers=1, kv_window=16,
                                   kv_refresh=0, impl=impl)
    skip = (jnp.tile(jnp.arange(F, dtype=jnp.int32), (L, 1)),
            jnp.tile(jnp.arange(1, H, dtype=jnp.int32), (L, 1)))  # head 0 never selected
    ids = jnp.asarray([[5, 9, 14, 3]])
    mask = jnp.ones_like(ids)
    eng_skip = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    eng_all = sparse.sparse_engine(config, scfg_all, sparse.fixed_selector)
    state = eng_skip.init_state(1, 64, jnp.float32)
    d_state = model.init_state(config, 1, 64, jnp.float32)
    _, state = jax.jit(eng_skip.prefill)((params, skip), ids, mask, state)
    _, d_state = model.prefill(config, params, ids, mask, d_state)
    tokens = [17, 23, 40, 2, 99]
    for tok in tokens:  # head 0 of layers >= 1 skipped: its K/V stay missing
        _, state = jax.jit(eng_skip.step)((params, skip), state, jnp.asarray([tok]))
        d_logits, d_state = model.decode_step(config, params, d_state, jnp.asarray([tok]))
    written = np.asarray(state.written)[0, 1:, 0, 4:4 + len(tokens)]
    assert not written.any(), "skipped heads must leave their entries unwritten"
    assert np.abs(np.asarray(state.dense.k)[0, 1:, 0, 4:9]).max() == 0.0
    # now every head is selected: missing entries are recomputed and logits equal dense
    s_logits, state = jax.jit(eng_all.step)((params, _full_sets(config)), state,
                                            jnp.asarray([7]))
    d_logits, d_state = model.decode_step(config, params, d_state, jnp.asarray([7]))
    assert np.abs(np.asarray(s_logits) - np.asarray(d_logits)).max() <= 1e-5
    assert_finite_close(np.asarray(state.dense.k), np.asarray(d_state.k), atol=1e-5)
    assert_finite_close(np.asarray(state.dense.v), np.asarray(d_state.v), atol=1e-5)


@pytest.mark.parametrize("preset,refresh,unrolled", [("llama-tiny", None, False),
                                                     ("opt-tiny", 1, False),
                                                     ("llama-tiny", None, True)])
def test_bounded_window_refresh_keeps_kv_exact(preset, refresh, unrolled):
    """Unrolled: per-layer weights, caches and input rings (the GPU layout)."""
    from dejavu_jax.params import unstack_layers
    config = dj.preset(preset)
    params = _silence_group0(config, dj.init_params(config, jax.random.key(4), jnp.float32,
                                                    std=0.1))
    d_params = params
    L, F, Hk, H, G = (config.n_layers, config.ffn, config.n_kv_heads, config.n_heads,
                      config.group_size)
    W = 4 if refresh is None else Hk  # the round-robin covers every group within W tokens
    skip = (jnp.tile(jnp.arange(F, dtype=jnp.int32), (L, 1)),       # group 0's query
            jnp.tile(jnp.arange(G, H, dtype=jnp.int32), (L, 1)))     # heads never selected
    scfg = sparse.SparseConfig((F,) * L, (H - G,) * L, dense_layers=1, kv_window=W,
                               kv_refresh=refresh)
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    ids = jnp.asarray([[5, 9, 14]])
    state = eng.init_state(1, 64, jnp.float32, per_layer=unrolled)
    if unrolled:
        params = unstack_layers(params)
        assert isinstance(state.history, tuple) and state.history[0].shape == (1, W, 64)
    d_state = model.init_state(config, 1, 64, jnp.float32)
    _, state = jax.jit(eng.prefill)((params, skip), ids, jnp.ones_like(ids), state)
    _, d_state = model.prefill(config, d_params, ids, jnp.ones_like(ids), d_state)
    step = jax.jit(eng.step)
    for tok in range(20, 20 + 3 * W):  # entries older than the window exist
        _, state = step((params, skip), state, jnp.asarray([tok]))
        _, d_state = model.decode_step(config, d_params, d_state, jnp.asarray([tok]))
    # every entry that left the window was refreshed: it equals the dense cache
    stacked = lambda c: np.stack(c, axis=1) if isinstance(c, tuple) else np.asarray(c)
    k_sparse, k_dense = stacked(state.dense.k), np.asarray(d_state.k)
    v_sparse, v_dense = stacked(state.dense.v), np.asarray(d_state.v)
    last = int(state.dense.slot) - 1               # the last token's slot
    old = last - W + 2                             # slots < old have left the window
    assert_finite_close(k_sparse[:, :, :, :old], k_dense[:, :, :, :old], atol=1e-5)
    assert_finite_close(v_sparse[:, :, :, :old], v_dense[:, :, :, :old], atol=1e-5)
    # group 0 is never selected, so its entries were written by refreshes alone
    assert np.asarray(state.written)[0, :, :, :old].all()


def test_lookahead_uses_the_previous_layers_input():
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    L = config.n_layers
    seen = {}

    def recording_selector(sets, layer, x, k_mlp, k_heads):
        jax.debug.callback(lambda l, v: seen.setdefault(int(l), np.asarray(v)), layer, x)
        return sparse.fixed_selector(sets, layer, x, k_mlp, k_heads)

    scfg = _full_sparse(config)
    eng = sparse.sparse_engine(config, scfg, recording_selector)
    prompt = [5, 9, 14, 3]
    ids = jnp.asarray([prompt])
    state = eng.init_state(1, 32, jnp.float32)
    _, state = jax.jit(eng.prefill)((params, _full_sets(config)), ids, jnp.ones_like(ids),
                                    state)
    _, state = jax.jit(eng.step)((params, _full_sets(config)), state, jnp.asarray([42]))
    jax.effects_barrier()
    full = jnp.asarray([prompt + [42]])
    _, _, records = model.sequence_forward(config, params, full, jnp.ones_like(full),
                                           records=True)
    attn_in = np.asarray(records["attn_in"])[:, 0, -1]  # [L, d] at the decoded token
    for layer in range(1, L):
        assert_finite_close(seen[layer], attn_in[layer - 1][None], atol=1e-5,
                                   err_msg=f"layer {layer} predicted from the wrong input")
        assert not np.allclose(seen[layer], attn_in[layer][None], atol=1e-3)


def _numpy_masked_dense(config, params, ids, n_prompt, k_mlp, k_heads, dense_layers):
    """Independent float64 numpy OPT (pre-LN) with per-position top-k masking.

    Positions >= n_prompt in layers >= dense_layers keep only the top-k neurons by |act|
    and the top-k heads by ||H_i W_O^i||; prompt positions are dense (dense prefill).
    """
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    lay = p.layers
    T = len(ids)
    hd = config.head_dim

    def ln(x, s, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + config.norm_eps) * s + b

    x = p.embed[ids] + p.pos_embed[np.arange(T) + 2]
    for l in range(config.n_layers):
        y = ln(x, lay.attn_norm_scale[l], lay.attn_norm_bias[l])
        q = (np.einsum("td,hkd->thk", y, lay.wq[l]) + lay.bq[l]) * hd ** -0.5
        k = np.einsum("td,hkd->thk", y, lay.wk[l]) + lay.bk[l]
        v = np.einsum("td,hkd->thk", y, lay.wv[l]) + lay.bv[l]
        s = np.einsum("thk,shk->hts", q, k) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        heads = np.einsum("hts,shk->thk", a, v)
        per_head = np.einsum("thk,dhk->thd", heads, lay.wo[l])
        if l >= dense_layers:
            norms = np.linalg.norm(per_head, axis=-1)
            for t in range(n_prompt, T):
                drop = np.argsort(-norms[t])[k_heads:]
                per_head[t, drop] = 0
        h = x + per_head.sum(1) + lay.bo[l]
        y2 = ln(h, lay.mlp_norm_scale[l], lay.mlp_norm_bias[l])
        act = np.maximum(y2 @ lay.w_in[l].T + lay.b_in[l], 0)
        if l >= dense_layers:
            for t in range(n_prompt, T):
                act[t, np.argsort(-np.abs(act[t]))[k_mlp:]] = 0
        x = h + act @ lay.w_out_t[l] + lay.b_out[l]
    x = ln(x, p.final_norm_scale, p.final_norm_bias)
    return x @ p.embed.T


def _tiny_oracle(k_mlp: int = 40, k_heads: int = 2):
    """(config, params, engine) of tiny OPT under the oracle keeping k_mlp neurons and
    k_heads heads per token, the first layer dense."""
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(6), jnp.float32, std=0.15)
    scfg = sparse.sparse_config(config, k_mlp / config.ffn, k_heads / config.n_heads,
                                dense_layers=1, oracle=True)
    return config, params, sparse.sparse_engine(config, scfg, sparse.no_selector)


def test_oracle_equals_numpy_masked_dense():
    k_mlp, k_heads = 40, 2
    config, params, eng = _tiny_oracle(k_mlp, k_heads)
    prompt, continuation = [5, 9, 14, 3], [42, 7, 300, 11]
    ids = jnp.asarray([prompt])
    state = eng.init_state(1, 32, jnp.float32)
    logits, state = jax.jit(eng.prefill)((params, None), ids, jnp.ones_like(ids), state)
    got = [np.asarray(logits[0])]
    step = jax.jit(eng.step)  # eagerly, each of the step's ops would compile by itself
    for tok in continuation[:-1]:
        logits, state = step((params, None), state, jnp.asarray([tok]))
        got.append(np.asarray(logits[0]))
    want = _numpy_masked_dense(config, params, prompt + continuation[:-1], len(prompt),
                               k_mlp, k_heads, dense_layers=1)
    dense = np.asarray(dj.logits(config, params, [prompt + continuation[:-1]]))[0]
    for i, g in enumerate(got):
        pos = len(prompt) - 1 + i
        assert_finite_close(g, want[pos], atol=1e-4, err_msg=f"position {pos}")
    assert np.abs(got[-1] - dense[-1]).max() > 1e-3, "masking had no effect: weak test"


def test_oracle_batch_masks_each_row_by_its_own_top_k():
    """Two prompts of different lengths decoded together under the oracle: each row keeps
    its own top-k heads and neurons, so its logits are the numpy masked-dense reference
    of that prompt alone (not the batch's union)."""
    from dejavu_jax.generation import left_pad
    k_mlp, k_heads = 40, 2
    config, params, eng = _tiny_oracle(k_mlp, k_heads)
    prompts, continuation = [[5, 9, 14, 3], [8, 2]], [[42, 17], [7, 300], [11, 60]]
    ids, mask = (jnp.asarray(a) for a in left_pad(prompts, config.pad_token_id))
    state = eng.init_state(2, 32, jnp.float32)
    logits, state = jax.jit(eng.prefill)((params, None), ids, mask, state)
    got = [np.asarray(logits)]
    step = jax.jit(eng.step)
    for toks in continuation[:-1]:
        logits, state = step((params, None), state, jnp.asarray(toks))
        got.append(np.asarray(logits))
    for row, prompt in enumerate(prompts):
        text = prompt + [c[row] for c in continuation[:-1]]
        want = _numpy_masked_dense(config, params, text, len(prompt), k_mlp, k_heads,
                                   dense_layers=1)
        for i, g in enumerate(got):
            assert_finite_close(g[row], want[len(prompt) - 1 + i], atol=1e-4,
                                err_msg=f"row {row}, step {i}")


@pytest.mark.parametrize("name", ["opt-preln", "llama-gqa"])
def test_density_one_greedy_matches_hugging_face(name):
    config, params = dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)
    ref = np.load(HF / name / "reference.npz")
    scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=1)
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    want = ref["generated_ids"].tolist()
    got = generate_tokens(eng, (params, _full_sets(config)), [ref["prompt_ids"].tolist()],
                          max_new_tokens=len(want), stop_ids=[])
    assert got.tokens[0] == want
    dense = generate_tokens(dense_engine(config), params, [ref["prompt_ids"].tolist()],
                            max_new_tokens=len(want), stop_ids=[])
    assert dense.tokens == got.tokens


def test_sparse_config_validation():
    config = dj.preset("opt-tiny")
    with pytest.raises(ValueError, match="entries"):
        sparse.sparse_config(config, [0.5, 0.5])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        sparse.sparse_config(config, 0.0)
    scfg = sparse.sparse_config(config, 0.1, 0.5, dense_layers=1)
    assert scfg.mlp_k == (256, 26, 26, 26) and scfg.head_k == (4, 2, 2, 2)
    # unnamed, the first 2 layers run dense, fewer in a model of 1 or 2 layers
    for L, dense in ((1, 0), (2, 1), (3, 2), (4, 2)):
        scfg = sparse.sparse_config(config.replace(n_layers=L), 0.1, 0.5)
        assert scfg.dense_layers == dense
        assert scfg.mlp_k == (256,) * dense + (26,) * (L - dense)
    # a numpy array of densities is one per layer; text, flags and fractional layer counts
    # are refused
    arr = sparse.sparse_config(config, np.asarray([1.0, 0.5, 0.25, 0.1]), 0.5, dense_layers=0)
    assert arr.mlp_k == (256, 128, 64, 26)
    for bad in (dict(mlp_density="0.5"), dict(mlp_density=True), dict(head_density=[0.5, "1"]),
                dict(dense_layers=1.5), dict(dense_layers=True)):
        with pytest.raises(ValueError, match="density|dense_layers"):
            sparse.sparse_config(config, **{"mlp_density": 0.5, **bad})
    # the missing-KV window is a whole number of tokens; a numpy integer is one
    assert sparse.sparse_config(config, 0.5, kv_window=np.int64(3)).kv_window == 3
    for bad in (2.5, "4", True, 0):
        with pytest.raises(ValueError, match="kv_window"):
            sparse.sparse_config(config, 0.5, kv_window=bad)


def test_predicted_sets_without_a_predictor_selector_are_one_clear_error():
    """A config that predicts its sets, built with no_selector, fails at its first step
    with a ValueError saying what to pass, not an AssertionError."""
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    engine = sparse.sparse_engine(config, sparse.sparse_config(config, 0.5, 1.0),
                                  sparse.no_selector)
    with pytest.raises(ValueError, match="predictor_selector"):
        generate_tokens(engine, (params, None), [[2, 5, 6]], max_new_tokens=3)


def test_a_set_of_every_neuron_runs_the_dense_mlp(monkeypatch):
    """Batch 2 at MLP density 0.5: the union's static capacity is every neuron, so the MLP
    runs XLA's dense products (no gather kernel) and the logits stay the dense ones; at
    batch 1 the same density runs the kernel. With every head too, the whole layer is
    the dense one: no attention kernel either; at batch 1 the attention kernel runs. A
    batch whose rows select some heads runs the attention kernel with per-row heads:
    test_a_batch_union_of_some_heads_runs_the_attention_kernel."""
    head_density = 1.0
    from dejavu_jax import kernels
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(3), jnp.float32, std=0.1)
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.5, head_density, dense_layers=1,
                                                    kv_window=4), batch_policy="union")
    calls, attn_calls = [], []
    real, real_attn = kernels.sparse_mlp, kernels.head_sparse_attention
    monkeypatch.setattr(kernels, "sparse_mlp",
                        lambda *a, **kw: calls.append(a[5].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(kernels, "head_sparse_attention",
                        lambda *a, **kw: attn_calls.append(a[12].shape[0])
                        or real_attn(*a, **kw))
    select = sparse.predictor_selector(config.group_size)
    from dejavu_jax.eval.bench_decode import random_predictors
    preds = random_predictors(config, 8, jax.random.key(4))
    eng = sparse.sparse_engine(config, scfg, select)
    prompts = [[5, 9, 14, 3], [8, 2]]
    got = generate_tokens(eng, (params, preds), prompts, 4, stop_ids=[])
    assert calls == [] and attn_calls == []
    want = generate_tokens(dense_engine(config), params, prompts, 4, stop_ids=[])
    assert got.tokens == want.tokens
    generate_tokens(eng, (params, preds), prompts[:1], 2, stop_ids=[])
    assert calls and all(k == config.ffn // 2 for k in calls)
    assert attn_calls and all(k == config.n_kv_heads * head_density for k in attn_calls)


@pytest.mark.parametrize("preset,mlp_share", [("opt-tiny", 2), ("llama-tiny", 4)],
                         ids=["opt-half-masked-dense-mlp", "llama-quarter-kernel"])
def test_a_batch_with_every_head_runs_dense_attention_and_matches_single_rows(
        preset, mlp_share, monkeypatch):
    """Batch 2 with fixed sets of every query head and 1/mlp_share of the neurons: the
    attention is XLA's dense one (no attention kernel); the MLP is XLA's dense one with
    the other neurons masked for half the neurons (>= SparseConfig.batch_dense_mlp), the
    gather kernel for a quarter. Each row's logits at every step equal those of that prompt
    decoded alone, where batch 1 runs the sparse attention and MLP paths with the same sets."""
    from dejavu_jax import kernels
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    L, F = config.n_layers, config.ffn
    k = F // mlp_share
    rng = np.random.default_rng(2)
    neurons = jnp.asarray(np.sort(np.stack([rng.permutation(F)[:k] for _ in range(L)]),
                                  axis=1), jnp.int32)
    sets = (neurons, _full_sets(config)[1])
    scfg = sparse.SparseConfig((k,) * L, (config.n_heads,) * L, dense_layers=1,
                               kv_window=4, batch_policy="union")
    attn_calls, mlp_calls = [], []
    real_attn, real_mlp = kernels.head_sparse_attention, kernels.sparse_mlp
    monkeypatch.setattr(kernels, "head_sparse_attention",
                        lambda *a, **kw: attn_calls.append(a[12].shape[0])
                        or real_attn(*a, **kw))
    monkeypatch.setattr(kernels, "sparse_mlp",
                        lambda *a, **kw: mlp_calls.append(a[0].shape[0]) or real_mlp(*a, **kw))
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    prefill, step = jax.jit(eng.prefill), jax.jit(eng.step)
    prompts = [[5, 9, 14, 3, 7], [8, 2]]
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (4, 2))

    def run(rows):
        ids, mask = (jnp.asarray(a) for a in __import__(
            "dejavu_jax.generation", fromlist=["left_pad"]).left_pad([prompts[r] for r in rows]))
        state = eng.init_state(len(rows), 32, jnp.float32)
        logits, state = prefill((params, sets), ids, mask, state)
        out = []
        for t in range(tokens.shape[0]):
            logits, state = step((params, sets), state, jnp.asarray(tokens[t, rows]))
            out.append(np.asarray(logits))
        return np.stack(out)

    batch = run([0, 1])
    assert attn_calls == []
    assert mlp_calls == ([] if mlp_share == 2 else [2] * len(mlp_calls)) and (
        mlp_share == 2 or mlp_calls)
    for r in range(2):
        alone = run([r])
        assert attn_calls  # batch 1: the sparse attention path
        assert np.abs(batch[:, r] - alone[:, 0]).max() <= 1e-5


def test_a_batch_union_of_some_heads_runs_the_attention_kernel(monkeypatch):
    """Batch 2 at heads 0.25: the rows' union holds half the heads, so the attention kernel
    runs with that many groups (each row with its own heads), and the MLP, whose union is
    every neuron, runs dense."""
    from dejavu_jax import kernels
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(3), jnp.float32, std=0.1)
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.5, 0.25, dense_layers=1,
                                                    kv_window=4), batch_policy="union")
    attn_calls = []
    real_attn = kernels.head_sparse_attention
    monkeypatch.setattr(kernels, "head_sparse_attention",
                        lambda *a, **kw: attn_calls.append(a[12].shape[0])
                        or real_attn(*a, **kw))
    from dejavu_jax.eval.bench_decode import random_predictors
    preds = random_predictors(config, 8, jax.random.key(4))
    eng = sparse.sparse_engine(config, scfg, sparse.predictor_selector(config.group_size))
    generate_tokens(eng, (params, preds), [[5, 9, 14, 3], [8, 2]], 3, stop_ids=[])
    assert attn_calls and all(k == config.n_kv_heads // 2 for k in attn_calls)


@pytest.mark.parametrize("preset,heads,impl", [("opt-tiny", 0.5, None),
                                               ("opt-tiny", 0.5, "interpret"),
                                               ("llama-tiny", 0.25, None),
                                               ("llama-tiny", 0.25, "interpret")])
def test_a_batch_with_per_row_heads_equals_each_row_decoded_alone(preset, heads, impl,
                                                                   monkeypatch):
    """Batch 3 with predictors: each row selects its own query heads and every neuron.
    Llama-tiny's rows (1 of 4 heads each) run the head-sparse kernel with per-row masks,
    the union's weights read once, and a 2-token missing-KV window makes every row
    recompute its own missing entries; OPT-tiny's (2 of 4), whose union's capacity is
    every head, project densely and attend per row (`kernels.row_head_attention`). Each
    row's logits at every step equal that prompt's decoded alone, where batch 1 runs the
    head-sparse kernel with the same heads."""
    from dejavu_jax import kernels
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.generation import left_pad
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    preds = random_predictors(config, 8, jax.random.key(4))
    scfg = dataclasses.replace(sparse.sparse_config(config, 1.0, heads, dense_layers=1,
                                                    kv_window=2),
                               batch_policy="union", impl=impl)
    masks, row_masks = [], []
    real_attn, real_rows = kernels.head_sparse_attention, kernels.row_head_attention
    monkeypatch.setattr(kernels, "head_sparse_attention", lambda *a, **kw: masks.append(
        None if kw["head_mask"] is None else kw["head_mask"].shape) or real_attn(*a, **kw))
    monkeypatch.setattr(kernels, "row_head_attention", lambda *a, **kw: row_masks.append(
        a[4].shape) or real_rows(*a, **kw))
    eng = sparse.sparse_engine(config, scfg, sparse.predictor_selector(config.group_size))
    prefill, step = jax.jit(eng.prefill), jax.jit(eng.step)
    prompts = [[5, 9, 14, 3, 7], [8, 2], [11, 4, 6]]
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (6, 3))

    def run(rows):
        ids, mask = (jnp.asarray(a) for a in left_pad([prompts[r] for r in rows]))
        state = eng.init_state(len(rows), 32, jnp.float32)
        logits, state = prefill((params, preds), ids, mask, state)
        out = [np.asarray(logits)]
        for t in range(tokens.shape[0]):
            logits, state = step((params, preds), state, jnp.asarray(tokens[t, rows]))
            out.append(np.asarray(logits))
        return np.stack(out)

    batch = run([0, 1, 2])
    if preset == "llama-tiny":
        assert masks and all(m is not None and len(m) == 3 and m[0] == 3 for m in masks)
        assert not row_masks
    else:
        assert row_masks and all(m == (3, config.n_kv_heads, 1) for m in row_masks)
        assert not masks
    for r in range(3):
        alone = run([r])
        assert np.isfinite(alone).all()
        assert np.abs(batch[:, r] - alone[:, 0]).max() <= 2e-5


def test_sparse_step_refuses_fused_qkv():
    from dejavu_jax.params import fuse_qkv
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(7), jnp.float32, std=0.1)
    eng = sparse.sparse_engine(config, _full_sparse(config), sparse.fixed_selector)
    with pytest.raises(ValueError, match="fuse_qkv"):
        generate_tokens(eng, (fuse_qkv(params), _full_sets(config)), [[5, 9]], 2, stop_ids=[])



@pytest.mark.parametrize("decode_form", [False, True], ids=["trained-form", "decode-form"])
def test_predictors_of_other_shapes_or_none_are_refused(decode_form):
    """Predictors made for OPT-tiny (256 neurons) on a Llama of 160 neurons gave tokens
    from sets past the weights; no predictors, or model params alone, raised an
    AttributeError or TypeError from inside the step. Each is a ValueError now, and
    predictors of the model's own shapes at density 1 decode as the dense engine does."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predictor_model import decode_predictors

    def preds(config):
        p = random_predictors(config, 8, jax.random.key(2))
        return decode_predictors(p) if decode_form else p

    config = dj.preset("llama-tiny").replace(n_layers=3)
    params = dj.init_params(config, jax.random.key(1), jnp.float32, std=0.1)
    select = sparse.predictor_selector(config.group_size)
    eng = sparse.sparse_engine(config, _full_sparse(config), select)
    want = generate_tokens(dense_engine(config), params, [[5, 9, 14]], 4, stop_ids=[]).tokens
    got = generate_tokens(eng, (params, preds(config)), [[5, 9, 14]], 4, stop_ids=[]).tokens
    assert got == want and len(got[0]) == 4
    other = preds(dj.preset("opt-tiny").replace(n_layers=3))  # d 64 and 4 heads, F 256
    with pytest.raises(ValueError, match="256 neurons.*160"):
        generate_tokens(eng, (params, other), [[5, 9, 14]], 4, stop_ids=[])
    with pytest.raises(ValueError, match="needs predictors"):
        generate_tokens(eng, (params, None), [[5, 9, 14]], 4, stop_ids=[])
    with pytest.raises(ValueError, match=r"\(model params, selector params\)"):
        generate_tokens(eng, params, [[5, 9, 14]], 4, stop_ids=[])


def test_unrolled_layers_equal_stacked_scan():
    from dejavu_jax.params import unstack_layers
    # 3 layers: a dense one and a sparse segment of two (the unrolled programs grow with
    # the layer count, which the comparison does not depend on)
    config = dj.preset("llama-tiny").replace(n_layers=3)
    params = dj.init_params(config, jax.random.key(7), jnp.float32, std=0.1)
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.3, 0.5, dense_layers=1),
                               batch_policy="kernels")
    from dejavu_jax.eval.bench_decode import random_sets
    sets = random_sets(config, scfg, seed=0)
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    prompts = [[5, 9, 14, 3, 7, 8], [4, 4]]
    stacked = generate_tokens(eng, (params, sets), prompts, 5, stop_ids=[])
    unrolled = generate_tokens(eng, (unstack_layers(params), sets), prompts, 5, stop_ids=[])
    assert stacked.tokens == unrolled.tokens
    # per-layer index arrays (what the benchmark passes with unrolled layers)
    per_layer = tuple(tuple(s[l, :k] for l, k in enumerate(ks))
                      for s, ks in zip(sets, (scfg.mlp_k, scfg.head_k)))
    assert generate_tokens(eng, (unstack_layers(params), per_layer), prompts, 5,
                           stop_ids=[]).tokens == stacked.tokens
    with pytest.raises(TypeError, match="static layer ids"):
        generate_tokens(eng, (params, per_layer), prompts, 2, stop_ids=[])
    dense = generate_tokens(dense_engine(config), unstack_layers(params), prompts, 5, stop_ids=[])
    assert dense.tokens == generate_tokens(dense_engine(config), params, prompts, 5,
                                           stop_ids=[]).tokens


def test_layer_unroll_keeps_the_logits():
    """Over stacked weights, a scan of 2 layers per iteration and every layer inlined
    (`layer_unroll` 2 and True) give the one-layer scan's logits; 0 and False are refused."""
    from dejavu_jax.eval.bench_decode import random_sets
    config = dj.preset("llama-tiny")
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    scfg = sparse.sparse_config(config, 0.3, 0.5, dense_layers=1)
    sets = random_sets(config, scfg, seed=2)
    base = _run_both(config, params, scfg, sets, [[5, 9, 14, 3]], 3, dense=False)
    assert scfg.scan_unroll() == 1     # the default off a GPU
    for unroll in (2, True):
        got = _run_both(config, params, dataclasses.replace(scfg, layer_unroll=unroll), sets,
                        [[5, 9, 14, 3]], 3, dense=False)
        for (_, a), (_, b) in zip(base, got):
            assert_finite_close(b, a, atol=1e-6)
    for bad in (0, False):
        with pytest.raises(ValueError, match="layer_unroll"):
            dataclasses.replace(scfg, layer_unroll=bad)


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_stacked_dense_layers_run_in_place_through_the_kernels(preset, monkeypatch):
    """Over stacked weights at batch 1 on the Pallas paths (here the interpreter) the dense
    layers run through the sparse kernels with every unit selected, reading the stack in
    place: no XLA dense layer runs, the MLP kernel gets every neuron (with fc2's narrow
    column blocks, `sparse.in_place_dense_config`; the sparse layers' MLP calls keep the
    configured blocks), and the logits are the dense model's (every layer dense) and the
    per-layer layout's (MLP 0.3 / heads 0.5 after 2 dense layers, which XLA runs). Three layers: the per-layer programs grow with
    the layer count, which none of this depends on."""
    from dejavu_jax.eval.bench_decode import random_sets
    from dejavu_jax.params import unstack_layers
    config = dj.preset(preset).replace(n_layers=3)
    params = dj.init_params(config, jax.random.key(11), jnp.float32, std=0.1)
    dense_layer_calls, mlp_rows = [], []
    real_dense, real_mlp = sparse._dense_layer, sparse.kernels.sparse_mlp
    monkeypatch.setattr(sparse, "_dense_layer",
                        lambda *a, **kw: dense_layer_calls.append(a[3]) or real_dense(*a, **kw))
    monkeypatch.setattr(sparse.kernels, "sparse_mlp", lambda *a, **kw: mlp_rows.append(
        (a[5].shape[-1], kw["config"] and kw["config"].fc2_block_d)) or real_mlp(*a, **kw))

    all_dense = sparse.sparse_config(config, 1.0, 1.0, dense_layers=config.n_layers,
                                     impl="interpret")
    for dense_logits, stacked_logits in _run_both(config, params, all_dense,
                                                  _full_sets(config), [[5, 9, 14, 3]], 4):
        assert_finite_close(stacked_logits, dense_logits, atol=2e-5)
    assert not dense_layer_calls
    assert mlp_rows and set(mlp_rows) == {(config.ffn, sparse.IN_PLACE_DENSE_FC2_BLOCK_D)}

    scfg = sparse.sparse_config(config, 0.3, 0.5, dense_layers=2, impl="interpret")
    sets = random_sets(config, scfg, seed=1)
    mlp_rows.clear()
    stacked = _run_both(config, params, scfg, sets, [[5, 9, 14, 3]], 4, dense=False)
    assert not dense_layer_calls
    assert (config.ffn, sparse.IN_PLACE_DENSE_FC2_BLOCK_D) in mlp_rows   # layers 0 and 1
    assert any(rows < config.ffn and block is None for rows, block in mlp_rows)
    unrolled = _run_both(config, unstack_layers(params), scfg, sets, [[5, 9, 14, 3]], 4,
                         dense=False)
    assert dense_layer_calls     # the per-layer layout runs XLA's dense layers
    for (_, a), (_, b) in zip(stacked, unrolled):
        assert_finite_close(a, b, atol=2e-5)


def test_kernel_configs_reach_the_kernels(monkeypatch):
    """SparseConfig.attn_config / mlp_config are the configs the step's kernels receive."""
    from dejavu_jax import kernels
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(3), jnp.float32, std=0.1)
    attn_cfg = kernels.AttnConfig(out_num_warps=2, out_block_rows=4)
    mlp_cfg = kernels.MLPConfig(num_stages=3)
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.5, 0.5, dense_layers=1),
                               attn_config=attn_cfg, mlp_config=mlp_cfg)
    seen = []
    for name in ("sparse_mlp", "head_sparse_attention"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _n=name, **kw:
                            seen.append((_n, kw["config"])) or _real(*a, **kw))
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    generate_tokens(eng, (params, _full_sets(config)), [[5, 9]], 2, stop_ids=[])
    assert {n for n, _ in seen} == {"sparse_mlp", "head_sparse_attention"}
    assert all(c is (attn_cfg if n == "head_sparse_attention" else mlp_cfg) for n, c in seen)


@pytest.mark.parametrize("method", ["exact", "threshold", "local"])
def test_a_batch_selects_the_union_of_its_rows_sets(method):
    """Three rows at MLP density 0.25 (union capacity 0.75 F): every method's neuron set
    holds every row's exact top-k of the predictor scores, as distinct ascending ids."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.sparse_variants import variant_selector
    from dejavu_jax.train.predict import predictor_scores
    config = dj.preset("opt-tiny")
    preds = random_predictors(config, 8, jax.random.key(4))
    x = jax.random.normal(jax.random.key(6), (3, config.hidden))
    k = config.ffn // 4
    neurons, heads = variant_selector(config.group_size, method)(preds, 2, x, k, 2)
    scores, head_scores = map(np.asarray, predictor_scores(preds, 2, x))
    union = set(np.argsort(-scores, axis=1)[:, :k].reshape(-1).tolist())
    got = np.asarray(neurons)
    assert got.shape == (3 * k,) and np.all(np.diff(got) > 0) and union <= set(got.tolist())
    # heads: each row its own top 2, ascending
    np.testing.assert_array_equal(heads, np.sort(np.argsort(-head_scores, axis=1)[:, :2], 1))


def test_a_local_union_of_more_rows_than_the_union_kernel_holds():
    """65 rows choosing "local" (`kernels.union_select` holds 64 in a program): the neuron
    set holds every row's exact top-k at the union's static size min(F, k B), each row
    keeps its own top head, and a batch of 65 prompts decodes under the union policy."""
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.predict import predictor_scores
    config = dj.preset("opt-tiny")
    preds = random_predictors(config, 8, jax.random.key(4))
    B, k = 65, 3
    select = sparse.predictor_selector(config.group_size, method="local")
    x = jax.random.normal(jax.random.key(6), (B, config.hidden))
    neurons, heads = select(preds, 2, x, k, 1)
    scores, head_scores = map(np.asarray, predictor_scores(preds, 2, x))
    got = np.asarray(neurons)
    union = set(np.argsort(-scores, axis=1)[:, :k].reshape(-1).tolist())
    assert got.shape == (min(config.ffn, k * B),) and np.all(np.diff(got) > 0)
    assert union <= set(got.tolist()) and got.min() >= 0 and got.max() < config.ffn
    np.testing.assert_array_equal(np.asarray(heads)[:, 0], np.argmax(head_scores, axis=1))
    params = dj.init_params(config, jax.random.key(1), jnp.float32, std=0.1)
    scfg = dataclasses.replace(sparse.sparse_config(config, k / config.ffn, 0.25,
                                                    dense_layers=1), batch_policy="union")
    prompts = [[5 + row, 9, 14][:1 + row % 3] for row in range(B)]
    out = generate_tokens(sparse.sparse_engine(config, scfg, select), (params, preds),
                          prompts, 3, stop_ids=[])
    assert [len(t) for t in out.tokens] == [3] * B
    assert all(0 <= i < config.vocab_size for t in out.tokens for i in t)


@pytest.mark.parametrize("where,value,message", [
    ("neuron", 500, "layer 1 holds id 500, outside"), ("neuron", -1, "holds id -1"),
    ("head", 4, "fixed head sets: layer 1 holds id 4"), ("neuron", 0, "repeats an id"),
    ("narrow", None, "layer 1 has 40 ids, the SparseConfig reads 80")])
def test_fixed_sets_past_the_weights_or_repeated_are_refused(where, value, message):
    """Fixed sets of every unit decode Hugging Face's greedy logits; an id past the weights
    (clamped by the gathers), a repeated id (its unit counted twice) or fewer ids than the
    config's k raise ValueError from generate_tokens and the engine's step."""
    config, params = dj.load_pretrained(HF / "llama-gqa", dtype=jnp.float32, progress=False)
    ref = np.load(HF / "llama-gqa" / "reference.npz")
    L = config.n_layers
    scfg = sparse.SparseConfig((config.ffn // 2,) * L, (config.n_heads,) * L, dense_layers=1)
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    neurons = np.tile(np.arange(config.ffn // 2, dtype=np.int32), (L, 1))
    heads = np.tile(np.arange(config.n_heads, dtype=np.int32), (L, 1))
    prompt = ref["prompt_ids"][None]
    state = eng.init_state(1, 32, jnp.float32)
    _, state = eng.prefill((params, None), prompt, np.ones_like(prompt), state)
    full = sparse.SparseConfig((config.ffn,) * L, (config.n_heads,) * L, dense_layers=1)
    full_sets = (np.tile(np.arange(config.ffn, dtype=np.int32), (L, 1)), heads)
    out = generate_tokens(sparse.sparse_engine(config, full, sparse.fixed_selector),
                          (params, full_sets), [ref["prompt_ids"].tolist()],
                          max_new_tokens=len(ref["generated_ids"]), stop_ids=[])
    assert out.tokens[0] == ref["generated_ids"].tolist()
    if where == "narrow":
        neurons = neurons[:, :40]
    elif where == "neuron":
        neurons[1, 1] = value
    else:
        heads[1, 0] = value
    with pytest.raises(ValueError, match=message):
        generate_tokens(eng, (params, (neurons, heads)), [[5, 6, 7]], max_new_tokens=2)
    with pytest.raises(ValueError, match=message):
        eng.step((params, (neurons, heads)), state, jnp.asarray(ref["generated_ids"][:1]))


@pytest.mark.parametrize("bad,message", [
    (lambda z: z[:, :2], r"thresholds must be \[layers, sites\]"),
    (lambda z: np.concatenate([z, z[:1]]), r"thresholds must be \[layers, sites\]"),
    (lambda z: np.where(z == 0, np.nan, z), "finite numbers >= 0"),
    (lambda z: z - 1.0, "finite numbers >= 0")], ids=["sites", "layers", "nan", "negative"])
def test_thresholds_of_another_shape_or_not_finite_are_refused(bad, message):
    """Zero thresholds at every site decode Hugging Face's greedy ids; a table of another
    shape (whose missing sites or layers the gathers clamp) or with NaN or negative values
    raises ValueError from generate_tokens and the engine's step."""
    from dejavu_jax.activation_sparsity import SITES
    config, params = dj.load_pretrained(HF / "llama-gqa", dtype=jnp.float32, progress=False)
    ref = np.load(HF / "llama-gqa" / "reference.npz")
    eng = sparse.sparse_engine(config, sparse.threshold_config(config, SITES),
                               sparse.no_selector)
    zeros = np.zeros((config.n_layers, len(SITES)), np.float32)
    want = ref["generated_ids"].tolist()
    out = generate_tokens(eng, (params, zeros), [ref["prompt_ids"].tolist()],
                          max_new_tokens=len(want), stop_ids=[])
    assert out.tokens[0] == want
    prompt = ref["prompt_ids"][None]
    state = eng.init_state(1, 32, jnp.float32)
    _, state = eng.prefill((params, None), prompt, np.ones_like(prompt), state)
    with pytest.raises(ValueError, match=message):
        generate_tokens(eng, (params, bad(zeros)), [[5, 6, 7]], max_new_tokens=2)
    with pytest.raises(ValueError, match=message):
        eng.step((params, bad(zeros)), state, jnp.asarray(ref["generated_ids"][:1]))
