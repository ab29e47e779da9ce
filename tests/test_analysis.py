"""dejavu_jax.eval.sparsity_analysis: the notebook's measurements, on hand-made arrays
and a tiny model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.eval import sparsity_analysis as an
from dejavu_jax.model import sequence_forward
from dejavu_jax.train.predictor_model import PredictorParams, init_predictor


def test_mass_count_and_sets():
    s = np.array([[5.0, 3.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(an.mass_count(s, 0.5), [1, 0, 2])
    np.testing.assert_array_equal(an.mass_count(s, 0.8), [2, 0, 4])
    np.testing.assert_array_equal(an.mass_count(s, 1.0), [4, 0, 4])
    sets = an.mass_sets(s, 0.8)
    np.testing.assert_array_equal(sets[0], [True, True, False, False])
    assert not sets[1].any() and sets[2].all()
    with pytest.raises(ValueError):
        an.mass_count(s, 0.0)


def test_mass_sets_match_count_on_random(rng):
    s = rng.exponential(size=(3, 50, 64))
    sets = an.mass_sets(s, 0.9)
    np.testing.assert_array_equal(sets.sum(-1), an.mass_count(s, 0.9))
    cap = an.captured_mass(s, sets)
    assert (cap >= 0.9 - 1e-9).all()
    # dropping the smallest member falls below the mass: the set is minimal
    smallest = np.where(sets, s, np.inf).min(-1)
    assert ((cap - smallest / s.sum(-1)) < 0.9).all()


def test_top_fraction_sets():
    s = np.array([[0.1, -3.0, 2.0, 0.5]])
    np.testing.assert_array_equal(an.top_fraction_sets(s, 0.5), [[False, True, True, False]])


def test_jaccard_static_mask_and_pairing():
    a = np.array([1, 1, 0, 0], bool)
    b = np.array([0, 1, 1, 0], bool)
    assert an.jaccard(a, b) == pytest.approx(1 / 3)
    assert an.jaccard(np.zeros(3, bool), np.zeros(3, bool)) == 1.0
    sets = np.array([[[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0]]], bool)  # [L=1, N=3, n=4]
    np.testing.assert_array_equal(an.static_mask(sets), [[True, True, False, False]])
    same = np.broadcast_to(sets[:, :1, None], (1, 2, 5, 4))  # every token has one set
    for v in an.overlap_by_pairing(same, n_pairs=50).values():
        np.testing.assert_allclose(v, 1.0)


def test_captured_mass_broadcasts_a_static_mask():
    s = np.array([[[1.0, 3.0], [2.0, 2.0]]])  # [L=1, N=2, n=2]
    np.testing.assert_allclose(an.captured_mass(s, np.array([[[False, True]]])),
                               [[0.75, 0.5]])


def test_cosine_across_layers():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(1, 40, 16))
    stream = np.concatenate([base, 3 * base, -base], axis=0)  # L=3
    cos = an.cosine_across_layers(stream, (0, 1, 2))
    np.testing.assert_allclose(cos[1][:2], [1.0, -1.0])
    np.testing.assert_allclose(cos[2][0], -1.0)
    assert np.isnan(cos[1][2]) and np.isnan(cos[2][1:]).all()
    assert abs(cos[0][0]) < 0.5  # different random tokens are not aligned


def test_union_density():
    n = 16
    sets = np.eye(n, dtype=bool)[None]  # token i activates unit i only
    u = an.union_density(sets, [1, 4, 16], n_draws=5)
    np.testing.assert_allclose(u[:, 0], [1 / 16, 4 / 16, 1.0])
    groups = np.repeat(np.arange(4), 4)  # 4 windows of 4 tokens
    u = an.union_density(sets, [4, 8], n_draws=5, groups=groups)
    np.testing.assert_allclose(u[:, 0], [4 / 16, 8 / 16])
    with pytest.raises(ValueError):
        an.union_density(sets, [17])


def test_manifest_metrics():
    manifest = {"per_layer": [
        {"layer": 0, "mlp": {"recall": 0.5, "k": 3, "recommended_k": {"0.9": 2}},
         "heads": {"recall": 1.0}},
        {"layer": 1, "mlp": {"recall": 0.7, "k": 3}, "heads": {"recall": 0.9, "precision": 0.2}},
    ]}
    m = an.manifest_metrics(manifest)
    np.testing.assert_allclose(m["mlp_recall"], [0.5, 0.7])
    assert np.isnan(m["heads_precision"][0]) and m["heads_precision"][1] == 0.2
    assert "mlp_recommended_k" not in m


def test_eval_points(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"runs": {
        "oracle": [{"mlp_density": 0.5, "head_density": 1.0, "perplexity": 20.0}],
        "predictor": [{"total_sparsity": 0.4, "avg_accuracy": 0.5, "mode": "pred"}]},
        "dense": {"density": 1.0, "ppl": 18.0}}))
    (tmp_path / "broken.json").write_text("{not json")
    pts = an.eval_points(sorted(tmp_path.glob("*.json")))
    got = {(p["mode"], p["metric"]): p["sparsity"] for p in pts}
    assert got == {("oracle", "perplexity"): 0.25, ("pred", "avg_accuracy"): 0.4,
                   ("dense", "ppl"): 0.0}
    assert an.eval_points([]) == []


def test_eval_points_reads_the_sweep_schema(tmp_path):
    # the layout of eval/results/cpu/smollm2-quality/sweep.json (dejavu_jax.eval sweep)
    (tmp_path / "sweep.json").write_text(json.dumps({"meta": {"model": "m"}, "points": [
        {"mode": "oracle", "total_sparsity": 0.3, "mlp_density": 0.5, "head_density": 0.9,
         "perplexity": 24.0, "task_mean": 0.42,
         "tasks": {"lambada": {"acc": 0.3, "perplexity": 27.0}}}]}))
    pts = an.eval_points([tmp_path / "sweep.json"])
    assert {(p["mode"], p["metric"], p["sparsity"], p["value"]) for p in pts} == {
        ("oracle", "perplexity", 0.3, 24.0), ("oracle", "task_mean", 0.3, 0.42)}


@pytest.fixture(scope="module")
def tiny():
    config, params, tok, described = an.load_model("preset:llama-tiny@3", tokenizer=False)
    assert tok is None and described == "llama-tiny (random weights, seed 3)"
    return config, params


def test_layer_records_match_sequence_forward(tiny):
    config, params = tiny
    ids = an.text_windows(None, config, 3, 9, seed=1)  # no tokenizer: synthetic ids
    assert ids.shape == (3, 9) and (ids[:, 0] == config.bos_token_id).all()
    recs = an.layer_records(config, params, ids, batch=2)  # 3 windows in padded batches of 2
    _, _, ref = sequence_forward(config, params, jnp.asarray(ids), None, records=True)
    assert set(recs) == {"attn_in", "mlp_in", "mlp_act", "head_norm"}
    for k, v in recs.items():
        assert v.shape[:3] == (config.n_layers, 3, 8)
        np.testing.assert_allclose(v, np.asarray(ref[k])[:, :, 1:], rtol=1e-5, atol=1e-5)
    contrib = an.neuron_contributions(params, recs["mlp_act"])
    w = np.linalg.norm(np.asarray(params.layers.w_out_t), axis=-1)
    np.testing.assert_allclose(contrib[2, 1, 4], np.abs(recs["mlp_act"][2, 1, 4]) * w[2],
                               rtol=1e-6)


def test_predictor_recall(tiny):
    config, params = tiny
    L, d = config.n_layers, config.hidden
    ids = an.text_windows(None, config, 2, 6)
    recs = {k: v.reshape(L, -1, v.shape[-1])
            for k, v in an.layer_records(config, params, ids).items()}
    N = recs["attn_in"].shape[1]

    def kind(n, key):
        return init_predictor(jax.random.key(key), L, d, 4, n, np.zeros((L, d)),
                              np.ones((L, d)), np.full((L, n), 0.5))

    pred = PredictorParams(mlp=kind(config.ffn, 0), heads=kind(config.n_heads, 1))
    rng = np.random.default_rng(0)
    mlp_sets = rng.random((L, N, config.ffn)) < 0.3
    head_sets = rng.random((L, N, config.n_heads)) < 0.5
    for lookahead in (True, False):
        full = an.predictor_recall(pred, {"lookahead": lookahead}, recs, config.ffn,
                                   config.n_heads, mlp_sets, head_sets)
        np.testing.assert_allclose(full["mlp_recall"], 1.0)  # k = all units
        np.testing.assert_allclose(full["heads_precision"], head_sets.mean(axis=(1, 2)))
        some = an.predictor_recall(pred, {"lookahead": lookahead}, recs, 10, 2, mlp_sets,
                                   head_sets)
        assert ((some["mlp_recall"] > 0) & (some["mlp_recall"] < 1)).all()
