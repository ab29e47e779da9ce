"""Sparse decoding of Qwen2, Qwen3, Gemma, Gemma 2 and Gemma 3: the tiny random HF
checkpoints in fixtures/hf.

The Qwen2 fixture has q/k/v biases; the Gemma 3 fixture has q/k norms, post-norms,
GeGLU, a query scale other than head_dim^-0.5, per-type RoPE (linear scaling on the
global layer) and a sliding window of 6 tokens on layers 0, 1 and 3; the Gemma 2 fixture
has no q/k norms, attention logits soft-capped at 3 and a 6-token window on layers 0 and
2. Decodes run past the window, so a sparse step that ignored it would not match.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close
from test_eval import _random_predictors
from test_sparse import _full_sets, _full_sparse, _run_both

import dejavu_jax as dj
from dejavu_jax import model, sparse
from dejavu_jax.generation import generate_tokens
from dejavu_jax.train import predict as predict_mod

HF = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ["qwen2", "gemma3", "gemma2", "gemma"]
PROMPTS = [[5, 9, 14, 3], [8, 2]]


def _load(name):
    config, params = dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)
    assert config.family == {"gemma2": "gemma3"}.get(name, name)   # Gemma 2: Gemma 3's layout
    return config, params


@pytest.mark.parametrize("name,prompts", [("qwen2", PROMPTS), ("gemma3", PROMPTS),
                                          ("gemma3", PROMPTS[:1]), ("gemma2", PROMPTS),
                                          ("gemma2", PROMPTS[:1]), ("gemma", PROMPTS)],
                         ids=["qwen2-batch2", "gemma3-batch2", "gemma3-batch1",
                              "gemma2-batch2", "gemma2-batch1", "gemma-batch2"])
def test_density_one_equals_dense_every_step(name, prompts):
    """Every unit selected, through the sparse kernels (their batch path for two rows, the
    batch-1 path for one), kv_window 4: each step's logits equal the dense model's, for 9
    steps past prompts of 4 and 2 tokens (beyond Gemma's 6-token window)."""
    config, params = _load(name)
    scfg = _full_sparse(config, kv_window=4, batch_policy="kernels")
    steps = _run_both(config, params, scfg, _full_sets(config), prompts, steps=9)
    scale = max(np.abs(d).max() for d, _ in steps)
    for i, (dense_logits, sparse_logits) in enumerate(steps):
        assert_finite_close(sparse_logits, dense_logits, atol=2e-6 * scale,
                            err_msg=f"step {i}")
    if name == "gemma2" and len(prompts) > 1:
        # the attention cap matters: without it the last step is off
        uncapped = config.replace(attn_logit_softcap=None)
        far = _run_both(uncapped, params, _full_sparse(uncapped, kv_window=4,
                                                       batch_policy="kernels"),
                        _full_sets(config), prompts, steps=9)[-1][0]
        assert np.abs(far - steps[-1][1]).max() > 1e-3 * scale
    if name == "gemma3" and len(prompts) > 1:
        # the window matters (checked once, on the batch): without it the last step is off
        no_window = config.replace(sliding_layers=(), sliding_window=None)
        far = _run_both(no_window, params, _full_sparse(no_window, kv_window=4,
                                                        batch_policy="kernels"),
                        _full_sets(config), prompts, steps=9)[-1][0]
        assert np.abs(far - steps[-1][1]).max() > 1e-3 * scale


def test_qwen3_density_one_through_pallas_interpret_kernels():
    """Qwen3 (the Llama family's layout with q/k norms, a 5-token window on layers 1 and 2):
    every unit selected, through the interpreted Pallas kernels, each step's logits equal
    the dense model's for 3 steps past a 4-token prompt (the last two beyond the window)."""
    config, params = dj.load_pretrained(HF / "qwen3-window", dtype=jnp.float32,
                                        progress=False)
    assert config.family == "llama" and config.qk_norm and any(config.sliding_layers)
    scfg = _full_sparse(config, kv_window=4, impl="interpret")
    steps = _run_both(config, params, scfg, _full_sets(config), [[5, 9, 14, 3]], steps=3)
    scale = max(np.abs(d).max() for d, _ in steps)
    for i, (dense_logits, sparse_logits) in enumerate(steps):
        assert_finite_close(sparse_logits, dense_logits, atol=2e-6 * scale,
                            err_msg=f"step {i}")


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_gemma_density_one_through_pallas_interpret_kernels(name):
    """The Pallas path (interpreted): Gemma 3's q/k norms finish q/k/v in XLA between the
    projection and attention launches, for the current token and the window's rows;
    Gemma 2's q/k/v are finished in the attention launch, which soft-caps the logits."""
    config, params = _load(name)
    scfg = _full_sparse(config, kv_window=4, impl="interpret")
    steps = _run_both(config, params, scfg, _full_sets(config), [[5, 9, 14, 3, 7]], steps=3)
    scale = max(np.abs(d).max() for d, _ in steps)
    for dense_logits, sparse_logits in steps:
        assert_finite_close(sparse_logits, dense_logits, atol=2e-6 * scale)


@pytest.mark.parametrize("name", FAMILIES)
def test_density_one_greedy_matches_hugging_face(name):
    """The sparse engine at density 1 generates Hugging Face's greedy ids."""
    config, params = _load(name)
    ref = np.load(HF / name / "reference.npz")
    scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=1)
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    want = ref["generated_ids"].tolist()
    got = generate_tokens(eng, (params, _full_sets(config)), [ref["prompt_ids"].tolist()],
                          max_new_tokens=len(want), stop_ids=[])
    assert got.tokens[0] == want


def _oracle_sets(config, scfg, params, prompt, tokens, monkeypatch):
    """Logits of the oracle engine (dense layers, then top-k masks) teacher-forced through
    `tokens`, and per step the (neurons [L, k_mlp], query heads [L, k_heads]) it kept (rows of
    dense layers: every unit's first k)."""
    calls = []
    original = predict_mod.select_top_k

    def recording_top_k(scores, k, capacity=None):
        idx = original(scores, k, capacity)
        jax.debug.callback(lambda i: calls.append(np.asarray(i).reshape(-1)), idx,
                           ordered=True)
        return idx

    monkeypatch.setattr(predict_mod, "select_top_k", recording_top_k)
    eng = sparse.sparse_engine(config, scfg, sparse.no_selector)
    state = eng.init_state(1, 32, jnp.float32)
    ids = jnp.asarray([prompt], jnp.int32)
    _, state = jax.jit(eng.prefill)((params, None), ids, jnp.ones_like(ids), state)
    step = jax.jit(eng.step)
    logits, sets = [], []
    for tok in tokens:
        calls.clear()
        out, state = step((params, None), state, jnp.asarray([tok], jnp.int32))
        jax.effects_barrier()
        logits.append(np.asarray(out[0]))
        neurons = np.tile(np.arange(scfg.mlp_k[-1], dtype=np.int32), (config.n_layers, 1))
        groups = np.tile(np.arange(scfg.head_k[-1], dtype=np.int32), (config.n_layers, 1))
        it = iter(calls)
        for layer in range(scfg.dense_layers, config.n_layers):  # heads, then neurons
            groups[layer], neurons[layer] = np.sort(next(it)), np.sort(next(it))
        assert next(it, None) is None
        sets.append((jnp.asarray(neurons), jnp.asarray(groups)))
    monkeypatch.setattr(predict_mod, "select_top_k", original)
    return logits, sets


@pytest.mark.parametrize("name,impl,steps", [("qwen2", None, 10), ("gemma3", None, 10),
                                              ("gemma3", "interpret", 5),
                                              ("gemma2", None, 10),
                                              ("gemma2", "interpret", 5)])
def test_oracle_sets_through_the_sparse_kernels_equal_the_oracle(name, impl, steps,
                                                                 monkeypatch):
    """The oracle (dense layers whose outputs are masked to the true top-k) and the sparse
    kernels fed the oracle's sets per step compute the same logits: half the neurons and
    two of the four query heads in layers 1.. (the two KV groups each keep one, or one
    keeps both and the other none), a window of 16 tokens (no refresh needed to be
    exact), 10 steps past a 4-token prompt (past Gemma's window). A group skipped earlier
    gets its missing K/V recomputed from the window when it returns (Gemma: through its
    k-norm and its layer's RoPE; interpreted, in the Pallas path's XLA finishing). The
    masks matter: the logits differ from the dense model's."""
    config, params = _load(name)
    k_mlp, k_heads = config.ffn // 2, config.n_heads // 2
    L = config.n_layers
    oracle = sparse.SparseConfig((k_mlp,) * L, (k_heads,) * L, dense_layers=1, oracle=True,
                                 kv_window=16)
    prompt = [5, 9, 14, 3]
    tokens = np.random.default_rng(1).integers(3, config.vocab_size, steps).tolist()
    want, sets = _oracle_sets(config, oracle, params, prompt, tokens, monkeypatch)
    assert len({tuple(np.asarray(g[1:, 0]).tolist()) for _, g in sets}) > 1, \
        "the oracle kept the same query heads at every step: weak test"
    assert any(len(set((np.asarray(h[l]) // config.group_size).tolist())) < config.n_kv_heads
               for _, h in sets for l in range(1, L)), "no KV group was ever idle: weak test"
    kernels_cfg = sparse.SparseConfig((k_mlp,) * L, (k_heads,) * L, dense_layers=1,
                                      kv_window=16, impl=impl)
    eng = sparse.sparse_engine(config, kernels_cfg, sparse.fixed_selector)
    state = eng.init_state(1, 32, jnp.float32)
    ids = jnp.asarray([prompt], jnp.int32)
    _, state = jax.jit(eng.prefill)((params, sets[0]), ids, jnp.ones_like(ids), state)
    step = jax.jit(eng.step)
    d_state = model.init_state(config, 1, 32, jnp.float32)
    _, d_state = model.prefill(config, params, ids, jnp.ones_like(ids), d_state)
    scale = max(np.abs(w).max() for w in want)
    for i, (tok, step_sets) in enumerate(zip(tokens, sets)):
        got, state = step((params, step_sets), state, jnp.asarray([tok], jnp.int32))
        dense, d_state = model.decode_step(config, params, d_state, jnp.asarray([tok]))
        assert_finite_close(np.asarray(got[0]), want[i], atol=1e-5 * scale,
                            err_msg=f"step {i}")
    assert np.abs(np.asarray(dense[0]) - want[-1]).max() > 1e-2 * scale


@pytest.mark.parametrize("name", FAMILIES)
def test_predictor_path_decodes(name):
    """Random predictors at half density: greedy decoding through the predictor selector
    gives ids inside the vocabulary and finite logits that differ from the dense model's
    (the selection is applied), in one batch-1 decode and a batch of two."""
    config, params = _load(name)
    pred = _random_predictors(config, 5)
    scfg = sparse.sparse_config(config, 0.5, 0.5, dense_layers=1, kv_window=4)
    eng = sparse.sparse_engine(config, scfg, sparse.predictor_selector(config.group_size))
    out = generate_tokens(eng, (params, pred), PROMPTS, max_new_tokens=6, stop_ids=[])
    assert all(len(t) == 6 and 0 <= min(t) and max(t) < config.vocab_size
               for t in out.tokens)
    state = eng.init_state(1, 32, jnp.float32)
    ids = jnp.asarray([PROMPTS[0]], jnp.int32)
    _, state = jax.jit(eng.prefill)((params, pred), ids, jnp.ones_like(ids), state)
    d_state = model.init_state(config, 1, 32, jnp.float32)
    _, d_state = model.prefill(config, params, ids, jnp.ones_like(ids), d_state)
    step = jax.jit(eng.step)
    for tok in [17, 23, 40, 2, 99, 7, 11]:
        got, state = step((params, pred), state, jnp.asarray([tok], jnp.int32))
        dense, d_state = model.decode_step(config, params, d_state, jnp.asarray([tok]))
    got, dense = np.asarray(got), np.asarray(dense)
    assert np.isfinite(got).all() and np.isfinite(dense).all()
    assert np.abs(got - dense).max() > 1e-3 * np.abs(dense).max()
