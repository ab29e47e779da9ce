"""Predictor training, lookahead pairing, checkpoints and jit/scan-safe prediction."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax import config as config_lib
from dejavu_jax.train import data as data_lib
from dejavu_jax.train import predictors as trainer
from dejavu_jax.train import records as rec
from dejavu_jax.train.checkpoint import PredictorCheckpointError, save_predictors
from dejavu_jax.train.predict import (load_predictors, predict, predictor_scores,
                                      select_top_k)
from dejavu_jax.train.predictor_model import (Predictor, PredictorParams, init_predictor,
                                              input_layers)

L, D, F, H, KV = 3, 16, 48, 6, 3
PER_WINDOW = 16


def write_records(root, arrays, n_shards=2):
    """A records folder from full arrays [L, N, ...], split into n_shards shards."""
    n = arrays["attn_in"].shape[1]
    cuts = np.linspace(0, n // PER_WINDOW, n_shards + 1).astype(int) * PER_WINDOW
    shards = [rec.write_shard(root, i, {k: v[:, a:b] for k, v in arrays.items()})
              for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    rec.write_manifest(root, {
        "format_version": rec.FORMAT_VERSION, "complete": True, "shards": shards,
        "model": "planted", "config_fingerprint": "planted", "model_source": {},
        "dims": {"n_layers": L, "hidden": D, "ffn": F, "n_heads": H, "n_kv_heads": KV},
        "tokens_per_window": PER_WINDOW, "tokens": n, "window": PER_WINDOW,
        "corpus": [], "label_rules": {"mlp": "planted"}})
    return rec.Records(root)


def planted(n=4096, seed=0, source_offset=1):
    """Inputs independent per layer; layer l's labels are a fixed rank-4 linear rule of
    the inputs of layer max(l - source_offset, 0)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(L, n, D)) * rng.uniform(0.5, 4, size=(L, n, 1))  # varying scale
    src = np.maximum(np.arange(L) - source_offset, 0)
    a = rng.normal(size=(L, D, 4)) @ rng.normal(size=(L, 4, F))
    bias = np.quantile(np.einsum("lnd,ldf->lnf", x[src] / np.linalg.norm(
        x[src], axis=-1, keepdims=True), a), 0.6, axis=1)[:, None]
    unit = x[src] / np.linalg.norm(x[src], axis=-1, keepdims=True)
    mlp_label = np.einsum("lnd,ldf->lnf", unit, a) > bias
    head_norm = np.exp(np.einsum("lnd,ldh->lnh", unit, rng.normal(size=(L, D, H))))
    return {"attn_in": rec.to_fp16(x), "mlp_in": rec.to_fp16(x),
            "mlp_label": rec.pack_labels(mlp_label), "head_norm": rec.to_fp16(head_norm)}


def test_input_layers_off_by_one():
    assert input_layers(4, True).tolist() == [0, 0, 1, 2]
    assert input_layers(4, False).tolist() == [0, 1, 2, 3]


def test_lookahead_pairing_in_batches(tmp_path):
    """Plant the layer number as every input value; read back which layer fed which."""
    n = 64
    arrays = {"attn_in": np.broadcast_to(np.arange(L, dtype=np.float16)[:, None, None],
                                         (L, n, D)).copy(),
              "mlp_in": np.broadcast_to(100 + np.arange(L, dtype=np.float16)[:, None, None],
                                        (L, n, D)).copy(),
              "mlp_label": np.zeros((L, n, (F + 7) // 8), np.uint8),
              "head_norm": np.ones((L, n, H), np.float16)}
    records = write_records(tmp_path, arrays)
    b = next(data_lib.train_batches(records, 8, True, 0.25, np.random.default_rng(0)))
    assert b.x_heads[:, :, 0].max(1).tolist() == [0, 0, 1]
    assert data_lib.mlp_inputs(b)[:, :, 0].min(1).tolist() == [0, 0, 1]
    b = next(data_lib.train_batches(records, 8, False, 0.25, np.random.default_rng(0)))
    assert b.x_heads[:, :, 0].max(1).tolist() == [0, 1, 2]
    assert data_lib.mlp_inputs(b)[:, :, 0].max(1).tolist() == [100, 101, 102]



def test_records_with_non_finite_values_are_refused(tmp_path, capsys):
    """Records holding NaN (a model whose activations were not finite) trained NaN
    predictors, saved with NaN metrics; now training stops with one error line and writes
    nothing. The same records made finite train to a finite loss."""
    arrays = planted(n=1024)
    bad = dict(arrays, attn_in=arrays["attn_in"].copy())
    bad["attn_in"][1, 700:760] = np.nan  # layer 1 of some tokens of the second shard
    tc = trainer.TrainConfig(rank=8, epochs=1, batch_size=128, max_val_tokens=128)
    records = write_records(tmp_path / "bad", bad)
    with pytest.raises(ValueError, match="not finite"):
        trainer.train(records, tc, progress=False, log=lambda s: None)
    with pytest.raises(SystemExit) as exit_:
        trainer.main(["--records", str(tmp_path / "bad"), "--out", str(tmp_path / "p"),
                      "--epochs", "1", "--batch-size", "128", "--no-output-metric",
                      "--no-progress"])
    assert exit_.value.code == 2 and "not finite" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
    _, summary, _ = trainer.train(write_records(tmp_path / "good", arrays), tc,
                                  progress=False, log=lambda s: None)
    assert np.isfinite(summary["history"][0]["train_loss"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    records = write_records(root, planted())
    tc = trainer.TrainConfig(rank=16, epochs=12, batch_size=256, lr=3e-3, patience=3,
                             stop_recall=0.995, max_val_tokens=1024)
    params, summary, val = trainer.train(records, tc, progress=False, log=lambda s: None)
    return records, tc, params, summary, val


def test_training_learns_planted_lookahead_pattern(trained):
    records, tc, params, summary, val = trained
    losses = [h["train_loss"] for h in summary["history"]]
    assert losses[-1] < 0.5 * losses[0]
    per_layer = trainer.evaluate(params, val, records, rec.LabelRule.parse(tc.head_rule),
                                 summary["k_mlp"], summary["k_heads"], progress=False)
    for m in per_layer:
        assert m["mlp"]["recall"] >= 0.99, m
        assert m["heads"]["recall"] >= 0.99, m
        assert m["groups"]["group_size"] == 2
    manifest = trainer.build_manifest(records, tc, summary, per_layer)
    assert len(manifest["recommended_k"]["mlp"]["0.95"]) == L
    assert manifest["recommended_k"]["heads_unit"] == "query_heads"


def test_same_layer_inputs_cannot_learn_lookahead_labels(trained, tmp_path):
    """The same labels are unlearnable from the layer's own (independent) inputs, so the
    success above proves layer l was trained on layer l-1's input."""
    records, tc, _, _, _ = trained
    tc = dataclasses.replace(tc, lookahead=False, epochs=3)
    params, summary, val = trainer.train(records, tc, progress=False, log=lambda s: None)
    per_layer = trainer.evaluate(params, val, records, rec.LabelRule.parse(tc.head_rule),
                                 summary["k_mlp"], summary["k_heads"], progress=False)
    assert per_layer[0]["mlp"]["recall"] > 0.9  # layer 0 reads its own input either way
    for m in per_layer[1:]:
        assert m["mlp"]["recall"] < 0.8, m


def test_checkpoint_round_trip_and_fingerprint(trained, tmp_path):
    records, tc, params, summary, _ = trained
    c = config_lib.preset("llama-tiny").replace(n_layers=L, hidden=D, ffn=F, n_heads=H,
                                                n_kv_heads=KV, name="planted")
    save_predictors(tmp_path / "p", params, {"model": "planted",
                                             "config_fingerprint": c.fingerprint()})
    loaded, manifest = load_predictors(tmp_path / "p", c)
    assert manifest["shapes"]["rank"] == 16 and loaded.activation == params.activation
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(PredictorCheckpointError, match="trained for model 'planted'"):
        load_predictors(tmp_path / "p", config_lib.preset("llama-tiny"))
    with pytest.raises(PredictorCheckpointError, match="missing"):
        load_predictors(tmp_path / "nothing")
    # same-layer predictors would be fed the previous layer's input by the decode path
    save_predictors(tmp_path / "s", params, {"model": "planted", "lookahead": False,
                                             "config_fingerprint": c.fingerprint()})
    with pytest.raises(PredictorCheckpointError, match="--same-layer"):
        load_predictors(tmp_path / "s", c)
    assert load_predictors(tmp_path / "s")[1]["lookahead"] is False   # no model: analysis


def random_params(seed=0, activation="none"):
    rng = np.random.default_rng(seed)

    def kind(n, key):
        return init_predictor(jax.random.key(key), L, D, 8, n, rng.normal(size=(L, D)) * 0.1,
                              rng.uniform(0.5, 2, size=(L, D)), rng.uniform(0.1, 0.9, (L, n)))

    p = PredictorParams(mlp=kind(F, seed), heads=kind(H, seed + 1), activation=activation)
    return jax.tree.map(lambda a: a + 0.1 * jnp.asarray(rng.normal(size=a.shape), a.dtype), p)


def numpy_scores(p: Predictor, layer, x, activation):
    w = jax.tree.map(lambda a: np.asarray(a, np.float64)[layer], p)
    x = np.asarray(x, np.float64)
    xn = (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) - w.mean) * w.inv_std
    h = xn @ w.w1
    h = np.maximum(h, 0) if activation == "relu" else h
    return h @ w.w2 + w.b2


def numpy_union(scores, k, capacity=None):
    """Reference union semantics: members by best score, then best non-members; sorted."""
    B, n = scores.shape
    capacity = capacity or min(n, k * B)
    member = np.zeros(n, bool)
    for row in scores:
        member[np.argsort(-row, kind="stable")[:k]] = True
    best = scores.max(0)
    order = sorted(range(n), key=lambda i: (not member[i], -best[i], i))
    return np.sort(order[:capacity])


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_predict_jit_and_scan_match_eager(activation):
    p = random_params(activation=activation)
    xs = np.random.default_rng(1).normal(size=(L, 1, D)).astype(np.float32) * 30
    k_mlp, k_heads = 7, 3
    eager = []
    for layer in range(L):
        with jax.disable_jit():
            m, h = predictor_scores(p, layer, xs[layer])
        np.testing.assert_allclose(m, numpy_scores(p.mlp, layer, xs[layer], activation),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(h, numpy_scores(p.heads, layer, xs[layer], activation),
                                   rtol=1e-4, atol=1e-4)
        eager.append((np.sort(np.argsort(-np.asarray(m)[0])[:k_mlp]),
                      np.sort(np.argsort(-np.asarray(h)[0])[:k_heads])))   # query heads

    def body(layer, x):
        idx = predict(p, layer, x, k_mlp, k_heads)
        return layer + 1, idx

    _, (scan_mlp, scan_heads) = jax.jit(lambda x: jax.lax.scan(
        body, jnp.int32(0), x))(jnp.asarray(xs))
    for layer in range(L):
        jit_mlp, jit_heads = predict(p, jnp.int32(layer), xs[layer], k_mlp, k_heads)
        for got in ((jit_mlp, jit_heads), (scan_mlp[layer], scan_heads[layer])):
            assert got[0].dtype == jnp.int32
            np.testing.assert_array_equal(got[0], eager[layer][0])
            np.testing.assert_array_equal(got[1], eager[layer][1])


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_decode_form_scores_and_sets_equal_the_trained_form(activation):
    from dejavu_jax.train.predictor_model import decode_predictors
    p = random_params(seed=3, activation=activation)
    folded = decode_predictors(p)
    assert folded.w1t.shape == (L, 16, D)
    xs = np.random.default_rng(4).normal(size=(L, 2, D)).astype(np.float32) * 30
    for layer in range(L):
        m, h = jax.jit(predictor_scores)(folded, jnp.int32(layer), xs[layer])
        np.testing.assert_allclose(m, numpy_scores(p.mlp, layer, xs[layer], activation),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(h, numpy_scores(p.heads, layer, xs[layer], activation),
                                   rtol=1e-4, atol=1e-4)
        for a, b in zip(predict(folded, jnp.int32(layer), xs[layer][:1], 7, 2),
                        predict(p, jnp.int32(layer), xs[layer][:1], 7, 2)):
            np.testing.assert_array_equal(a, b)


def test_batch_union_matches_numpy_reference():
    rng = np.random.default_rng(2)
    for B, n, k, cap in [(4, 50, 5, None), (3, 40, 6, 10), (5, 30, 8, 25), (2, 9, 4, 9),
                         (1, 20, 3, 6)]:
        s = rng.normal(size=(B, n)).astype(np.float32)
        got = np.asarray(jax.jit(select_top_k, static_argnums=(1, 2))(s, k, cap))
        want = numpy_union(s, k, cap)
        np.testing.assert_array_equal(got, want)
        assert len(np.unique(got)) == len(got) and np.all(np.diff(got) > 0)
    p = random_params()
    x = rng.normal(size=(4, D)).astype(np.float32)
    m, h = predictor_scores(p, 1, x)
    neurons, heads = predict(p, 1, x, 5, 1, union_capacity=(12, 3))
    np.testing.assert_array_equal(neurons, numpy_union(np.asarray(m), 5, 12))
    np.testing.assert_array_equal(heads, numpy_union(np.asarray(h), 1, 3))


def test_cli_end_to_end(tmp_path, capsys):
    from dejavu_jax.paths import opt_tokenizer_dir
    from dejavu_jax.train import collect as collect_lib
    if not opt_tokenizer_dir().exists():
        pytest.skip("OPT tokenizer not available")
    text = tmp_path / "t.txt"
    text.write_text("".join(f"Line {i} of a small corpus about rivers and stones.\n"
                            for i in range(400)))
    assert collect_lib.main(["--preset", "opt-tiny", "--corpus", str(text), "--tokens", "1200",
                             "--window", "32", "--shard-tokens", "600", "--out",
                             str(tmp_path / "r"), "--no-progress"]) == 0
    assert trainer.main(["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"),
                         "--epochs", "1", "--batch-size", "128", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mlp_rec" in out and "tokens/s" in out
    params, manifest = load_predictors(tmp_path / "p", config_lib.preset("opt-tiny"))
    assert manifest["lookahead"] and len(manifest["per_layer"]) == 4
    assert 0 < manifest["per_layer"][1]["mlp"]["output_captured"] <= 1


def test_records_without_training_windows_are_refused(tmp_path, capsys):
    """One window per shard: validation took it all and training read an empty sample
    (NaN statistics, then `cannot convert float NaN to integer`); now one error line."""
    records = write_records(tmp_path / "r", planted(n=2 * PER_WINDOW), n_shards=2)
    tc = trainer.TrainConfig(rank=8, epochs=1, batch_size=8)
    with pytest.raises(rec.RecordsError, match="16 tokens, all of them held out"):
        trainer.train(records, tc, progress=False, log=lambda s: None)
    with pytest.raises(SystemExit) as exit_:
        trainer.main(["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"),
                      "--no-output-metric", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "held out for validation" in err
    assert "Traceback" not in err and "NaN" not in err and not (tmp_path / "p").exists()


@pytest.mark.parametrize("flag, k, words", [("--k-mlp", F + 1, f"have {F} MLP neurons"),
                                            ("--k-heads", H + 1, f"have {H} query heads")])
def test_evaluation_k_past_the_layer_is_refused(tmp_path, capsys, flag, k, words):
    """An evaluation k above the layer's units was cut to all of them, so every metric
    read recall 1.0; now one error line naming the flag and the count."""
    write_records(tmp_path / "r", planted(n=256))
    with pytest.raises(SystemExit) as exit_:
        trainer.main(["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"),
                      flag, str(k), "--no-output-metric", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and last == f"error: {flag} {k}: the model's layers {words}"
    assert not (tmp_path / "p").exists()


def test_one_step_run_reports_its_wall_throughput(tmp_path, capsys):
    """A run of one step has no timed step after the compiling one: it printed
    `training 0.0 tokens/s`; now the wall figure, labelled."""
    write_records(tmp_path / "r", planted(n=512), n_shards=1)
    assert trainer.main(["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"),
                         "--epochs", "1", "--batch-size", "256", "--rank", "4",
                         "--no-output-metric", "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    _, manifest = load_predictors(tmp_path / "p")
    wall = manifest["training"]["throughput"]["wall_tokens_per_s"]
    assert manifest["training"]["throughput"]["tokens"] == 0 and wall > 0
    assert f"training {wall} tokens/s wall (one step, which compiled)" in last


def test_summary_prints_one_line_per_mean(tmp_path, capsys):
    """The closing summary was printed as a Python dict (`summary: {'mlp_recall': ...}`);
    now a heading and one `key: value` line per mean, the manifest's record unchanged."""
    write_records(tmp_path / "r", planted(n=512), n_shards=1)
    assert trainer.main(["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"),
                         "--epochs", "1", "--batch-size", "256", "--rank", "4",
                         "--no-output-metric", "--no-progress"]) == 0
    out = capsys.readouterr().out
    _, manifest = load_predictors(tmp_path / "p")
    summary = manifest["summary"]
    assert isinstance(summary, dict) and "mlp_recall" in summary and "{" not in out
    lines = out.splitlines()
    start = lines.index("summary (means over layers):")
    shown = [line.split(":") for line in lines[start + 1:start + 1 + len(summary)]]
    assert {key.strip(): float(value) for key, value in shown} == summary
    assert lines[start + 1 + len(summary)].startswith("stopped after")
    assert trainer.format_summary({"a": 1, "bbb": 0.5}) == (
        "summary (means over layers):\n  a:   1\n  bbb: 0.5")


def test_out_that_holds_the_records_is_refused(tmp_path, capsys, monkeypatch):
    """--out naming the records folder replaced the records' manifest.json with the
    predictors' (the records then unreadable); now that, and an --out that is a file, are
    refused before training, and the records stay as they were."""
    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("training ran"))
    write_records(tmp_path / "r", planted(n=256))
    before = (tmp_path / "r" / "manifest.json").read_text()
    (tmp_path / "f.txt").write_text("x")
    for out, words in [(tmp_path / "r", "holds records of train.collect"),
                       (tmp_path / "f.txt", "is a file")]:
        with pytest.raises(SystemExit) as exit_:
            trainer.main(["--records", str(tmp_path / "r"), "--out", str(out),
                          "--no-progress"])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and last.startswith(f"error: --out {out}") and words in last
    assert (tmp_path / "r" / "manifest.json").read_text() == before
    assert rec.Records(tmp_path / "r").n_layers == L


def test_a_records_folder_given_as_predictors_says_so(tmp_path):
    """Records passed where predictors go read as `no 'shapes' entry (an incomplete
    manifest)`; now the error says what the folder holds."""
    write_records(tmp_path / "r", planted(n=256))
    with pytest.raises(PredictorCheckpointError,
                       match="holds records of train.collect, not predictors"):
        load_predictors(tmp_path / "r")


def test_a_missing_records_model_fails_before_training(tmp_path, capsys, monkeypatch):
    """Records whose model file is gone trained to the end, then failed loading it for the
    output metric and saved nothing; now one error line before training, naming the file
    and --no-output-metric, which trains without it."""
    write_records(tmp_path / "r", planted(n=512), n_shards=1)
    manifest = rec.read_manifest(tmp_path / "r")
    gone = tmp_path / "gone.gguf"
    rec.write_manifest(tmp_path / "r", {**manifest, "model_source": {"path": str(gone)}})
    argv = ["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"), "--epochs", "1",
            "--batch-size", "256", "--rank", "4", "--no-progress"]
    real_train = trainer.train
    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("training ran"))
    with pytest.raises(SystemExit) as exit_:
        trainer.main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and last.startswith(f"error: {gone}: the records' model")
    assert "--no-output-metric" in last and not (tmp_path / "p").exists()
    monkeypatch.setattr(trainer, "train", real_train)
    assert trainer.main(argv + ["--no-output-metric"]) == 0
    assert load_predictors(tmp_path / "p")[1]["per_layer"][0]["mlp"]["recall"] > 0


def test_labels_with_no_active_unit_are_refused(tmp_path, capsys):
    """Records labelled by a rule no neuron passes (threshold:1e9) trained with eval k 0
    and saved NaN precision; a head rule no head passes did the same for heads. Now one
    error line each, before training."""
    arrays = planted(n=512)
    silent = dict(arrays, mlp_label=np.zeros_like(arrays["mlp_label"]))
    write_records(tmp_path / "r0", silent, n_shards=1)
    write_records(tmp_path / "r1", arrays, n_shards=1)
    argv = ["--out", str(tmp_path / "p"), "--epochs", "1", "--batch-size", "256",
            "--no-output-metric", "--no-progress"]
    for records, extra, words in [
            ("r0", [], "no MLP neuron is labelled active in the training sample"),
            ("r1", ["--head-rule", "threshold:1e9"],
             "--head-rule threshold:1e9 labels no query head active")]:
        with pytest.raises(SystemExit) as exit_:
            trainer.main(["--records", str(tmp_path / records)] + argv + extra)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err.strip().splitlines()[-1], err
        assert "nan" not in err.lower() and not (tmp_path / "p").exists()


def test_a_records_model_that_does_not_load_still_saves_the_predictors(tmp_path, capsys):
    """A records model file that is there but does not load (a corrupt file): training
    keeps its result, saved without the MLP output metric, and a warning names why."""
    write_records(tmp_path / "r", planted(n=512), n_shards=1)
    manifest = rec.read_manifest(tmp_path / "r")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a model file" * 8)
    rec.write_manifest(tmp_path / "r", {**manifest, "model_source": {"path": str(corrupt)}})
    argv = ["--records", str(tmp_path / "r"), "--out", str(tmp_path / "p"), "--epochs", "1",
            "--batch-size", "256", "--rank", "4", "--no-progress"]
    assert trainer.main(argv) == 0
    assert "warning: the records' model did not load" in capsys.readouterr().err
    saved = load_predictors(tmp_path / "p")[1]["per_layer"][0]["mlp"]
    assert saved["recall"] > 0 and "output_captured" not in saved
