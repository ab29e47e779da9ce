"""Activation sparsity by thresholds (TEAL's input channels, CATS' gate): the masks against
numpy, the decode step against the scorer for every family, the bytes a token reads,
calibration against numpy, the allocation search, and profiles."""

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import activation_sparsity as act
from dejavu_jax import ops, sparse
from dejavu_jax.params import unstack_layers
from dejavu_jax.eval import sparse_scoring as ss
from dejavu_jax.eval.kernel_parity import KERNELS_ON
from dejavu_jax.kernels import ThresholdConfig
from dejavu_jax.sparsity_profile import (ProfileError, SparsityProfile, encode_gate_weights,
                                         load_profile, method_sites)
from dejavu_jax.train import allocate
from dejavu_jax.train.thresholds import QUANTILES, calibration_stats, thresholds_at

HF = Path(__file__).parent / "fixtures" / "hf"
ALL_SITES = ("qkv", "o", "gate_up", "gate", "down")


@functools.cache
def _model(name):
    """(config, fp32 params) of a tiny model: a preset cut to 3 layers and 512 tokens, or
    one of the random Hugging Face fixtures (Qwen2 with q/k/v biases; Gemma 3 with
    post-norms, q/k norms and a 6-token sliding window)."""
    if name in ("opt-tiny", "llama-tiny"):
        config = dj.preset(name).replace(n_layers=3, vocab_size=512)
        return config, dj.init_params(config, jax.random.key(3), jnp.float32, std=0.15)
    return dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)


def _sites(config):
    return tuple(s for s in ALL_SITES if s != "gate" or config.gated_mlp)


def _thresholds(config, params, ids, level=0.4):
    """Thresholds that drop about `level` of every site's channels on `ids`, from the
    calibration quantiles (layer 0 stays dense). The quantiles do not depend on the
    levels whose costs calibration_stats measures, so none are asked for (no backward
    pass to compile)."""
    stats = calibration_stats(config, params, ids, jnp.ones_like(ids), ())
    levels = np.full((config.n_layers, len(ALL_SITES)), level)
    levels[0] = 0
    return thresholds_at(np.asarray(stats["quantiles"]), levels)


@pytest.mark.parametrize("weighted", [False, True])
def test_mlp_masks_equal_numpy(rng, weighted):
    """The thresholded gated MLP against numpy: gate_up drops input channels, the gate site
    drops neurons (their up and down rows) by |act(gate)|, or by |act(gate)| times the
    layer's gate weights, the down site drops small activations."""
    config, params = _model("llama-tiny")
    lp = jax.tree.map(lambda w: w[1], params.layers)
    gw = rng.uniform(0.1, 3.0, config.ffn).astype(np.float32) if weighted else np.ones(config.ffn)
    if weighted:
        lp = lp.replace(gate_weight=jnp.asarray(gw))
    y = rng.standard_normal((5, config.hidden)).astype(np.float32)
    w_in, w_gate, w_out = (np.asarray(w, np.float64) for w in (lp.w_in, lp.w_gate, lp.w_out_t))
    t = np.zeros(5, np.float32)  # thresholds at quantiles of the data, set site by site
    t[2] = np.quantile(np.abs(y), 0.4)
    ys = np.where(np.abs(y) > t[2], y, 0.0)
    g = ys @ w_gate.T
    g = g / (1 + np.exp(-g))
    t[3] = np.quantile(np.abs(g) * gw, 0.4)
    neurons = np.abs(g) * gw > t[3]
    h = np.where(neurons, g * (ys @ w_in.T), 0.0)
    t[4] = np.quantile(np.abs(h[neurons]), 0.3)
    h = np.where(np.abs(h) > t[4], h, 0.0)
    out, kept = act.mlp(config, lp, jnp.asarray(y), jnp.asarray(t))
    assert 0.3 < neurons.mean() < 0.8 and 0.3 < (ys != 0).mean() < 0.8
    if weighted:  # the weights change which neurons pass
        assert (neurons != (np.abs(g) > np.quantile(np.abs(g), 0.4))).any()
    assert_finite_close(np.asarray(out), h @ w_out, rtol=1e-5, atol=1e-6)
    want = np.stack([(ys != 0).mean(-1), neurons.mean(-1), (h != 0).mean(-1)], -1)
    assert_finite_close(np.asarray(kept), want, rtol=1e-6)


def test_attention_hooks_mask_by_magnitude():
    t = jnp.asarray([0.5, 0.25, 0, 0, 0], jnp.float32)
    mask_input, mask_heads = act.attention_hooks(t)
    y = jnp.asarray([[0.375, -0.625, 0.5, 2.0]])
    np.testing.assert_array_equal(np.asarray(mask_input(y)), [[0.0, -0.625, 0.0, 2.0]])
    heads = jnp.asarray([[[0.125, -0.375], [0.25, 1.0]]])
    np.testing.assert_array_equal(np.asarray(mask_heads(heads)), [[[0.0, -0.375], [0.0, 1.0]]])


def _decode_rows(config, params, scfg, thresholds, ids, prefixes):
    """Per row: logits of a dense prefill of its prefix, then one threshold-sparse step per
    remaining token at batch 1 (teacher forcing)."""
    eng = sparse.sparse_engine(config, scfg, sparse.no_selector)
    step, prefill = jax.jit(eng.step), jax.jit(eng.prefill)
    rows = []
    for r, prefix in enumerate(prefixes):
        state = eng.init_state(1, ids.shape[1] + 1, jnp.float32)
        prompt = jnp.asarray(ids[r:r + 1, :prefix], jnp.int32)
        logits, state = prefill((params, thresholds), prompt, jnp.ones_like(prompt), state)
        out = [np.asarray(logits[0])]
        for i in range(prefix, ids.shape[1]):
            logits, state = step((params, thresholds), state,
                                 jnp.asarray(ids[r, i:i + 1], jnp.int32))
            out.append(np.asarray(logits[0]))
        rows.append(np.stack(out))
    return rows


def _gate_weighted(config, params, ids):
    """params with gate weights measured on `ids` (`train.thresholds.gate_weights`)."""
    from dejavu_jax.train.profile import gate_weighted
    return gate_weighted(config, params, np.asarray(ids), 2, ("gate",))


@pytest.mark.parametrize("name,weighted", [("opt-tiny", False), ("llama-tiny", False),
                                           ("qwen2", True), ("gemma3", True)])
def test_scorer_equals_threshold_decode(name, weighted):
    """Threshold mode at about 40% of every site: the scorer's logits for three rows with
    their own dense prefixes (one [3, T] window) equal each row's token-by-token decode at
    every position from prefix - 1 on, and differ from the dense model's. Gemma's rows run
    past its 6-token window. Qwen2 and Gemma rank the gate by gate weights."""
    config, params = _model(name)
    T, prefixes = 10, (1, 3, 2)
    ids = np.random.default_rng(5).integers(3, config.vocab_size, (3, T)).astype(np.int32)
    if weighted:
        params = _gate_weighted(config, params, ids)
    thresholds = jnp.asarray(_thresholds(config, params, jnp.asarray(ids)))
    scfg = sparse.threshold_config(config, _sites(config))
    want = _decode_rows(config, params, scfg, thresholds, ids, prefixes)
    logits, (_, _, kept) = ss.window_logits(config, scfg, params, thresholds,
                                            jnp.asarray(ids), jnp.ones((3, T), jnp.int32),
                                            jnp.asarray(prefixes, jnp.int32))
    logits, kept = np.asarray(logits), np.asarray(kept)
    scale = max(np.abs(w).max() for w in want)
    for r, prefix in enumerate(prefixes):
        assert_finite_close(logits[r, prefix - 1:], want[r], atol=2e-5 * scale,
                            err_msg=f"{name} row {r}")
    dense = np.asarray(dj.logits(config, params, jnp.asarray(ids)))
    assert np.abs(logits - dense)[0, 1:].max() > 1e-2 * scale
    sparse_kept = kept[1:, 0, 1:][..., [ALL_SITES.index(s) for s in _sites(config)]]
    assert 0.3 < sparse_kept.mean() < 0.8  # the thresholds drop channels in every site
    # the dense layer and prefix keep every channel but exact zeros, which drop freely
    # (ReLU's half of the neurons, GELU's that underflow)
    dense_cols = [i for i, s in enumerate(ALL_SITES) if config.gated_mlp or s != "down"]
    assert (kept[0][..., dense_cols] > 0.9).all()
    assert (kept[:, 1, :3][..., dense_cols] > 0.9).all()


def test_zero_thresholds_are_the_dense_model():
    config, params = _model("gemma3")
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 500, (2, 9)), jnp.int32)
    scfg = sparse.threshold_config(config, _sites(config))
    zero = jnp.zeros((config.n_layers, len(ALL_SITES)), jnp.float32)
    logits, _ = ss.window_logits(config, scfg, params, zero, ids, jnp.ones_like(ids),
                                 jnp.ones((2,), jnp.int32))
    assert_finite_close(np.asarray(logits), np.asarray(dj.logits(config, params, ids)),
                        rtol=1e-5, atol=1e-5)


def test_read_fraction_counts_the_rows_each_matmul_reads():
    """Per position: the kept fractions weighted by each matmul's size, over all layers;
    with the gate site the up projection follows the neurons, without it the inputs; the
    down projection reads nonzero rows under the down or the gate site, else all."""
    config, _ = _model("llama-tiny")
    L, m = config.n_layers, act.matmul_elements(config)
    kept = np.random.default_rng(2).uniform(0.2, 1.0, (L, 1, 4, len(ALL_SITES)))
    ones = np.ones((L, 1, 4, 1), bool)
    cases = ((ALL_SITES, "gate", True), (("qkv", "o", "gate_up", "down"), "gate_up", True),
             (("gate",), "gate", True), (("qkv", "o"), "gate_up", False))
    for sites, up, down_rows in cases:
        scfg = sparse.threshold_config(config, sites)
        got = np.asarray(ss.read_fraction(config, scfg, (ones, ones, jnp.asarray(kept))))
        k = {s: kept[..., i] if s in sites else 1.0 for i, s in enumerate(ALL_SITES)}
        # the gate site's neurons are the down rows read even without the down site
        down = kept[..., ALL_SITES.index("down")] if down_rows else 1.0
        want = (m["qkv"] * k["qkv"] + m["o"] * k["o"] + m["gate"] * k["gate_up"]
                + m["up"] * k[up] + m["down"] * down).mean(0) / act.layer_elements(config)
        assert_finite_close(got, want, rtol=1e-6)


def test_calibration_quantiles_and_errors_equal_numpy():
    """Quantiles of |site| over positions 1..T-1 and the down site's relative error (the
    dropped rows' contribution against the residual stream entering the MLP)."""
    config, params = _model("llama-tiny")
    ids = jnp.asarray(np.random.default_rng(4).integers(3, 500, (2, 12)), jnp.int32)
    stats = calibration_stats(config, params, ids, jnp.ones_like(ids), (0.5,))
    _, _, recs = dj.model.sequence_forward(config, params, ids, records=True)
    layer = 1
    hidden = np.asarray(recs["mlp_act"][layer], np.float64)[:, 1:].reshape(-1, config.ffn)
    q = np.quantile(np.abs(hidden), QUANTILES)
    # the records and the calibration compute the activations in float32 by different paths
    assert_finite_close(np.asarray(stats["quantiles"][layer, act.DOWN]), q, rtol=1e-3,
                        atol=1e-6)
    dropped = np.where(np.abs(hidden) > q[50], 0.0, hidden)
    w_out = np.asarray(params.layers.w_out_t[layer], np.float64)
    h = np.asarray(recs["mlp_in"][layer], np.float64)[:, 1:].reshape(-1, config.hidden)
    want = np.sum((dropped @ w_out) ** 2) / np.sum(h ** 2)
    assert_finite_close(float(stats["errors"][layer, act.DOWN, 0]), want, rtol=1e-3)
    assert np.all(np.asarray(stats["nll_second"]) >= 0)


def test_gate_weights_and_their_quantiles_equal_numpy():
    """Gate weights: E|up_i| over positions 1..T-1 of the dense model times the norm of
    the down row, mean 1 per layer; the calibration's gate quantiles are then those of
    |act(gate)| times the weights."""
    config, params = _model("llama-tiny")
    ids = jnp.asarray(np.random.default_rng(4).integers(3, 500, (3, 12)), jnp.int32)
    weighted = _gate_weighted(config, params, ids)
    _, _, recs = dj.model.sequence_forward(config, params, ids, records=True)
    layer = 2
    lp = jax.tree.map(lambda w: w[layer], params.layers)
    y = np.asarray(ops.norm(recs["mlp_in"][layer], lp.mlp_norm_scale, None,
                               config.norm_eps), np.float64)[:, 1:].reshape(-1, config.hidden)
    up = np.abs(y @ np.asarray(lp.w_in, np.float64).T).mean(0)
    want = up * np.linalg.norm(np.asarray(lp.w_out_t, np.float64), axis=-1)
    got = np.asarray(weighted.layers.gate_weight[layer])
    assert_finite_close(got, want / want.mean(), rtol=1e-4)
    assert np.std(got) > 0.05  # neurons differ: the ranking changes
    stats = calibration_stats(config, weighted, ids, jnp.ones_like(ids), ())  # quantiles only
    g = y @ np.asarray(lp.w_gate, np.float64).T
    mag = np.abs(g / (1 + np.exp(-g))) * got
    assert_finite_close(np.asarray(stats["quantiles"][layer, act.GATE]),
                        np.quantile(mag, QUANTILES), rtol=1e-3, atol=1e-6)


def test_allocation_maximises_price_times_bytes_minus_cost(rng):
    levels = (0.25, 0.5, 0.75)
    costs = np.maximum.accumulate(
        np.concatenate([np.zeros((3, 5, 1)), rng.uniform(0, 1, (3, 5, 3))], -1), -1)
    unit_bytes = np.asarray([4.0, 1.0, 2.0, 0.0, 3.0])
    for price in (0.1, 1.0, 3.0):
        got = allocate.allocation(costs, levels, unit_bytes, price)
        grid = np.asarray((0.0,) + levels)
        for l in range(3):
            for s in range(5):
                gains = price * unit_bytes[s] * grid - costs[l, s]
                assert gains[list(grid).index(got[l, s])] == gains.max()
    path = allocate.allocation_path(costs, levels, unit_bytes)
    skips = [allocate.predicted_skip(dj.preset("llama-tiny").replace(n_layers=3),
                                     ALL_SITES, lv) for _, lv in path]
    assert len(path) > 3 and skips == sorted(skips) and (path[-1][1][:, 3] == 0).all()


def test_search_keeps_the_sparsest_point_within_budget():
    path = [(float(i), np.full((1, 5), i / 10)) for i in range(10)]
    calls = []

    def measure(lv):
        calls.append(lv[0, 0])
        return lv[0, 0] ** 2, lv[0, 0]  # cost grows along the path

    best, points = allocate.search(path, measure, budget_nll=0.3)
    assert best == 5 and len(calls) <= 4 and all(p.nll_cost == p.bytes_skipped ** 2
                                                 for p in points)
    assert allocate.search(path[1:], measure, budget_nll=0.0)[0] == -1


def test_search_margin_holds_cost_plus_standard_errors_to_the_budget():
    """With a margin, an allocation is within the budget when its cost plus that many
    standard errors is: the search stops earlier on the path, at the point numpy's rule
    picks."""
    path = [(float(i), np.full((1, 5), i / 10)) for i in range(10)]
    se = 0.02

    def measure(lv):
        return lv[0, 0] ** 2, lv[0, 0], se

    for margin in (0.0, 1.0, 3.0):
        expect = max(i for i in range(10) if (i / 10) ** 2 + margin * se <= 0.3)
        best, points = allocate.search(path, measure, budget_nll=0.3, margin=margin)
        assert best == expect and all(p.nll_se == se for p in points)
    assert allocate.search(path, measure, 0.3, margin=1.0)[0] == 5
    assert allocate.search(path, measure, 0.3, margin=3.0)[0] == 4


def test_paired_standard_error_equals_numpy(rng):
    from dejavu_jax.train.profile import paired_standard_error
    d = rng.standard_normal(37) * 0.01 + 0.003
    assert paired_standard_error(d) == pytest.approx(np.std(d, ddof=1) / np.sqrt(37),
                                                     rel=1e-12)
    assert paired_standard_error(d[:1]) == 0.0


def test_refined_search_finds_the_sparsest_allocation_of_a_fine_path(rng):
    """Between two neighbours of the coarse path (geometric prices) lie allocations that
    skip more within the budget; the refined search finds the sparsest one that a
    2,000-price path (exhaustively measured) holds."""
    levels = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    costs = np.maximum.accumulate(np.concatenate(
        [np.zeros((8, 5, 1)), rng.uniform(0, 1, (8, 5, 9)) ** 3], -1), -1)
    unit_bytes = np.asarray([4.0, 1.0, 2.0, 3.0, 3.0])
    total = unit_bytes.sum() * 8

    def measure(lv):  # the cost the allocation predicts, and its skipped bytes
        idx = np.rint(lv * 10).astype(int)
        cost = np.take_along_axis(costs, idx[..., None], -1).sum()
        return float(cost), float((lv * unit_bytes).sum() / total)

    budget = 0.3 * costs[..., -1].sum()
    fine = allocate.allocation_path(costs, levels, unit_bytes, points=2000)
    within = [measure(lv)[1] for _, lv in fine if measure(lv)[0] <= budget]
    coarse = allocate.allocation_path(costs, levels, unit_bytes)
    coarse_best = coarse[allocate.search(coarse, measure, budget)[0]][1]
    best, points = allocate.refined_search(costs, levels, unit_bytes, measure, budget,
                                           refinements=8)
    assert measure(best[1])[0] <= budget
    assert measure(best[1])[1] == pytest.approx(max(within))
    assert measure(best[1])[1] > measure(coarse_best)[1]
    assert [p.price for p in points] == sorted(p.price for p in points)
    assert allocate.refined_search(costs, levels, unit_bytes, measure, -1.0)[0] is None


def test_profile_round_trip_and_checks(tmp_path):
    config, _ = _model("llama-tiny")
    L = config.n_layers
    profile = SparsityProfile(config.name, config.fingerprint(), "teal",
                              method_sites(config, "teal"), [[0.5] * 5] * L, [[0.1] * 5] * L,
                              {"ppl_cost": 0.01, "bytes_skipped": 0.3})
    path = profile.save(tmp_path / "p.json")
    loaded = load_profile(path, config)
    assert loaded == profile and loaded.threshold_array().shape == (L, 5)
    assert "30.0%" in loaded.summary()
    load_profile(path, config.replace(name="a-renamed-copy"))   # the name is not the model
    with pytest.raises(ProfileError, match="does not fit"):
        load_profile(path, config.replace(norm_eps=config.norm_eps * 2))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="not a sparsity profile"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="gated MLP"):
        method_sites(dj.preset("opt-tiny"), "cats")


@pytest.mark.parametrize("change, message", [
    (dict(method="bogus"), "unknown method 'bogus'"),
    (dict(sites=("qkv", "foo")), r"unknown activation sites \['foo'\]"),
    (dict(thresholds="abc"), "thresholds must be a table of numbers"),
    (dict(thresholds=[["abc"] * 5] * 2), "thresholds must be a table of numbers"),
    (dict(thresholds=[[float("nan")] * 5] * 2), "thresholds must be finite numbers >= 0"),
    (dict(thresholds=[[-0.1] * 5] * 2), "thresholds must be finite numbers >= 0"),
    (dict(levels=[[1.5] * 5] * 2), r"levels are fractions of channels, in \[0, 1\]"),
    (dict(measured="x"), "measured must be a JSON object"),
    (dict(measured={"ppl_cost": "low"}), "measured.ppl_cost must be a number"),
    (dict(measured={"test": {"wikitext": {"tokens": 10}}}), "measured.test must map"),
])
def test_a_malformed_profile_is_refused_when_it_loads(tmp_path, change, message):
    """Thresholds that are not finite numbers >= 0, an unknown method or site, or a broken
    `measured` record: one ProfileError naming the problem, before any decode runs."""
    good = SparsityProfile("m", "f", "teal", ("qkv", "o", "gate_up", "down"),
                           [[0.5] * 5] * 2, [[0.1] * 5] * 2,
                           {"ppl_cost": 0.01, "test": {"wikitext": {
                               "ppl_cost": 0.01, "tokens": 10, "bytes_skipped": 0.2}}})
    assert load_profile(good.save(tmp_path / "good.json")).summary().count("%") == 2
    path = dataclasses.replace(good, **change).save(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


_GOOD_FIELDS = {"model": "m", "fingerprint": "f", "method": "teal", "sites": ["qkv"],
                "levels": [[0.5] * 5] * 2, "thresholds": [[0.1] * 5] * 2}


@pytest.mark.parametrize("text, message", [
    ("{}", "missing field(s) 'model', 'fingerprint', 'method', 'sites', 'levels', "
           "'thresholds'"),
    (json.dumps({k: v for k, v in _GOOD_FIELDS.items() if k != "thresholds"}),
     "missing field(s) 'thresholds'"),
    (json.dumps({k: v for k, v in _GOOD_FIELDS.items() if k not in ("sites", "levels")}),
     "missing field(s) 'sites', 'levels'"),
    (json.dumps({**_GOOD_FIELDS, "extra": 1}), "unknown field(s) 'extra'"),
    (json.dumps({**_GOOD_FIELDS, "sites": 5}), "sites must be a list of site names, got a "
                                               "number"),
    ("[1, 2]", "the file holds an array, not an object"),
    ("{", "not valid JSON (Expecting property name enclosed in double quotes at line 1, "
          "column 2)"),
])
def test_a_profile_file_of_the_wrong_shape_names_what_is_wrong(tmp_path, text, message):
    """A file `{}` was refused with `(KeyError: 'sites')`, one without thresholds with
    `(TypeError: SparsityProfile.__init__() missing 1 required positional argument...)`;
    now the fields missing or unknown, after the file's name."""
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as error:
        load_profile(path)
    assert str(error.value) == f"{path}: not a sparsity profile: {message}"
    assert isinstance(error.value, ValueError) and "Error" not in str(error.value)
    path.write_text(json.dumps(_GOOD_FIELDS))
    assert load_profile(path).sites == ("qkv",)


def test_profile_gate_weights_round_trip_and_reach_the_params(tmp_path):
    config, params = _model("llama-tiny")
    L, F = config.n_layers, config.ffn
    w = np.random.default_rng(3).uniform(0.01, 5.0, (L, F)).astype(np.float32)
    profile = SparsityProfile(config.name, config.fingerprint(), "cats", ("gate",),
                              [[0.5] * 5] * L, [[0.1] * 5] * L,
                              gate_weights=encode_gate_weights(w))
    loaded = load_profile(profile.save(tmp_path / "p.json"), config)
    assert_finite_close(loaded.gate_weight_array(), w, rtol=1e-3)  # float16
    got = loaded.weighted_params(params).layers.gate_weight
    assert_finite_close(np.asarray(got), w, rtol=1e-3)
    unstacked = loaded.weighted_params(unstack_layers(params))
    assert_finite_close(np.asarray(unstacked.layers[1].gate_weight), w[1], rtol=1e-3)
    plain = dataclasses.replace(loaded, gate_weights=None)
    assert plain.weighted_params(loaded.weighted_params(params)).layers.gate_weight is None
    for bad in (encode_gate_weights(w[:, :-1]), encode_gate_weights(-w), ["@@"] * L):
        dataclasses.replace(loaded, gate_weights=bad).save(tmp_path / "bad.json")
        with pytest.raises(ProfileError, match="gate weights"):
            load_profile(tmp_path / "bad.json", config)


def test_threshold_config_rejects_bad_sites():
    with pytest.raises(ValueError, match="unknown activation sites"):
        sparse.threshold_config(dj.preset("llama-tiny"), ("qkv", "mlp"))
    with pytest.raises(ValueError, match="gated MLP"):
        sparse.threshold_config(dj.preset("opt-tiny"), ("gate",))


def test_profile_search_runs_end_to_end_on_a_tiny_model():
    """make_profile on random windows: the chosen point's measured cost is within the
    budget and its thresholds are those of its levels."""
    from dejavu_jax.train.profile import gate_weighted, make_profile
    config, params = _model("llama-tiny")
    windows = np.random.default_rng(6).integers(3, 500, (8, 16)).astype(np.int32)
    weighted = gate_weighted(config, params, windows[:4], 4, ("gate",))
    profile = make_profile(config, weighted, windows[:4], windows[4:], "teal+cats", 0.05,
                           levels=(0.3, 0.6), rows=4, progress=False, log=lambda s: None)
    m = profile.measured
    assert m["ppl_cost"] <= 0.05 + 1e-9 and m["margin_se"] == 1.0
    assert m["nll_cost"] + m["nll_se"] <= math.log1p(0.05) + 1e-9 and m["nll_se"] > 0
    assert_finite_close(profile.gate_weight_array(), np.asarray(weighted.layers.gate_weight),
                        rtol=1e-3)
    assert math.isclose(profile.measured["ppl_cost"], math.expm1(profile.measured["nll_cost"]))
    assert np.shape(profile.thresholds) == (config.n_layers, 5)
    assert (np.asarray(profile.thresholds) > 0).sum() == (np.asarray(profile.levels) > 0).sum()


# Qwen2's biases and Gemma 3's post-norms through these kernels: kernel_parity's
# threshold check (gemma3-tiny) and the scorer tests above (the reference path)
@pytest.mark.parametrize("name,up_rows,unrolled", [("llama-tiny", True, True),
                                                   ("llama-tiny", False, True),
                                                   ("opt-tiny", False, False),
                                                   ("qwen2", False, False),
                                                   ("phi3-partial", False, False),
                                                   ("qwen3-window", False, True)])
def test_threshold_kernels_decode_like_the_reference(monkeypatch, name, up_rows, unrolled):
    """Teacher-forced threshold decoding through the Pallas kernels (interpreted) on
    input-major weights (the up projection by neuron rows under the gate site, or by input
    channels: a gated MLP's gate and up then share one launch) equals the jnp computation
    on the usual weights, step by step; per-layer buffers and stacked weights; with the
    default `ThresholdConfig` (the attention kernel, over stacked weights with the q/k/v
    partials summed by XLA first, elsewhere in it; the gated units' kernel), with the
    attention and the units in XLA's ops, and with every switch on
    (`kernel_parity.KERNELS_ON`, adding one sum of a program's rows). Qwen2's q/k/v biases,
    Phi-3's partial rotary embedding, Qwen3's q/k norms and sliding window."""
    from dejavu_jax.params import input_major
    if not unrolled:
        monkeypatch.setattr(sparse, "_ATTENTION_PARTS", 1)
    config, params = _model(name)
    ids = np.random.default_rng(8).integers(3, config.vocab_size, (1, 8)).astype(np.int32)
    if config.gated_mlp:  # the gate ranked by gate weights
        params = _gate_weighted(config, params, ids)
    thresholds = jnp.asarray(_thresholds(config, params, jnp.asarray(ids)))
    sites = _sites(config) if up_rows else tuple(s for s in _sites(config) if s != "gate")
    moved = input_major(params, up_rows=up_rows)
    assert moved.layers.wq is None and (moved.layers.w_in is None) != up_rows
    if unrolled:
        moved = unstack_layers(moved)
    steps = []
    xla_ops = dataclasses.replace(ThresholdConfig(), attention_kernel=False,
                                  gated_kernel=False)
    for impl, p, blocks in (("reference", params, None), ("interpret", moved, None),
                            ("interpret", moved, xla_ops), ("interpret", moved, KERNELS_ON)):
        scfg = dataclasses.replace(sparse.threshold_config(config, sites, impl=impl),
                                   threshold_blocks=blocks)
        steps.append(_decode_rows(config, p, scfg, thresholds, ids, (2,))[0])
    scale = np.abs(steps[0]).max()
    for got in steps[1:]:  # the defaults, XLA's ops, every switch on
        assert_finite_close(got, steps[0], atol=2e-5 * scale)


@pytest.mark.parametrize("unrolled", [True, False])
def test_threshold_kernels_take_each_projections_block_settings(monkeypatch, unrolled):
    """`SparseConfig.threshold_blocks` reaches each projection's launch in every layer (a
    looped, pipelined down projection without the evict-first hint, narrow gate/up blocks
    in column-first order, one row block for q/k/v, the out-projection's partials summed
    into the residual by XLA; over per-layer buffers the attention and the gated units in
    XLA's ops, over stacked weights in the decode-attention and unit-finish kernels), over
    per-layer buffers and under `lax.scan` over stacked weights, and the interpreted step
    still equals the jnp computation."""
    import dataclasses
    from dejavu_jax.eval.bench_thresholds import with_settings
    from dejavu_jax.kernels import threshold_matvec as module
    from dejavu_jax.params import input_major
    config, params = _model("llama-tiny")
    ids = np.random.default_rng(9).integers(3, config.vocab_size, (1, 6)).astype(np.int32)
    thresholds = jnp.asarray(_thresholds(config, params, jnp.asarray(ids)))
    sites = tuple(s for s in _sites(config) if s != "gate")
    blocks = with_settings(ThresholdConfig(),
                           "down.row_blocks=8,down.num_stages=3,gate_up.block_rows=32,"
                           "gate_up.block_n=64,qkv.row_blocks=1,o.block_n=64,o.num_warps=2,"
                           "o.residual_atomics=0,down.evict_first=0,gate_up.columns_first=1"
                           + (",attention_kernel=0,gated_kernel=0" if unrolled else ""))
    from dejavu_jax.kernels import gated_hidden as gated_module
    from dejavu_jax.kernels import head_attention

    def spied(owner, name, keyword):  # the calls' `keyword` values, as the kernel is traced
        calls, real = [], getattr(owner, name)
        monkeypatch.setattr(owner, name,
                            lambda *a, **kw: calls.append(kw[keyword]) or real(*a, **kw))
        return calls
    attention_launches = spied(head_attention, "decode_attention", "group")
    finishes = spied(gated_module, "gated_hidden", "activation")
    seen = []
    for name in ("threshold_matvec", "threshold_matvecs"):
        real = getattr(module, name)

        def spy(x, w, *a, real=real, **kw):
            seen.append((w.shape if hasattr(w, "shape") else len(w), kw["block_rows"],
                         kw["block_n"], kw["row_blocks"], kw["max_row_blocks"],
                         kw["num_warps"], kw["num_stages"], kw["evict_first"],
                         kw["columns_first"], kw["residual_atomics"]))
            return real(x, w, *a, **kw)
        monkeypatch.setattr(module, name, spy)
    moved = input_major(params)
    steps = []
    for impl, p in (("reference", params), ("interpret", unstack_layers(moved) if unrolled
                                            else moved)):
        scfg = dataclasses.replace(sparse.threshold_config(config, sites, impl=impl),
                                   threshold_blocks=blocks)
        steps.append(_decode_rows(config, p, scfg, thresholds, ids, (2,))[0])
    assert_finite_close(steps[1], steps[0], atol=2e-5 * np.abs(steps[0]).max())
    d, F = config.hidden, config.ffn
    rows = 1 if unrolled else config.n_layers   # stacked: every layer's rows, read in place
    # q/k/v: one matrix through threshold_matvecs' partials into the attention kernel
    qkv_key = (rows * d, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim) \
        if unrolled else 1
    expected = {qkv_key: {(16, 512, 1, 4, 4, 2, True, False, True)},
                (rows * config.n_heads * config.head_dim, d):
                {(16, 64, None, 4, 2, 2, True, False, False)},
                2: {(32, 64, None, 4, 4, 2, True, True, True)},
                (rows * F, d): {(16, 512, 8, 8, 4, 3, False, False, True)}}
    got = {}
    for shape, *settings in seen:
        got.setdefault(shape, set()).add(tuple(settings))
    assert got == expected
    calls = len(seen)
    assert calls == 4 * (config.n_layers if unrolled else 1)   # traced once per layer or scan
    assert attention_launches == ([] if unrolled else [config.group_size])
    assert finishes == ([] if unrolled else [config.activation])
