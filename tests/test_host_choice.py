"""Tokens chosen on the host from inside the device loop: the chooser sees each step's
logits, its ids are what the model decodes, and bad choices fail loudly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import model, sparse
from dejavu_jax.batch_plan import chained_loop
from dejavu_jax.generation import dense_engine, generate_tokens, left_pad
from dejavu_jax.host_choice import checked_ids, host_argmax

PROMPTS = [[5, 9, 14, 3], [8, 2]]


def _model(name="llama-tiny", seed=7):
    config = dj.preset(name)
    return config, dj.init_params(config, jax.random.key(seed), jnp.float32, std=0.3)


class SecondBest:
    """Picks each row's second most likely token and records the logits it was shown."""

    def __init__(self):
        self.seen = []

    def __call__(self, logits):
        self.seen.append(logits.copy())
        return np.argsort(-logits, axis=-1)[:, 1]


@pytest.mark.parametrize("chunk", [1, 4])
def test_host_chooser_sees_each_steps_logits_and_its_ids_are_decoded(chunk):
    config, params = _model()
    n_new = 7
    choose = SecondBest()
    got = generate_tokens(dense_engine(config), params, PROMPTS, n_new, stop_ids=[],
                          chunk=chunk, choose=choose)
    # the same choice made by a plain host loop over prefill and decode_step
    ids, mask = left_pad(PROMPTS)
    state = model.init_state(config, 2, 64, jnp.float32)
    logits, state = model.prefill(config, params, jnp.asarray(ids), jnp.asarray(mask), state)
    want, shown = [], []
    for _ in range(n_new):
        host = np.asarray(logits)
        shown.append(host)
        tok = np.argsort(-host, axis=-1)[:, 1].astype(np.int32)
        want.append(tok)
        logits, state = model.decode_step(config, params, state, jnp.asarray(tok))
    assert got.tokens == np.stack(want, 1).tolist()
    assert len(choose.seen) >= n_new         # a queued chunk may run past the last token
    scale = np.abs(shown[0]).max()
    for step in range(n_new):
        assert_finite_close(choose.seen[step], shown[step], atol=1e-5 * scale,
                            err_msg=f"step {step}")
    greedy = generate_tokens(dense_engine(config), params, PROMPTS, n_new, stop_ids=[])
    assert got.tokens != greedy.tokens       # the chooser, not the sampler, decided


def test_host_argmax_equals_device_greedy_for_the_sparse_engine():
    config, params = _model("opt-tiny", 0)
    scfg = sparse.sparse_config(config, 0.5, 0.5, dense_layers=1, oracle=True)
    eng = sparse.sparse_engine(config, scfg, sparse.no_selector)
    device = generate_tokens(eng, (params, None), PROMPTS, 6, stop_ids=[])
    host = generate_tokens(eng, (params, None), PROMPTS, 6, stop_ids=[], choose=host_argmax)
    assert host.tokens == device.tokens


def test_chained_loop_with_host_argmax_equals_the_device_argmax():
    config, params = _model()
    engine = dense_engine(config)
    ids, mask = left_pad(PROMPTS)
    runs = []
    for choose in (None, host_argmax):
        state = model.init_state(config, 2, 64, jnp.float32)
        logits, state = model.prefill(config, params, jnp.asarray(ids), jnp.asarray(mask),
                                      state)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        state, tok = jax.jit(chained_loop(engine.step, 5, choose))(params, state, tok)
        runs.append((np.asarray(tok), np.asarray(state.k)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("bad, message", [
    (lambda logits: np.full(logits.shape[0], logits.shape[1]), "outside the vocabulary"),
    (lambda logits: np.full(logits.shape[0], -1), "outside the vocabulary"),
    (lambda logits: np.zeros(logits.shape[0] + 1, np.int64), "one per row"),
    (lambda logits: np.zeros(logits.shape[0], np.float32), "integer ids"),
])
@pytest.mark.parametrize("chunk", [1, 4])
def test_invalid_choices_raise_and_leave_later_runs_working(bad, message, chunk):
    config, params = _model()
    with pytest.raises(ValueError, match=message):
        generate_tokens(dense_engine(config), params, PROMPTS, 9, stop_ids=[], choose=bad,
                        chunk=chunk)
    calls = []

    def fails_late(logits):           # a valid chooser that raises on its third call
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("no grammar state")
        return logits.argmax(-1)

    with pytest.raises(ValueError, match="no grammar state"):
        generate_tokens(dense_engine(config), params, PROMPTS, 9, stop_ids=[],
                        choose=fails_late, chunk=chunk)
    good = generate_tokens(dense_engine(config), params, PROMPTS, 5, stop_ids=[],
                           choose=host_argmax, chunk=chunk)
    assert good.tokens == generate_tokens(dense_engine(config), params, PROMPTS, 5,
                                          stop_ids=[]).tokens


def test_checked_ids():
    np.testing.assert_array_equal(checked_ids(np.array([3, 0], np.int64), 2, 4), [3, 0])
    assert checked_ids([1, 2], 2, 4).dtype == np.int32
    with pytest.raises(ValueError, match="outside"):
        checked_ids([1, 4], 2, 4)
