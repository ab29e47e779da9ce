"""The neuron-scoring rules of `eval.mlp_selection_ceiling`: its captured-output figure
equals `train.metrics.mlp_captured`, its low-rank bases span what numpy's SVD spans, and
at full rank the low-rank rules are the exact ones."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import ops
from dejavu_jax.eval import mlp_selection_ceiling as msc
from dejavu_jax.model import sequence_forward
from dejavu_jax.train.metrics import mlp_captured

HF = Path(__file__).parent / "fixtures" / "hf"


@functools.cache
def _model(name):
    return dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)


def _inputs(config, params, rng, n_windows=6, length=24):
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (n_windows, length)), jnp.int32)
    x = np.asarray(sequence_forward(config, params, ids, None, records=True)[2]["mlp_in"])
    return x.reshape(x.shape[0], -1, x.shape[-1])


@pytest.mark.parametrize("shape", [(40, 12), (12, 40)])
def test_principal_basis_spans_the_top_singular_vectors(shape, rng):
    o = rng.standard_normal(shape).astype(np.float32)
    rank = 5
    got = msc.principal_basis(o, rank)
    want = np.linalg.svd(o.astype(np.float64), full_matrices=False)[2][:rank].T
    assert got.shape == (shape[1], rank)
    assert_finite_close(got @ got.T, want @ want.T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "gemma3"])
def test_captured_and_full_rank_rules(name, rng):
    config, params = _model(name)
    x = _inputs(config, params, rng)
    layer = 1
    lp = jax.tree.map(lambda a: a[layer], params.layers)
    x_cal, x_test = x[layer, :100], x[layer, 100:]
    d = config.hidden
    scores = msc.rule_scores(config, lp, x_cal, x_test, [d, 4])
    y = jnp.asarray(msc.normalised(config, lp, x_test))
    g = np.asarray(ops.gate_projection(lp, y))
    u = np.asarray(ops.up_projection(lp, y))
    down = np.linalg.norm(np.asarray(lp.w_out_t), axis=-1)
    act = np.asarray(ops.activation(config.activation, jnp.asarray(g)))
    assert_finite_close(scores["oracle"], np.abs(act * u) * down, rtol=1e-5, atol=1e-6)
    up_norms = np.linalg.norm(np.asarray(lp.w_in), axis=-1)
    assert_finite_close(scores["gate-norms"], np.abs(act) * up_norms * down, rtol=1e-5,
                        atol=1e-6)
    # the calibration outputs span the d-dimensional image of the projections, so rank d
    # reproduces them exactly
    tol = 2e-3 * np.abs(scores["oracle"]).max()
    assert_finite_close(scores[f"gate-r{d}"], scores["gate-mean-up"], rtol=0, atol=tol)
    assert_finite_close(scores[f"gate-up-r{d}"], scores["oracle"], rtol=0, atol=tol)
    assert not np.allclose(scores["gate-r4"], scores["gate-mean-up"], atol=tol)

    act_all = ops.mlp_hidden(config, lp, y)
    k = config.ffn // 3
    for rule in ("oracle", "gate", "gate-r4"):
        got = float(msc.captured_at_k(act_all, lp.w_out_t, jnp.asarray(scores[rule]), k))
        want = float(mlp_captured(config, lp, jnp.asarray(x_test),
                                  jnp.asarray(scores[rule]), k)[0])
        assert np.isfinite(got) and abs(got - want) < 1e-5
    rows = msc.study(config, params, x[:, :100], x[:, 100:], [0.3], [4], progress=False)
    assert {r["rule"] for r in rows} == {"oracle", "gate", "gate-mean-up", "gate-norms",
                                         "gate-r4", "gate-up-r4"}
    assert all(np.isfinite(r["captured"]) for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["rule"] == "oracle")
    assert msc.reads(config, "gate-up-r4") == pytest.approx(
        4 * (d + 2 * config.ffn) / (3 * d * config.ffn))
    assert "| 0.3 | gate-r4 |" in msc.summary(rows)


def test_rejects_an_ungated_model_and_a_missing_corpus(tmp_path, capsys):
    corpus = tmp_path / "text.txt"
    corpus.write_text("Some words of text. " * 200)
    for argv, words in ((["--model", str(HF / "opt-preln"), "--corpus", str(corpus)],
                         "the MLP has no gate"),
                        (["--model", str(HF / "llama-gqa"), "--corpus",
                          str(tmp_path / "missing.txt")], "no such file")):
        with pytest.raises(SystemExit) as e:
            msc.main(argv + ["--out", str(tmp_path / "out"), "--no-progress"])
        assert e.value.code == 2 and words in capsys.readouterr().err
