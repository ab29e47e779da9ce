"""Quality evaluation: the parallel sparse scorer against token-by-token sparse decode,
perplexity against numpy, multiple-choice scoring, task loaders on the real files."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import sparse
from dejavu_jax.eval import sparse_scoring as ss
from dejavu_jax.train import predict as predict_mod
from dejavu_jax.train.predictor_model import PredictorParams, init_predictor

# ---------------------------------------------------------------- scorer == sparse decode

# One window of three rows: (real length, dense prefix). The third is right-padded.
ROWS = ((12, 1), (12, 3), (9, 2))
T = 12
PAD = 0


def _random_predictors(config, seed, r=8):
    """Random lookahead predictors whose scores depend on the input (flat base rate)."""
    L, d = config.n_layers, config.hidden
    k1, k2 = jax.random.split(jax.random.key(seed))
    stats = (np.zeros((L, d), np.float32), np.ones((L, d), np.float32))

    def make(key, n):
        p = init_predictor(key, L, d, r, n, *stats, np.full((L, n), 0.3))
        return p.replace(w2=p.w2 * 10.0)  # input-driven scores, not bias-driven

    return PredictorParams(mlp=make(k1, config.ffn), heads=make(k2, config.n_heads))


@functools.cache
def _model(preset):
    """(config, params, jitted sparse prefill) of a 3-layer, 512-token model of `preset`;
    the prefill depends on the model only, so both modes share its compilations."""
    config = dj.preset(preset).replace(n_layers=3, vocab_size=512)
    params = dj.init_params(config, jax.random.key(11), jnp.float32, std=0.15)
    return config, params, jax.jit(functools.partial(sparse.sparse_prefill_fn, config))


def _scorer_config(config, mode):
    """Layer 0 dense, layers 1 and 2 at MLP densities 0.5 and 0.3 (two sparse segments, so
    the lookahead crosses a segment boundary) and half the query heads (on llama-tiny's
    two groups of two: a group may keep one, both or none of its heads)."""
    scfg = sparse.sparse_config(config, [1.0, 0.5, 0.3], 0.5, dense_layers=1,
                                oracle=mode == "oracle", kv_window=4)
    for layer in range(1, config.n_layers):  # densities below 1: real selections
        assert scfg.mlp_k[layer] < config.ffn and scfg.head_k[layer] < config.n_heads
    return scfg


_RECORD = {"step": 0, "calls": []}


def _recording_selector(config, scfg, mode, monkeypatch):
    """The engine's selector, with every selection it makes appended to _RECORD["calls"] as
    (decode step, layer or None, index list(s)). Predictors: the selector's own calls.
    Oracle: the engine's `select_top_k` calls (monkeypatched), which select inside the
    layer."""
    calls = _RECORD["calls"]
    if mode == "oracle":
        original = predict_mod.select_top_k

        def recording_top_k(scores, k, capacity=None):
            idx = original(scores, k, capacity)
            jax.debug.callback(lambda i: calls.append((_RECORD["step"], None, i.tolist())),
                               idx, ordered=True)
            return idx

        monkeypatch.setattr(predict_mod, "select_top_k", recording_top_k)
        return sparse.no_selector
    base = sparse.predictor_selector(config.group_size)

    def select(pred_params, layer, x, k_mlp, k_heads):
        neurons, heads = base(pred_params, layer, x, k_mlp, k_heads)
        jax.debug.callback(
            lambda l, n, h: calls.append((_RECORD["step"], int(l), (n.tolist(), h.tolist()))),
            layer, neurons, heads, ordered=True)
        return neurons, heads

    return select


def _sets_of_calls(config, scfg, mode, calls, steps):
    """{(step, layer): (neuron set, query-head set)} the engine used, from its recorded calls.

    Oracle: per step and sparse layer, the heads' call then the neurons'. Predictors: the
    engine also makes calls whose result it drops (a segment's last layer looks ahead with
    its own k, dropped when the next segment's k differ, and the last layer looks ahead to
    itself), so the set of a layer is its first call in the step with the layer's own k.
    """
    sets = {}
    sparse_layers = range(scfg.dense_layers, config.n_layers)
    if mode == "oracle":
        assert len(calls) == steps * 2 * len(sparse_layers)
        it = iter(calls)
        for i in range(steps):
            for layer in sparse_layers:
                (s1, _, groups), (s2, _, neurons) = next(it), next(it)
                assert s1 == s2 == i
                sets[i, layer] = (set(neurons), set(groups))
    else:
        for i, layer, (neurons, groups) in calls:
            if (len(neurons), len(groups)) == (scfg.mlp_k[layer], scfg.head_k[layer]):
                sets.setdefault((i, layer), (set(neurons), set(groups)))
    for i in range(steps):
        for layer in sparse_layers:
            neurons, groups = sets[i, layer]
            assert (len(neurons), len(groups)) == (scfg.mlp_k[layer], scfg.head_k[layer])
    return sets


@functools.cache
def _decoded(preset, mode):
    """The references for the scorer, computed once per (preset, mode): the window
    (ids [3, T] of valid tokens, right-padded, and its mask) and, per row, the logits of a
    dense prefill of its prefix then one sparse step per remaining token at batch 1
    (teacher forcing; positions prefix - 1 .. length - 1) and the sets each step used."""
    config, params, prefill = _model(preset)
    scfg = _scorer_config(config, mode)
    pred = _random_predictors(config, 12) if mode == "sparse" else None
    ids = np.random.default_rng(7).integers(3, config.vocab_size, (len(ROWS), T))
    mask = np.ones_like(ids)
    for r, (n, _) in enumerate(ROWS):
        ids[r, n:], mask[r, n:] = PAD, 0
    rows = []
    with pytest.MonkeyPatch.context() as mp:  # the step is traced (and records) in here
        select = _recording_selector(config, scfg, mode, mp)
        eng = sparse.sparse_engine(config, scfg, select)
        step = jax.jit(eng.step)
        for r, (n, prefix) in enumerate(ROWS):
            state = eng.init_state(1, T + 1, jnp.float32)
            prompt = jnp.asarray(ids[r:r + 1, :prefix], jnp.int32)
            logits, state = prefill((params, pred), prompt, jnp.ones_like(prompt), state)
            out = [np.asarray(logits[0])]
            _RECORD["calls"].clear()
            for i in range(n - prefix):
                _RECORD["step"] = i
                logits, state = step((params, pred), state,
                                     jnp.asarray(ids[r, prefix + i:prefix + i + 1], jnp.int32))
                jax.effects_barrier()
                out.append(np.asarray(logits[0]))
            sets = _sets_of_calls(config, scfg, mode, list(_RECORD["calls"]), n - prefix)
            rows.append((np.stack(out), sets))
    return dict(config=config, params=params, scfg=scfg, pred=pred, ids=ids, mask=mask,
                rows=rows)


def _check_row(d, r, logits, masks, b):
    """Row r of the window, scored as row b of `logits` [B, T, V] and `masks` ([L, B, T, F],
    [L, B, T, H]), against its decode: finite logits equal to the decode's at every
    decoded position, the engine's sets at every sparse position, every unit elsewhere."""
    config, scfg = d["config"], d["scfg"]
    n, prefix = ROWS[r]
    want, sets = d["rows"][r]
    assert_finite_close(np.asarray(logits)[b, prefix - 1:n], want, atol=1e-4,
                        err_msg=f"row {r} ({d['config'].name})")
    neuron_mask, group_mask = (np.asarray(m)[:, b] for m in masks[:2])
    assert neuron_mask[:scfg.dense_layers].all() and group_mask[:scfg.dense_layers].all()
    assert neuron_mask[:, :prefix].all() and group_mask[:, :prefix].all()
    for i in range(n - prefix):
        for layer in range(scfg.dense_layers, config.n_layers):
            got = (set(np.flatnonzero(neuron_mask[layer, prefix + i]).tolist()),
                   set(np.flatnonzero(group_mask[layer, prefix + i]).tolist()))
            assert got == sets[i, layer], f"row {r} step {i} layer {layer}"


SCORER_CASES = [(p, m) for p in ("opt-tiny", "llama-tiny") for m in ("sparse", "oracle")]


@pytest.mark.parametrize("preset,mode", SCORER_CASES)
def test_scorer_equals_sparse_decode_at_batch_1(preset, mode):
    """Each row scored alone ([1, T] with its own dense prefix; predictors or oracle at
    densities below 1): logits equal the teacher-forced sparse decode's at every position
    from prefix - 1 on, and the scorer's masks hold the sets the engine used per token."""
    d = _decoded(preset, mode)
    ids, mask = jnp.asarray(d["ids"], jnp.int32), jnp.asarray(d["mask"], jnp.int32)
    for r, (_, prefix) in enumerate(ROWS):
        logits, masks = ss.window_logits(d["config"], d["scfg"], d["params"], d["pred"],
                                         ids[r:r + 1], mask[r:r + 1],
                                         jnp.asarray([prefix], jnp.int32))
        _check_row(d, r, logits, masks, 0)


@pytest.mark.parametrize("preset,mode", SCORER_CASES)
def test_scorer_rows_equal_their_own_sparse_decodes(preset, mode):
    """The three rows in one [3, T] window (different prompts, dense prefixes and lengths,
    one right-padded): each row's logits and sets are those of its own batch-1 decode.
    The sets change from token to token and the logits differ from the dense model's,
    so the comparison is one of sparse computations."""
    d = _decoded(preset, mode)
    config, scfg = d["config"], d["scfg"]
    ids, mask = jnp.asarray(d["ids"], jnp.int32), jnp.asarray(d["mask"], jnp.int32)
    prefixes = np.asarray([p for _, p in ROWS], np.int32)
    logits, masks = ss.window_logits(config, scfg, d["params"], d["pred"], ids, mask,
                                     jnp.asarray(prefixes))
    for r in range(len(ROWS)):
        _check_row(d, r, logits, masks, r)
    for layer in range(scfg.dense_layers, config.n_layers):
        seen = {frozenset(neurons) for _, sets in d["rows"] for (_, l), (neurons, _) in
                sets.items() if l == layer}
        assert len(seen) > 1, f"layer {layer}: one neuron set for every token"
    dense = np.asarray(dj.logits(config, d["params"], ids, mask))
    sparse_pos = (np.arange(T)[None] >= prefixes[:, None]) & d["mask"].astype(bool)
    assert np.abs(np.asarray(logits) - dense)[sparse_pos].max() > 1e-2


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
    nll, count, per_target = 0.0, 0, np.full(len(ids) - 1, np.nan)
    for begin, end, first in ppl_mod.plan_windows(len(ids), 16, 8):
        logits = np.asarray(dj.logits(config, params, [ids[begin:end].tolist()])[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for target in range(first, end + 1):
            nll -= logp[target - begin - 1, ids[target]]
            per_target[target - 1] = -logp[target - begin - 1, ids[target]]
            count += 1
    assert got["tokens"] == count == len(ids) - 1
    assert got["total_nll"] == pytest.approx(nll, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert np.isfinite(per_target).all()
    each = ppl_mod.score_windows(config, mode, params, None, ids, 16, 8, batch_tokens=48,
                                 token_nll=True)["token_nll"]
    np.testing.assert_allclose(each, per_target, rtol=1e-5)


def test_perplexity_with_a_lead_scores_each_window_after_it():
    config, params = _small_llama()
    rng = np.random.default_rng(2)
    ids = rng.integers(0, config.vocab_size, 40)
    lead = [int(rng.integers(0, config.vocab_size))]
    mode = ss.make_mode(config, "dense")
    got = ppl_mod.score_windows(config, mode, params, None, ids, 16, 8, batch_tokens=48,
                                token_nll=True, lead=lead)
    per_target = np.full(len(ids) - 1, np.nan)
    for begin, end, first in ppl_mod.plan_windows(len(ids), 16, 8):
        window = lead + ids[begin:end].tolist()
        logits = np.asarray(dj.logits(config, params, [window])[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for target in range(first, end + 1):  # input position of ids[target - 1]: + 1
            per_target[target - 1] = -logp[target - begin, ids[target]]
    assert np.isfinite(per_target).all() and got["tokens"] == len(ids) - 1
    np.testing.assert_allclose(got["token_nll"], per_target, rtol=1e-5)
    plain = ppl_mod.score_windows(config, mode, params, None, ids, 16, 8, batch_tokens=48)
    assert abs(got["total_nll"] - plain["total_nll"]) > 1e-3  # the lead is really there


def test_density_one_gives_the_dense_figures_exactly():
    config, params = _small_llama()
    pred = _random_predictors(config, 5)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 40)
    dense = ppl_mod.perplexity(config, ss.make_mode(config, "dense"), params, None, ids, 16, 8)
    assert math.isfinite(dense["total_nll"]) and dense["total_nll"] > 0
    for name in ("sparse", "oracle"):
        mode = ss.make_mode(config, name, 1.0, 1.0, dense_layers=1)
        got = ppl_mod.perplexity(config, mode, params, pred, ids, 16, 8)
        assert got["total_nll"] == dense["total_nll"], name
    # and a sparser setting does change the figure (the sparse path is live)
    got = ppl_mod.perplexity(config, ss.make_mode(config, "oracle", 0.3, 0.5, 1), params,
                             None, ids, 16, 8)
    assert math.isfinite(got["total_nll"]) and got["total_nll"] != dense["total_nll"]


# ---------------------------------------------------------------- zero-shot tasks


class _CharTokenizer:
    """One token per character (code point), enough for the scoring logic; `bos`: an id it
    puts first by default, as Gemma's tokenizer puts <bos>."""

    def __init__(self, bos=None):
        self.bos = bos

    def __call__(self, text, add_special_tokens=True):
        lead = [self.bos] if add_special_tokens and self.bos is not None else []
        return {"input_ids": lead + [ord(c) for c in text]}


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



def test_task_files_of_one_name_in_two_folders_are_both_scored(tmp_path):
    """Two task files named alike (a/planted.jsonl, b/planted.jsonl): the second replaced
    the first in the results; now each is scored under its own name, with the accuracy
    each gets alone."""
    config, params = _small_llama()
    query = "the cat sat on the mat and"
    letters = np.arange(ord("a"), ord("z") + 1)
    planted = "".join(map(chr, _greedy_ids(config, params, [ord(c) for c in query + " "], 6,
                                           letters)))
    other = "".join(map(chr, np.random.default_rng(3).choice(letters, 6)))
    paths = []
    for folder, golds in (("a", [0, 0]), ("b", [1])):  # a: the planted answer; b: the other
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / "planted.jsonl")
        paths[-1].write_text("\n".join(json.dumps({"query": query, "choices": [planted, other],
                                                   "gold": g}) for g in golds))
    mode = ss.make_mode(config, "dense")
    alone = [tasks_mod.evaluate(config, mode, params, None, tasks_mod.prepare(
        _CharTokenizer(), [str(p)], None), batch_tokens=128)["tasks"]["planted"]
        for p in paths]
    assert [r["acc"] for r in alone] == [1.0, 0.0] and [r["items"] for r in alone] == [2, 1]
    names = [str(p) for p in paths] + [str(paths[0])]  # the same file twice is scored once
    prepared = tasks_mod.prepare(_CharTokenizer(), names, None)
    assert list(prepared) == ["planted", str(paths[1])]
    assert list(tasks_mod.load_tasks(names, None)) == ["planted", str(paths[1])]
    res = tasks_mod.evaluate(config, mode, params, None, prepared, batch_tokens=128)["tasks"]
    assert res == {"planted": alone[0], str(paths[1]): alone[1]}


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_requests_past_the_models_positions_keep_their_last_tokens(family):
    """A model with 24 positions (OPT's learned ones; a Llama's context, as lm-eval
    truncates to max_position_embeddings): a 40-token request is scored on its last 25
    tokens (24 inputs), like the dense logits of that tail, finite; for OPT a continuation
    longer than the positions is refused."""
    if family == "opt":
        config = dj.preset("opt-tiny").replace(max_positions=24)
        params = dj.init_params(config, jax.random.key(3), jnp.float32, std=0.1)
    else:
        config, params = _small_llama()
        config = config.replace(max_positions=24)
    mode = ss.make_mode(config, "dense")
    ids = np.random.default_rng(4).integers(3, config.vocab_size, 40).tolist()
    context, continuation = ids[:37], ids[37:]
    loglik, _ = tasks_mod.score_requests(config, mode, params, None,
                                         [(context, continuation)], 128)
    tail = ids[-25:]
    logits = np.asarray(dj.logits(config, params, [tail[:-1]])[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = sum(logp[21 + i, continuation[i]] for i in range(3))
    assert np.isfinite(loglik[0])
    assert abs(loglik[0] - want) <= 1e-4 * abs(want)
    if family == "opt":
        with pytest.raises(ValueError, match="continuation of 30 tokens"):
            tasks_mod.score_requests(config, mode, params, None, [(ids[:10], ids[10:])], 128)


def test_default_perplexity_window_fits_the_models_positions():
    """The default window is 1024 tokens, or fewer where the model's context (with the
    tokenizer's leading ids before each window) is shorter, for rotary models too."""
    llama = dj.preset("llama-tiny")
    assert ppl_mod.default_window(llama, 0) == 1024
    assert ppl_mod.default_window(llama.replace(max_positions=128), 1) == 127
    assert ppl_mod.default_window(dj.preset("opt-tiny").replace(max_positions=512), 1) == 511


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


def test_frontier_labels_keep_fractional_percents():
    from dejavu_jax.eval.frontier import percent_label
    assert [percent_label(x) for x in (0.01, 0.005, 0.03, 0.15, 0.0025)] == [
        "1%", "0.5%", "3%", "15%", "0.25%"]


def test_token_cost_split_against_numpy():
    from dejavu_jax.eval.profile_ablation import token_cost_split
    rng = np.random.default_rng(3)
    dense = rng.uniform(1, 5, 200)
    delta = rng.uniform(0, 0.01, 200)
    delta[7] = 1.0                                         # one token carries most of it
    got = token_cost_split(dense, dense + delta)
    assert got["mean_nll_increase"] == pytest.approx(delta.mean())
    assert got["worst_1pct_share"] == pytest.approx(np.sort(delta)[::-1][:2].sum() / delta.sum())
    assert got["worst_1pct_share"] > 0.5
    assert got["worst_targets"][0] == [7, pytest.approx(1.0)] and len(got["worst_targets"]) == 20
    from dejavu_jax.eval.profile_ablation import worst_token_lines
    ids = np.arange(200)
    lines = worst_token_lines(got, ids, lambda t: " ".join(str(int(x)) for x in t))
    assert lines[2] == "| +1.00 | `0 1 2 3 4 5 6 7` → `8` |"      # target 8 follows 7
    assert got["half_costs"] == pytest.approx([np.exp(delta[:100].mean()) - 1,
                                               np.exp(delta[100:].mean()) - 1])


def test_profile_ablation_rows_leave_each_part_dense():
    """A profile whose only nonzero thresholds lie in one site and one layer: leaving that
    site, or that layer, dense gives the dense perplexity exactly; the others do not."""
    from dejavu_jax.eval.profile_ablation import ablation_rows
    from dejavu_jax.sparsity_profile import method_sites
    config, params = _small_llama()
    sites = method_sites(config, "teal")
    ids = np.random.default_rng(4).integers(0, config.vocab_size, 40).astype(np.int32)
    th = np.zeros((config.n_layers, len(sites)), np.float32)
    th[1, sites.index("down")] = 0.5
    rows = ablation_rows(config, params, ids, th, sites, 16, 48, log=lambda s: None)
    assert len(rows) == 2 + len(sites) + config.n_layers
    by = {(r["kind"], r["name"]): r for r in rows}
    dense, full = by["dense", "dense"], by["profile", "all sites"]
    assert dense["cost"] == 0 and math.isfinite(full["perplexity"])
    assert full["perplexity"] != dense["perplexity"] and full["bytes_skipped"] > 0
    assert by["site dense", "down"]["perplexity"] == dense["perplexity"]
    assert by["layer dense", "1"]["perplexity"] == dense["perplexity"]
    assert by["layer dense", "0"]["perplexity"] == full["perplexity"]
    assert by["site dense", "qkv"]["perplexity"] == full["perplexity"]


def test_profile_ablation_cli_refuses_a_missing_profile(tmp_path, capsys):
    from dejavu_jax.eval import profile_ablation
    with pytest.raises(SystemExit) as exit_:
        profile_ablation.main(["--profile", str(tmp_path / "none.json"), "--out",
                               str(tmp_path / "o")])
    assert exit_.value.code == 2 and "no such profile file" in capsys.readouterr().err


def test_save_result_makes_the_output_folders(tmp_path):
    """A result path in folders that do not exist yet is written, not lost after the run."""
    import json

    from dejavu_jax.eval.common import save_result
    path = tmp_path / "new" / "deeper" / "result.json"
    save_result(str(path), {"accuracy": 0.5})
    assert json.loads(path.read_text()) == {"accuracy": 0.5}


def test_task_contexts_start_with_the_tokenizers_leading_ids():
    """A tokenizer that puts a BOS first by default gets it at the head of every context
    (Gemma without its <bos> scored LAMBADA at 0.09 against 0.38 with it); one that puts
    nothing first is encoded as before; the continuation is the same either way."""
    from dejavu_jax.eval.tasks import encode_pair
    from dejavu_jax.tokenizer import leading_special_ids
    plain, with_bos = _CharTokenizer(), _CharTokenizer(bos=2)
    assert leading_special_ids(plain) == [] and leading_special_ids(with_bos) == [2]
    ctx, cont = encode_pair(plain, "ab ", "cd")
    assert ctx == [97, 98] and cont == [32, 99, 100]
    ctx_b, cont_b = encode_pair(with_bos, "ab ", "cd")
    assert ctx_b == [2, 97, 98] and cont_b == cont


def test_frontier_table_picks_the_largest_skip_within_each_budget():
    from dejavu_jax.eval.frontier import table

    def row(kind, method, label, text, ppl, skip):
        return dict(kind=kind, method=method, label=label, text=text, perplexity=ppl,
                    bytes_skipped=skip)
    rows = [row("dense", "dense", "dense", "wiki", 10.0, 0.0),
            row("dense", "dense", "dense", "py", 4.0, 0.0),
            row("path", "teal", "20%", "wiki", 10.05, 0.2),    # +0.5%
            row("path", "teal", "30%", "wiki", 10.2, 0.3),     # +2%
            row("path", "teal", "40%", "wiki", 10.5, 0.4),     # +5%
            row("profile", "teal", "1%", "wiki", 10.08, 0.25),
            row("oracle", "oracle-mlp", "40%", "wiki", 10.09, 0.4)]
    lines = table(rows).splitlines()
    body = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
            for line in lines[2:]}
    # a method with no row on a text gets no line for it
    assert set(body) == {("wiki", "teal"), ("wiki", "oracle-mlp")}
    cells = [c.strip() for c in body["wiki", "teal"].strip("|").split("|")]
    assert cells[2:] == ["20.0%", "30.0%", "1%: 25.0%, +0.80%"]
    cells = [c.strip() for c in body["wiki", "oracle-mlp"].strip("|").split("|")]
    assert cells[2:] == ["40.0%", "40.0%", "–"]


def test_files_with_a_utf8_byte_order_mark_read_as_without(tmp_path):
    """A UTF-8 byte order mark (as Windows editors write) made a JSON-lines task's first
    line `not JSON`, hid an RTE file's first column and went into perplexity and corpus
    text as a character; now it is dropped."""
    from dejavu_jax.eval import perplexity
    from dejavu_jax.eval import tasks as tasks_mod
    from dejavu_jax.train import corpus as corpus_lib
    files = {"t.jsonl": json.dumps({"query": "The sky is", "choices": ["blue", "red"],
                                    "gold": 0}) + "\n",
             "t.tsv": "sentence1\tsentence2\tlabel\tidx\nA man runs.\tA person runs.\t0\t0\n",
             "t.txt": "A context\n1\none\ntwo\nthree\nfour\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        (tmp_path / f"bom_{name}").write_text("\ufeff" + text, encoding="utf-8")
        plain = tasks_mod.load_task(str(tmp_path / name))
        assert tasks_mod.load_task(str(tmp_path / f"bom_{name}")) == plain
        assert not plain[0].pairs[0][0].startswith("\ufeff")
        assert perplexity.load_text(str(tmp_path / f"bom_{name}")) == text
        assert corpus_lib.read_text(tmp_path / f"bom_{name}") == text


def test_task_lists_drop_the_spaces_around_names():
    """`--tasks "copa, piqa"` looked for a file named ' piqa'."""
    from dejavu_jax.eval import tasks as tasks_mod
    assert tasks_mod.parse_tasks("copa, piqa ,") == ["copa", "piqa"]
    assert tasks_mod.parse_tasks(" all ") == list(tasks_mod.TASK_FILES)
    assert tasks_mod.parse_tasks("a.jsonl,b.tsv") == ["a.jsonl", "b.tsv"]
