"""Quality evaluation: the parallel sparse scorer against token-by-token sparse decode,
perplexity against numpy, multiple-choice scoring, task loaders on the real files."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import sparse
from dejavu_jax.eval import sparse_scoring as ss
from dejavu_jax.train import predict as predict_mod
from dejavu_jax.train.predictor_model import PredictorParams, init_predictor


def _random_predictors(config, seed, r=8):
    """Random lookahead predictors whose scores depend on the input (flat base rate)."""
    L, d = config.n_layers, config.hidden
    k1, k2 = jax.random.split(jax.random.key(seed))
    stats = (np.zeros((L, d), np.float32), np.ones((L, d), np.float32))

    def make(key, n):
        p = init_predictor(key, L, d, r, n, *stats, np.full((L, n), 0.3))
        return p.replace(w2=p.w2 * 10.0)  # input-driven scores, not bias-driven

    return PredictorParams(mlp=make(k1, config.ffn), heads=make(k2, config.n_heads))


def _model(preset, seed):
    config = dj.preset(preset).replace(n_layers=3, vocab_size=512)
    return config, dj.init_params(config, jax.random.key(seed), jnp.float32, std=0.15)


def _engine_fns(config, scfg, selector):
    """(init_state, jitted prefill, jitted step) of a sparse engine, compiled once."""
    eng = sparse.sparse_engine(config, scfg, selector)
    return eng.init_state, jax.jit(eng.prefill), jax.jit(eng.step)


def _decode_teacher_forced(fns, model_params, pred_params, ids, prefix):
    """Logits [T - prefix + 1, V] of a dense prefill of ids[:prefix] then one sparse step
    per remaining token at batch 1 (teacher forcing); steps are numbered in _RECORD."""
    init_state, prefill, step = fns
    state = init_state(1, len(ids) + 1, jnp.float32)
    prompt = jnp.asarray([ids[:prefix]], jnp.int32)
    logits, state = prefill((model_params, pred_params), prompt, jnp.ones_like(prompt), state)
    out = [np.asarray(logits[0])]
    for i, tok in enumerate(ids[prefix:]):
        _RECORD["step"] = i
        logits, state = step((model_params, pred_params), state, jnp.asarray([tok], jnp.int32))
        jax.effects_barrier()
        out.append(np.asarray(logits[0]))
    return np.stack(out)


_RECORD = {"step": 0, "sets": {}, "calls": []}


def _recording_predictor_selector(config, scfg):
    """The predictor selector, recording the sets the engine uses. The engine also makes
    calls whose result it drops: a segment's last layer looks ahead with its own k
    (dropped when the next segment's k differ) and the last layer looks ahead to itself.
    So only calls with the layer's own k count, and the first such call per step."""
    base = sparse.predictor_selector(config.group_size)

    def select(pred_params, layer, x, k_mlp, k_heads):
        neurons, groups = base(pred_params, layer, x, k_mlp, k_heads)

        def record(layer, neurons, groups):
            if (len(neurons), len(groups)) == (scfg.mlp_k[layer], scfg.head_k[layer]):
                _RECORD["sets"].setdefault((_RECORD["step"], int(layer)),
                                           (set(neurons.tolist()), set(groups.tolist())))

        jax.debug.callback(record, layer, neurons, groups, ordered=True)
        return neurons, groups

    return select


def _sets_from_masks(masks, layer, t):
    neuron_mask, group_mask = (np.asarray(m) for m in masks)
    return (set(np.flatnonzero(neuron_mask[layer, 0, t]).tolist()),
            set(np.flatnonzero(group_mask[layer, 0, t]).tolist()))


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_parallel_scorer_equals_sparse_decode_with_predictors(preset):
    config, params = _model(preset, 11)
    pred = _random_predictors(config, 12)
    # two sparse segments (layers 1 and 2): lookahead crosses a segment boundary
    scfg = sparse.sparse_config(config, [1.0, 0.5, 0.3], 0.5, dense_layers=1,
                                kv_window=4)
    fns = _engine_fns(config, scfg, _recording_predictor_selector(config, scfg))
    for seed in range(2):  # sampled sequences
        rng = np.random.default_rng(seed)
        T, prefix = 12, 1 + seed
        ids = rng.integers(3, 1000, T).tolist()
        _RECORD["sets"].clear()
        want = _decode_teacher_forced(fns, params, pred, ids, prefix)
        arr = jnp.asarray([ids], jnp.int32)
        got, masks = ss.window_logits(config, scfg, params, pred, arr, jnp.ones_like(arr),
                                      jnp.asarray([prefix]))
        got = np.asarray(got[0, prefix - 1:])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        for i in range(T - prefix):
            for layer in range(1, config.n_layers):
                neurons, groups = _RECORD["sets"][(i, layer)]
                assert (len(neurons), len(groups)) == (scfg.mlp_k[layer], scfg.head_k[layer])
                assert len(neurons) < config.ffn and len(groups) < config.n_kv_heads
                assert _sets_from_masks(masks, layer, prefix + i) == (neurons, groups), \
                    f"step {i} layer {layer}"


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_parallel_scorer_equals_sparse_decode_oracle(preset, monkeypatch):
    config, params = _model(preset, 21)
    scfg = sparse.sparse_config(config, 0.25, 0.5, dense_layers=1, oracle=True,
                                kv_window=4)
    original = predict_mod.select_top_k
    calls = _RECORD["calls"]

    def recording_top_k(scores, k, capacity=None):
        idx = original(scores, k, capacity)
        jax.debug.callback(lambda i: calls.append((_RECORD["step"], i.tolist())), idx,
                           ordered=True)
        return idx

    monkeypatch.setattr(predict_mod, "select_top_k", recording_top_k)
    rng = np.random.default_rng(3)
    T, prefix = 12, 2
    ids = rng.integers(3, 1000, T).tolist()
    calls.clear()
    fns = _engine_fns(config, scfg, sparse.no_selector)
    want = _decode_teacher_forced(fns, params, None, ids, prefix)
    arr = jnp.asarray([ids], jnp.int32)
    got, masks = ss.window_logits(config, scfg, params, None, arr, jnp.ones_like(arr),
                                  jnp.asarray([prefix]))
    np.testing.assert_allclose(np.asarray(got[0, prefix - 1:]), want, atol=1e-4, rtol=0)
    # the engine selects heads then neurons, layer by layer, in every step
    sparse_layers = range(scfg.dense_layers, config.n_layers)
    assert len(calls) == (T - prefix) * 2 * len(sparse_layers)
    it = iter(calls)
    for i in range(T - prefix):
        for layer in sparse_layers:
            (s1, groups), (s2, neurons) = next(it), next(it)
            assert s1 == s2 == i
            assert _sets_from_masks(masks, layer, prefix + i) == (set(neurons), set(groups))


# ---------------------------------------------------------------- perplexity and modes

from dejavu_jax.eval import perplexity as ppl_mod  # noqa: E402
from dejavu_jax.eval import tasks as tasks_mod  # noqa: E402


def _small_llama(seed=31, vocab=128):
    config = dj.preset("llama-tiny").replace(vocab_size=vocab, n_layers=3)
    return config, dj.init_params(config, jax.random.key(seed), jnp.float32, std=0.3)


def test_plan_windows_scores_every_token_once():
    for n, w, s in [(50, 16, 8), (50, 16, 16), (17, 16, 5), (5, 16, 16)]:
        scored = []
        for begin, end, first in ppl_mod.plan_windows(n, w, s):
            assert end - begin <= w and begin < first <= end + 1
            scored += range(first, end + 1)
        assert scored == list(range(1, n))


def test_perplexity_equals_numpy_from_logits():
    config, params = _small_llama()
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 50)
    mode = ss.make_mode(config, "dense")
    got = ppl_mod.perplexity(config, mode, params, None, ids, window=16, stride=8,
                             batch_tokens=48)
    nll, count = 0.0, 0
    for begin, end, first in ppl_mod.plan_windows(len(ids), 16, 8):
        logits = np.asarray(dj.logits(config, params, [ids[begin:end].tolist()])[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for target in range(first, end + 1):
            nll -= logp[target - begin - 1, ids[target]]
            count += 1
    assert got["tokens"] == count == len(ids) - 1
    assert got["total_nll"] == pytest.approx(nll, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_density_one_gives_the_dense_figures_exactly():
    config, params = _small_llama()
    pred = _random_predictors(config, 5)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 40)
    dense = ppl_mod.perplexity(config, ss.make_mode(config, "dense"), params, None, ids, 16, 8)
    for name in ("sparse", "oracle"):
        mode = ss.make_mode(config, name, 1.0, 1.0, dense_layers=1)
        got = ppl_mod.perplexity(config, mode, params, pred, ids, 16, 8)
        assert got["total_nll"] == dense["total_nll"], name
    # and a sparser setting does change the figure (the sparse path is live)
    got = ppl_mod.perplexity(config, ss.make_mode(config, "oracle", 0.3, 0.5, 1), params,
                             None, ids, 16, 8)
    assert got["total_nll"] != dense["total_nll"]


# ---------------------------------------------------------------- zero-shot tasks


class _CharTokenizer:
    """One token per character (code point), enough for the scoring logic."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _greedy_ids(config, params, ids, n, allowed=None):
    """The model's greedy continuation (n tokens) of ids, optionally within `allowed` ids."""
    ids = list(ids)
    bias = np.zeros(config.vocab_size)
    if allowed is not None:
        bias[:] = -np.inf
        bias[allowed] = 0
    for _ in range(n):
        padded = ids + [0] * (48 - len(ids))  # one shape, one compile (attention is causal)
        logits = np.asarray(dj.logits(config, params, [padded])[0, len(ids) - 1])
        ids.append(int(np.argmax(logits + bias)))
    return ids[-n:]


def test_multiple_choice_and_greedy_pick_the_planted_answer(tmp_path):
    config, params = _small_llama()
    query = "the cat sat on the mat and"
    letters = np.arange(ord("a"), ord("z") + 1)
    planted = "".join(map(chr, _greedy_ids(config, params, [ord(c) for c in query + " "], 6,
                                           letters)))
    rng = np.random.default_rng(2)
    distractors = ["".join(map(chr, rng.choice(letters, 6))) for _ in range(3)]
    path = tmp_path / "planted.jsonl"  # a new task in a known format plugs in by path
    path.write_text("\n".join([
        json.dumps({"query": query, "choices": [distractors[0], planted, distractors[1]],
                    "gold": 1}),
        json.dumps({"query": query, "choices": [planted, distractors[2]], "gold": 0})]))
    prepared = tasks_mod.prepare(_CharTokenizer(), [str(path)], None)
    assert prepared["planted"][1][1] == ([ord(c) for c in query],
                                         [ord(c) for c in " " + planted])
    res = tasks_mod.evaluate(config, ss.make_mode(config, "dense"), params, None, prepared,
                             batch_tokens=128)
    assert res["tasks"]["planted"] == {"items": 2, "acc": 1.0, "acc_norm": 1.0}
    # greedy (LAMBADA) scoring: the unrestricted greedy tokens match, others do not
    context = [ord(c) for c in query]
    greedy = _greedy_ids(config, params, context, 3)
    other = greedy[:2] + [(greedy[2] + 1) % config.vocab_size]
    _, hits = tasks_mod.score_requests(config, ss.make_mode(config, "dense"), params, None,
                                       [(context, greedy), (context, other)], 128)
    assert hits.tolist() == [True, False]


EXPECTED_COUNTS = {"copa": 100, "piqa": 1838, "openbookqa": 500, "winogrande": 1267,
                   "lambada": 5153, "hellaswag": 10042, "rte": 277}


@pytest.mark.parametrize("name", list(EXPECTED_COUNTS))
def test_task_loader_parses_the_real_file(name):
    path = tasks_mod.task_path(name)
    if not path.exists():
        pytest.skip(f"data folder missing: {path} (set DEJAVU_DATA)")
    items = tasks_mod.load_task(name)
    assert len(items) == EXPECTED_COUNTS[name]
    kinds = {it.kind for it in items}
    assert kinds == ({"greedy"} if name == "lambada" else {"choice"})
    for it in items:
        assert 0 <= it.gold < len(it.pairs) and all(c and x for c, x in it.pairs)
    assert len(tasks_mod.load_task(name, limit=7)) == 7
