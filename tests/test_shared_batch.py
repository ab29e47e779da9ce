"""Batch policy "shared": one predicted set per layer for a whole batch.

The sets are checked against a numpy reference (the top-k of the rows' summed sigmoid
probabilities), and the batch decode against the teacher-forced scorer with groups of
shared rows, so that the perplexity of a shared batch is the decode's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import sparse
from dejavu_jax.eval import sparse_scoring as ss
from dejavu_jax.eval.bench_decode import random_predictors
from dejavu_jax.generation import left_pad
from dejavu_jax.train.predict import predictor_scores


def _numpy_shared_top_k(logits: np.ndarray, k: int, weights=None) -> np.ndarray:
    """Ascending ids of the k largest summed probabilities (ties to the lower id)."""
    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    if weights is not None:
        p = p * np.asarray(weights, np.float64)[:, None]
    summed = p.sum(0)
    order = sorted(range(len(summed)), key=lambda i: (-summed[i], i))
    return np.sort(np.asarray(order[:k]))


def test_shared_sets_are_the_top_k_of_summed_probabilities():
    config = dj.preset("llama-tiny")
    preds = random_predictors(config, 8, jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (3, config.hidden), jnp.float32)
    select = sparse.predictor_selector(config.group_size)
    shared = select.shared_batch()
    assert not select.shared and shared.shared
    k_mlp, k_heads = config.ffn // 4, 2
    neurons, heads = shared(preds, 1, x, k_mlp, k_heads)
    mlp_logits, head_logits = (np.asarray(s) for s in predictor_scores(preds, 1, x))
    np.testing.assert_array_equal(np.asarray(neurons), _numpy_shared_top_k(mlp_logits, k_mlp))
    np.testing.assert_array_equal(np.asarray(heads), _numpy_shared_top_k(head_logits, k_heads))
    # the rows' own sets differ from the shared one, and one row is its own batch
    own = [set(np.argsort(-mlp_logits[r])[:k_mlp].tolist()) for r in range(3)]
    assert any(s != set(np.asarray(neurons).tolist()) for s in own)
    one_row = shared(preds, 1, x[:1], k_mlp, k_heads)
    alone = select(preds, 1, x[:1], k_mlp, k_heads)
    for a, b in zip(one_row, alone):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scorer_shared_mask_matches_numpy_and_ignores_non_voting_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 3, 10)).astype(np.float32)
    votes = np.ones((4, 3), bool)
    votes[1, 2] = False   # row 1 at position 2 is in its dense prefix (or padding)
    mask = np.asarray(ss.shared_top_k_mask(jnp.asarray(logits), 3, jnp.asarray(votes), 2))
    for g in range(2):
        for t in range(3):
            rows = slice(2 * g, 2 * g + 2)
            want = _numpy_shared_top_k(logits[rows, t], 3, votes[rows, t])
            for r in range(2 * g, 2 * g + 2):
                np.testing.assert_array_equal(np.flatnonzero(mask[r, t]), want)
    with pytest.raises(ValueError, match="groups of 3"):
        ss.shared_top_k_mask(jnp.asarray(logits), 3, jnp.asarray(votes), 3)


@pytest.mark.parametrize("preset,impl", [("opt-tiny", None), ("llama-tiny", None),
                                         ("llama-tiny", "interpret")])
def test_shared_batch_decode_equals_the_shared_scorer(preset, impl):
    """Two prompts of equal length decoded together under "shared" (predictors, MLP 0.25,
    heads 0.5; the jnp references, or the Pallas kernels in the interpreter): at every
    step the logits equal the scorer's for the two rows as one group of shared rows, and
    differ from each row's own-set scores."""
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    preds = random_predictors(config, 8, jax.random.key(4))
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.25, 0.5, dense_layers=1,
                                                    kv_window=4),
                               batch_policy="shared", impl=impl)
    P, S = 5, 6
    rng = np.random.default_rng(1)
    ids = rng.integers(3, config.vocab_size, (2, P + S)).astype(np.int32)
    eng = sparse.sparse_engine(config, scfg, sparse.predictor_selector(config.group_size))
    prefill, step = jax.jit(eng.prefill), jax.jit(eng.step)
    prompt, mask = (jnp.asarray(a) for a in left_pad([list(ids[0, :P]), list(ids[1, :P])]))
    state = eng.init_state(2, P + S + 1, jnp.float32)
    logits, state = prefill((params, preds), prompt, mask, state)
    decoded = [np.asarray(logits)]
    for i in range(S):
        logits, state = step((params, preds), state, jnp.asarray(ids[:, P + i]))
        decoded.append(np.asarray(logits))
    decoded = np.stack(decoded, axis=1)          # [2, S + 1, V]: positions P-1 .. P+S-1
    assert np.isfinite(decoded).all()
    window = (jnp.asarray(ids), jnp.ones((2, P + S), jnp.int32), jnp.full((2,), P, jnp.int32))
    scfg = dataclasses.replace(scfg, impl=None)   # the scorer has no kernels
    scored, masks = ss.window_logits(config, scfg, params, preds, *window, share=2)
    scored = np.asarray(scored)[:, P - 1:]
    np.testing.assert_allclose(scored, decoded, atol=1e-4, rtol=0)
    n_mask = np.asarray(masks[0])
    assert (n_mask[:, 0] == n_mask[:, 1]).all()           # one set for the group
    own, _ = ss.window_logits(config, dataclasses.replace(scfg, batch_policy="union"),
                              params, preds, *window)
    assert np.abs(np.asarray(own)[:, P:] - scored[:, 1:]).max() > 1e-3


def test_shared_policy_is_for_predictors_only():
    config = dj.preset("opt-tiny")
    with pytest.raises(ValueError, match="shared"):
        dataclasses.replace(sparse.sparse_config(config, 0.5, 0.5, oracle=True),
                            batch_policy="shared")
    with pytest.raises(ValueError, match="shared_rows"):
        ss.make_mode(config, "oracle", 0.5, 0.5, shared_rows=2)


def test_perplexity_cli_refuses_shared_rows_without_the_sparse_mode(capsys):
    from dejavu_jax.eval import perplexity
    with pytest.raises(SystemExit) as e:
        perplexity.main(["--preset", "llama-tiny", "--shared-rows", "2"])
    assert e.value.code == 2
    assert "--mode sparse" in capsys.readouterr().err


def test_finished_rows_do_not_weigh_in_the_shared_sets():
    config = dj.preset("llama-tiny")
    preds = random_predictors(config, 8, jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (3, config.hidden), jnp.float32)
    live = np.asarray([True, False, True])
    shared = sparse.predictor_selector(config.group_size).shared_batch(jnp.asarray(live))
    k_mlp, k_heads = config.ffn // 4, 2
    neurons, heads = shared(preds, 1, x, k_mlp, k_heads)
    mlp_logits, head_logits = (np.asarray(s) for s in predictor_scores(preds, 1, x))
    np.testing.assert_array_equal(np.asarray(neurons),
                                  _numpy_shared_top_k(mlp_logits, k_mlp, live))
    np.testing.assert_array_equal(np.asarray(heads),
                                  _numpy_shared_top_k(head_logits, k_heads, live))
    assert not np.array_equal(np.asarray(neurons), _numpy_shared_top_k(mlp_logits, k_mlp))


def _shared_engine(preset):
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    preds = random_predictors(config, 8, jax.random.key(4))
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.25, 0.5, dense_layers=1),
                               batch_policy="shared")
    eng = sparse.sparse_engine(config, scfg, sparse.predictor_selector(config.group_size))
    return config, eng, (params, preds)


def test_a_finished_row_leaves_the_others_decoding_as_without_it():
    """Rows 0 and 2 of three decode, once row 1 is finished (`model.finish_rows`), exactly
    as the two of them alone; while row 1 is live its votes change their sets."""
    config, eng, params = _shared_engine("opt-tiny")
    P, S = 5, 4
    ids = np.random.default_rng(1).integers(3, config.vocab_size, (3, P + S)).astype(np.int32)
    prefill, step = jax.jit(eng.prefill), jax.jit(eng.step)

    def decode(rows, finished=None):
        prompt, mask = (jnp.asarray(a) for a in left_pad([list(ids[r, :P]) for r in rows]))
        _, state = prefill(params, prompt, mask, eng.init_state(len(rows), P + S + 1,
                                                                jnp.float32))
        if finished is not None:
            state = dj.model.finish_rows(state, jnp.asarray(finished))
        out = []
        for i in range(S):
            logits, state = step(params, state, jnp.asarray(ids[rows, P + i]))
            out.append(np.asarray(logits))
        return np.stack(out, axis=1)

    alone = decode([0, 2])
    with_finished = decode([0, 1, 2], finished=[False, True, False])
    with_live = decode([0, 1, 2])
    assert np.isfinite(alone).all() and np.isfinite(with_finished).all()
    np.testing.assert_allclose(with_finished[[0, 2]], alone, atol=1e-5, rtol=0)
    assert np.abs(with_live[[0, 2]] - alone).max() > 1e-3


def test_generation_finishes_a_row_at_its_stop_id():
    """A row that emits a stop id no longer weighs in the shared sets: the other rows
    generate what they generate without it."""
    config, eng, params = _shared_engine("opt-tiny")
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, config.vocab_size, 6)) for _ in range(3)]
    free = dj.generate_tokens(eng, params, prompts, max_new_tokens=10, stop_ids=[], chunk=4)
    stop = free.tokens[1][0]   # row 1's first token (the prompt's): it finishes there
    assert all(stop not in free.tokens[r] for r in (0, 2))
    together = dj.generate_tokens(eng, params, prompts, max_new_tokens=10, stop_ids=[stop],
                                  chunk=4)
    apart = dj.generate_tokens(eng, params, [prompts[0], prompts[2]], max_new_tokens=10,
                               stop_ids=[stop], chunk=4)
    assert together.tokens[1] == [stop]
    assert [together.tokens[0], together.tokens[2]] == apart.tokens
    assert [free.tokens[0], free.tokens[2]] != apart.tokens
