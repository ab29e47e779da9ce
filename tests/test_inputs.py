"""Token ids and masks at the model's entry points: a ValueError naming the bad id and the
vocabulary size, never NaN logits; traced ids are the caller's contract."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import model, sparse
from dejavu_jax.eval.sparse_scoring import token_scores, window_logits

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "opt-preln"


@functools.lru_cache(maxsize=None)
def _model():
    return dj.load_pretrained(FIXTURE, progress=False)


ENTRY_POINTS = ("logits", "logits list", "prefill", "decode_step", "decode_step negative",
                "dense engine prefill", "dense engine step", "oracle engine prefill",
                "oracle engine step", "generate_tokens", "window_logits", "token_scores ids",
                "token_scores targets")


def _calls() -> dict:
    """{name: call} for every entry point, each given one id vocab_size + 7 (or -1)."""
    config, params = _model()
    V = config.vocab_size
    ids = np.array([[2, 5, V + 7]])
    mask = np.ones_like(ids)
    state = lambda: model.init_state(config, 1, 8, jnp.float32)  # noqa: E731
    scfg = sparse.sparse_config(config, 0.5, 1.0, dense_layers=1, oracle=True)
    oracle = sparse.sparse_engine(config, scfg, sparse.no_selector)
    dense = dj.dense_engine(config)
    sparse_state = lambda: oracle.init_state(1, 64, jnp.float32, per_layer=False)  # noqa
    one = jnp.ones((1,), jnp.int32)
    return dict([
        ("logits", lambda: dj.logits(config, params, ids)),
        ("logits list", lambda: dj.logits(config, params, ids.tolist())),
        ("prefill", lambda: model.prefill(config, params, ids, mask, state())),
        ("decode_step", lambda: model.decode_step(config, params, state(), jnp.array([V + 7]))),
        ("decode_step negative", lambda: model.decode_step(config, params, state(),
                                                           jnp.array([-1]))),
        ("dense engine prefill", lambda: dense.prefill(params, ids, mask, state())),
        ("dense engine step", lambda: dense.step(params, state(), jnp.array([V + 7]))),
        ("oracle engine prefill", lambda: oracle.prefill((params, None), ids, mask,
                                                         sparse_state())),
        ("oracle engine step", lambda: oracle.step((params, None), sparse_state(),
                                                   jnp.array([V + 7]))),
        ("generate_tokens", lambda: dj.generate_tokens(dense, params, [[2, V + 7]])),
        ("window_logits", lambda: window_logits(config, None, params, None, ids, mask, one)),
        ("token_scores ids", lambda: token_scores(config, None, params, None, ids, mask, one,
                                                  np.zeros_like(ids))),
        ("token_scores targets", lambda: token_scores(config, None, params, None,
                                                      np.zeros_like(ids), mask, one, ids)),
    ])


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_id_outside_the_vocabulary_is_an_error(name):
    call = _calls()[name]
    V = _model()[0].vocab_size
    bad = -1 if "negative" in name else V + 7
    with pytest.raises(ValueError, match=rf"token id {bad}\b.*vocab_size {V}\b"):
        call()


def test_the_checks_were_needed_the_raw_forward_gives_nan():
    config, params = _model()
    ids = jnp.array([[2, 5, config.vocab_size + 7]])
    out = model._logits(config, params, ids, jnp.ones_like(ids))  # the unchecked jit
    assert np.isnan(np.asarray(out)[0, -1]).all()


def test_traced_ids_are_the_callers_contract():
    """Inside jit the values are unknown: no check, no error (the docstrings say so)."""
    config, params = _model()
    traced = jax.jit(lambda i: model.prefill_fn(config, params, i, jnp.ones_like(i),
                                                model.init_state(config, 1, 8, jnp.float32))[0])
    assert traced(jnp.array([[2, 5, 9]])).shape == (1, config.vocab_size)


@pytest.mark.parametrize("ids,mask,message", [
    (np.array([2, 5]), None, r"input_ids must be \[batch, time\], got shape \(2,\)"),
    (np.array([[2.0, 5.0]]), None, "integer token ids, got dtype float64"),
    (np.zeros((1, 0), np.int32), None, "empty"),
    (np.array([[2, 5]]), np.ones((1, 3)), r"attention_mask shape \(1, 3\) != input_ids shape"),
    (np.array([[2, 5]]), np.ones((1, 2), np.float32), "attention_mask must be bool or integer"),
])
def test_wrong_shapes_and_dtypes(ids, mask, message):
    config, params = _model()
    with pytest.raises(ValueError, match=message):
        dj.logits(config, params, ids, mask)


def test_prompts_that_do_not_fit_the_state():
    config, params = _model()
    state = model.init_state(config, 1, 8, jnp.float32)
    ids = np.ones((1, 9), np.int32)
    with pytest.raises(ValueError, match=r"prompts \[1, 9\] do not fit a decode state"):
        model.prefill(config, params, ids, np.ones_like(ids), state)
    with pytest.raises(ValueError, match="tokens has 2 rows; the decode state has 1"):
        model.decode_step(config, params, state, jnp.array([1, 2]))


@pytest.mark.parametrize("engine", ["decode_step", "oracle engine"])
def test_a_step_past_the_states_cache_is_refused(engine):
    """A decode state of 8 cache slots holds a 6-token prompt and two steps, whose logits
    are the full forward's; the step that would write slot 8 raises instead of
    overwriting the last slot (which gave other logits, silently)."""
    config, params = _model()
    ids = np.array([[2, 5, 9, 14, 3, 7, 11, 4]], np.int32)
    full = np.asarray(dj.logits(config, params, ids))[0]
    if engine == "decode_step":
        state = model.init_state(config, 1, 8, jnp.float32)
        _, state = model.prefill(config, params, ids[:, :6], np.ones((1, 6), np.int32), state)
        step = functools.partial(model.decode_step, config, params)
    else:
        scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=0, oracle=True)
        oracle = sparse.sparse_engine(config, scfg, sparse.no_selector)
        state = oracle.init_state(1, 8, jnp.float32, per_layer=False)
        _, state = oracle.prefill((params, None), ids[:, :6], np.ones((1, 6), np.int32), state)
        step = functools.partial(oracle.step, (params, None))
    for t in (6, 7):
        logits, state = step(state, jnp.asarray(ids[:, t]))
        assert np.isfinite(np.asarray(logits)).all()
        np.testing.assert_allclose(np.asarray(logits)[0], full[t], atol=1e-4 * np.abs(full).max())
    with pytest.raises(ValueError, match="cache.*8 slots"):
        step(state, jnp.array([5]))


@pytest.mark.parametrize("engine", ["model", "oracle engine"])
def test_prefill_and_steps_past_opts_learned_positions_are_refused(engine):
    """OPT's position embedding ends at max_positions (128 here): a prompt of 128 tokens
    prefills to the full forward's logits, a longer one raises, and so does the step
    whose token would sit at position 128 (both gave NaN logits)."""
    config, params = _model()
    P = config.max_positions
    ids = np.random.default_rng(1).integers(3, config.vocab_size, (1, P + 1)).astype(np.int32)
    full = np.asarray(dj.logits(config, params, ids[:, :P]))[0, -1]
    if engine == "model":
        state = lambda: model.init_state(config, 1, P + 64, jnp.float32)  # noqa: E731
        prefill = functools.partial(model.prefill, config, params)
        step = functools.partial(model.decode_step, config, params)
    else:
        scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=0, oracle=True)
        oracle = sparse.sparse_engine(config, scfg, sparse.no_selector)
        state = lambda: oracle.init_state(1, P + 64, jnp.float32, per_layer=False)  # noqa
        prefill = functools.partial(oracle.prefill, (params, None))
        step = functools.partial(oracle.step, (params, None))
    with pytest.raises(ValueError, match=f"{P + 1} tokens exceed the model's {P} learned"):
        prefill(ids, np.ones_like(ids), state())
    logits, st = prefill(ids[:, :P], np.ones((1, P), np.int32), state())
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(np.asarray(logits)[0], full, atol=1e-4 * np.abs(full).max())
    with pytest.raises(ValueError, match=f"pass the model's {P} learned positions"):
        step(st, jnp.array([5]))


def test_a_per_layer_cache_needs_per_layer_weights():
    """init_state(per_layer=True) pairs with per-layer weights (`unstack_layers`), whose
    step gives the full forward's logits; with stacked weights decode_step raises a
    ValueError saying so (not a tracer error from inside the scan)."""
    from dejavu_jax.params import unstack_layers
    config, params = _model()
    ids = np.array([[2, 5, 9, 14, 3, 7]], np.int32)
    full = np.asarray(dj.logits(config, params, ids))[0]
    per_layer = lambda: model.init_state(config, 1, 16, jnp.float32, per_layer=True)  # noqa
    unstacked = unstack_layers(params)
    _, state = model.prefill(config, unstacked, ids[:, :5], np.ones((1, 5), np.int32),
                             per_layer())
    with pytest.raises(ValueError, match="per-layer cache"):
        model.decode_step(config, params, state, jnp.asarray(ids[:, 5]))
    scfg = sparse.sparse_config(config, 0.5, 1.0, dense_layers=1, oracle=True)
    oracle = sparse.sparse_engine(config, scfg, sparse.no_selector)
    with pytest.raises(ValueError, match="per-layer cache"):
        oracle.step((params, None), oracle.init_state(1, 16, jnp.float32, per_layer=True),
                    jnp.asarray(ids[:, 5]))
    logits, _ = model.decode_step(config, unstacked, state, jnp.asarray(ids[:, 5]))
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(np.asarray(logits)[0], full[5], atol=1e-4 * np.abs(full).max())


@pytest.mark.parametrize("engine", ["model", "oracle engine"])
def test_a_prefill_mask_must_be_left_padded(engine):
    """A prefill returns the last column's logits: for left-padded prompts those are Hugging
    Face's at each row's last token; a row that ends with padding (right-padded or empty),
    or a mask value other than 0 and 1, raises instead of returning a padding position's
    logits."""
    config, params = _model()
    ref = np.load(FIXTURE / "reference.npz")
    ids, mask = ref["input_ids"], ref["attention_mask"]  # row 1 left-padded by 5
    B, T = ids.shape
    if engine == "model":
        state = lambda: model.init_state(config, B, 32, jnp.float32)  # noqa: E731
        prefill = functools.partial(model.prefill, config, params)
    else:
        scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=0, oracle=True)
        oracle = sparse.sparse_engine(config, scfg, sparse.no_selector)
        state = lambda: oracle.init_state(B, 32, jnp.float32, per_layer=False)  # noqa
        prefill = functools.partial(oracle.prefill, (params, None))
    logits, _ = prefill(ids, mask, state())
    want = ref["logits"][:, -1]
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4 * np.abs(want).max())
    pads = int((mask[1] == 0).sum())
    right = np.concatenate([ids[1, pads:], ids[1, :pads]])  # the same row, padded after
    with pytest.raises(ValueError, match="row 1 ends with padding.*left-padded"):
        prefill(np.stack([ids[0], right]), mask[:, ::-1].copy(), state())
    with pytest.raises(ValueError, match="row 0 ends with padding"):
        prefill(ids, np.stack([np.zeros(T, np.int32), mask[1]]), state())
    with pytest.raises(ValueError, match="0 .* and 1 .* only, got \\[2\\]"):
        prefill(ids, mask * 2, state())
