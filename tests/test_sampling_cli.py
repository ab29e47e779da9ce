"""Sampling rules and the generate CLI."""

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax import generate as cli
from dejavu_jax.sampling import SamplingConfig, sample


def test_greedy_is_argmax(rng):
    logits = jnp.asarray(rng.normal(size=(3, 50)), jnp.float32)
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), SamplingConfig()),
                                  np.argmax(np.asarray(logits), -1))


def test_top_k_and_top_p_restrict_the_support(rng):
    # The three largest logits sit within 0.5 of each other, so 300 draws reach more than one.
    values = np.concatenate([[4.0, 3.75, 3.5], rng.uniform(-3.0, 2.0, size=37)])
    logits = jnp.asarray(rng.permutation(values)[None], jnp.float32)
    order = np.argsort(-np.asarray(logits[0]))
    keys = jax.random.split(jax.random.key(1), 300)
    draw = jax.jit(sample, static_argnums=2)  # one compile, not an op-by-op run per key
    top3 = {int(draw(logits, k, SamplingConfig(1.0, top_k=3))[0]) for k in keys}
    assert top3 <= set(order[:3].tolist()) and len(top3) > 1
    probs = np.asarray(jax.nn.softmax(logits[0]))[order]
    nucleus = int(np.searchsorted(np.cumsum(probs), 0.6) + 1)
    top_p = {int(draw(logits, k, SamplingConfig(1.0, top_p=0.6))[0]) for k in keys}
    assert top_p <= set(order[:nucleus].tolist())


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-45])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (5, 0.9)])
def test_a_tiny_temperature_samples_the_argmax(rng, temperature, top_k, top_p):
    """logits / 1e-38 overflows to inf - inf = NaN unless the best logit is subtracted
    first, and a subnormal temperature (flushed to 0 on some backends) gives 0 / 0 at the
    best logit unless it is kept at 0: either way every row draws its argmax."""
    logits = jnp.asarray(rng.normal(size=(4, 60)) * 30, jnp.float32)
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    for key in jax.random.split(jax.random.key(2), 5):
        got = sample(logits, key, cfg)
        np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), -1))


def test_sampling_config_validates():
    with pytest.raises(ValueError):
        SamplingConfig(temperature=float("inf"))
    with pytest.raises(ValueError):
        SamplingConfig(temperature=float("nan"))
    with pytest.raises(ValueError):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0.0)


def test_cli_runs_a_random_preset_on_a_text_prompt(capsys):
    from dejavu_jax.paths import opt_tokenizer_dir
    if not opt_tokenizer_dir().exists():
        pytest.skip(f"OPT tokenizer not available ({opt_tokenizer_dir()}; set DEJAVU_DATA)")
    assert cli.main(["--max-new-tokens", "4", "--preset", "opt-tiny"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("decode: not measured")  # 3 steps: one call


def test_cli_runs_a_random_preset(capsys):
    assert cli.main(["--max-new-tokens", "12", "--chunk", "4", "--preset", "opt-tiny",
                     "--prompt-ids", "2,100,200", "--print-ids"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith(" tokens/s (batch 1, over 8 decode steps)")  # 3 calls,
    assert out.splitlines()[-1].startswith("decode: ")                   # the first untimed


def test_cli_greedy_prompt_ids_prints_ids(capsys):
    assert cli.main(["--preset", "opt-tiny", "--print-ids", "--prompt-ids", "2,31414,6",
                     "--max-new-tokens", "3", "--no-stream"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "generated ids" in x)
    assert len(line.split(":")[1].split(",")) == 3


def test_cli_oracle_mode_prints_each_layers_density(capsys):
    assert cli.main(["--preset", "opt-tiny", "--oracle", "--mlp-density", "0.25",
                     "--head-density", "0.5", "--dense-layers", "1", "--print-ids",
                     "--prompt-ids", "2,100,200", "--max-new-tokens", "3", "--no-stream"]) == 0
    out = capsys.readouterr().out
    assert "layer  1: mlp  25.0%  heads  50.0%" in out
    assert "[oracle]" in out


def test_cli_batch_prints_the_unions_density(capsys):
    """Two prompts at MLP 25% / heads 50% in oracle mode: each layer's union is half the
    neurons and every head (the oracle computes densely and masks: no fallback label)."""
    assert cli.main(["--preset", "opt-tiny", "--oracle", "--mlp-density", "0.25",
                     "--head-density", "0.5", "--dense-layers", "1", "--print-ids",
                     "--prompt-ids", "2,100,200", "--prompt-ids", "2,7", "--max-new-tokens",
                     "2", "--no-stream"]) == 0
    out = capsys.readouterr().out
    assert "layer  1: mlp  25.0%  heads  50.0%  union mlp  50.0%  heads 100.0%\n" in out
    assert "layer  0: mlp 100.0%  heads 100.0%  (dense)" in out
    # 4 layers: one dense, three computing half the neurons for the batch
    assert "mean mlp density 43.8% per token, 62.5% computed for the batch of 2" in out


def test_describe_sparsity_names_a_batchs_dense_parts():
    import dataclasses

    import dejavu_jax as dj
    from dejavu_jax import sparse
    config = dj.preset("opt-tiny")
    def union(mlp, heads):
        return dataclasses.replace(sparse.sparse_config(config, mlp, heads, dense_layers=1),
                                   batch_policy="union")
    scfg = union(0.1, 0.5)
    text = cli.describe_sparsity(config, scfg, batch=16)
    # each row attends with its own heads: the attention kernel, though the union's head
    # weights are every head
    assert "union mlp 100.0%  heads 100.0%  (dense mlp)" in text
    assert "per token" in text and "100.0% computed for the batch of 16" in text
    assert "union" not in cli.describe_sparsity(config, scfg)
    masked = cli.describe_sparsity(config, union(0.25, 0.5), batch=2)
    assert "union mlp  50.0%  heads 100.0%  (dense masked mlp)" in masked
    every_head = cli.describe_sparsity(config, union(0.25, 1.0), batch=2)
    assert "union mlp  50.0%  heads 100.0%  (dense attention + masked mlp)" in every_head
    some = cli.describe_sparsity(config, union(0.1, 0.25), batch=2)
    assert "union mlp  20.3%  heads  50.0%\n" in some
    default = cli.describe_sparsity(config, sparse.sparse_config(config, 0.1, 0.25,
                                                                 dense_layers=1), batch=2)
    assert "a batch of 2 runs the dense engine" in default and "layer  1" not in default
    assert "selection cost more" in default
    thresholds = cli.describe_sparsity(
        config, dataclasses.replace(sparse.sparse_config(config, 1.0, 1.0, dense_layers=1),
                                    threshold_sites=("down",)), batch=2)
    assert "a batch of 2 runs the dense engine (the rows' kept channels differ" in thresholds
    shared = dataclasses.replace(union(0.1, 0.5), batch_policy="shared")
    text = cli.describe_sparsity(config, shared, batch=16)
    assert "shared mlp  10.2%  heads  50.0%\n" in text
    assert "the batch of 16 shares each layer's neurons and heads" in text
    kernels_only = cli.describe_sparsity(
        config, dataclasses.replace(scfg, batch_policy="kernels"), batch=16)
    assert "(dense layer)" not in kernels_only and "union mlp 100.0%" in kernels_only


def test_a_batch_that_sparse_decoding_runs_dense_gets_the_dense_engine():
    """Under the default batch policy a batch of several prompts runs every layer dense, so
    `generate` builds the dense engine for it (its fused q/k/v step), and the sparse engine
    for one prompt."""
    import argparse

    import dejavu_jax as dj
    from dejavu_jax import sparse
    config = dj.preset("opt-tiny").replace(n_layers=2, vocab_size=512)
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    scfg = sparse.sparse_config(config, 0.25, 0.5, dense_layers=1)
    args = argparse.Namespace(select=None)
    engine, engine_params = cli.build_engine(args, config, params, scfg, None, batch=2)
    assert engine.name == "dense" and engine_params.layers.wqkv is not None
    engine, (model_params, predictors) = cli.build_engine(args, config, params, scfg, None,
                                                          batch=1)
    assert engine.name == "sparse" and predictors is None


def test_batch_policy_option_reaches_the_sparse_config(capsys):
    """--batch-policy union keeps a batch on the sparse engine with the rows' union; without
    it a batch runs dense; it needs index sets (--oracle or --predictors)."""
    import dejavu_jax as dj
    config = dj.preset("opt-tiny")
    base = ["--preset", "opt-tiny", "--oracle", "--mlp-density", "0.25"]
    union, _ = cli.sparse_settings(cli.build_parser().parse_args(
        base + ["--batch-policy", "union"]), config)
    default, _ = cli.sparse_settings(cli.build_parser().parse_args(base), config)
    assert union.batch_policy == "union" and default.batch_policy == "dense"
    assert "a batch of 2 runs the dense engine" not in cli.describe_sparsity(config, union, 2)
    for argv, words in ((["--preset", "opt-tiny", "--batch-policy", "union"], "add --sparse"),
                        (["--preset", "opt-tiny", "--sparse", "--batch-policy", "union"],
                         "profile sets each layer"),
                        (base + ["--batch-policy", "shared"], "selects per row"),
                        (base + ["--batch-policy", "measured"], "selects per row")):
        with pytest.raises(SystemExit) as e:
            cli.check_options(cli.build_parser().parse_args(argv))
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_measured_batch_policy_plans_the_engine_and_reports_each_layer(monkeypatch):
    """--batch-policy measured: the plan timed for the batch decides the engine (the dense
    engine when every layer is planned dense, else the sparse engine with the plan), and
    the density report names each layer's planned way."""
    import argparse

    import dejavu_jax as dj
    from dejavu_jax import batch_plan, sparse
    from dejavu_jax.eval.bench_decode import random_predictors
    config = dj.preset("opt-tiny").replace(vocab_size=512)
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    preds = random_predictors(config, 8, jax.random.key(1))
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.25, 0.5, dense_layers=1),
                               batch_policy="union")
    args = argparse.Namespace(select=None)
    layers = ("dense", "dense", "sparse", "masked")
    monkeypatch.setattr(batch_plan, "plan_for", lambda *a, **k: batch_plan.BatchPlan(
        layers, 1.0, 2.0, (("all dense", 2.0),)))
    engine, engine_params, planned, plan = cli.planned_engine(args, config, scfg,
                                                              (params, preds), 2, 5)
    assert engine.name == "sparse" and planned.batch_layers == layers
    report = cli.describe_sparsity(config, planned, 2).splitlines()
    assert "(dense layer)" in report[2] and "(dense" not in report[3]
    assert "(dense masked mlp)" in report[4]
    monkeypatch.setattr(batch_plan, "plan_for", lambda *a, **k: batch_plan.BatchPlan(
        ("dense",) * 4, 2.0, 2.0, (("all dense", 2.0),)))
    engine, engine_params, planned, plan = cli.planned_engine(args, config, scfg,
                                                              (params, preds), 2, 5)
    assert engine.name == "dense" and planned is None and plan.all_dense


def test_measured_batch_policy_generates_end_to_end(capsys):
    """`generate --sparse --predictors DIR --batch-policy measured` with two prompts: the
    plan is measured and printed, and both rows generate."""
    import dejavu_jax as dj
    from dejavu_jax.eval.bench_decode import random_predictors
    from dejavu_jax.train.checkpoint import save_predictors
    config = dj.preset("opt-tiny")
    with tempfile.TemporaryDirectory() as tmp:
        save_predictors(tmp, random_predictors(config, 8, jax.random.key(1)),
                        {"model": "opt-tiny", "config_fingerprint": config.fingerprint()})
        assert cli.main(["--preset", "opt-tiny", "--sparse", "--predictors", tmp,
                         "--batch-policy", "measured", "--prompt-ids", "5,9,14",
                         "--prompt-ids", "8,2", "--max-new-tokens", "3", "--print-ids"]) == 0
    out, err = capsys.readouterr()
    assert "batch plan:" in err and "measuring a plan for batch 2" in err
    assert "[0] generated ids:" in out and "[1] generated ids:" in out


def test_cli_decodes_with_a_profiles_gate_weights(tmp_path, capsys, monkeypatch):
    """--sparse --profile FILE with gate weights: generate puts the profile's weights in the
    params it decodes with, and its ids equal the threshold engine's on the same weighted
    params; a profile whose gate weights do not fit the model is one `error:` line."""
    import dejavu_jax as dj
    from dejavu_jax import sparse
    from dejavu_jax.sparsity_profile import SparsityProfile, encode_gate_weights
    applied = []
    weighted_params = SparsityProfile.weighted_params

    def spy(self, params):
        out = weighted_params(self, params)
        applied.append(np.asarray(out.layers.gate_weight))
        return out

    monkeypatch.setattr(SparsityProfile, "weighted_params", spy)
    config = dj.preset("llama-tiny")
    L, F = config.n_layers, config.ffn
    weights = np.random.default_rng(0).uniform(0.05, 20.0, (L, F)).astype(np.float32)
    thresholds = np.tile([[0.0, 0.0, 0.0, 0.05, 0.0]], (L, 1))
    profile = SparsityProfile(config.name, config.fingerprint(), "cats", ("gate",),
                              [[0.0, 0.0, 0.0, 0.5, 0.0]] * L, thresholds.tolist(),
                              gate_weights=encode_gate_weights(weights))
    path = profile.save(tmp_path / "p.json")
    args = ["--preset", "llama-tiny", "--sparse", "--profile", str(path), "--print-ids",
            "--prompt-ids", "2,17,40,9", "--max-new-tokens", "5", "--dtype", "float32"]
    assert cli.main(args) == 0
    assert len(applied) == 1
    np.testing.assert_allclose(applied[0], weights, rtol=1e-3)  # float16 in the file
    got = capsys.readouterr().out.split("generated ids: ")[1].split()[0]
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    weighted = profile.weighted_params(params)
    engine = sparse.sparse_engine(config, sparse.threshold_config(config, ("gate",)),
                                  sparse.no_selector)
    want = dj.generate_tokens(engine, (weighted, jnp.asarray(thresholds, jnp.float32)),
                              [[2, 17, 40, 9]], max_new_tokens=5, stop_ids=[]).tokens[0]
    assert got == ",".join(map(str, want))
    bad = dataclasses.replace(profile, gate_weights=encode_gate_weights(weights[:, :-1]))
    bad.save(tmp_path / "bad.json")
    with pytest.raises(SystemExit) as e:
        cli.main(args[:4] + [str(tmp_path / "bad.json")] + args[5:])
    assert e.value.code == 2 and "gate weights" in capsys.readouterr().err


def test_weights_that_cannot_fit_stop_before_any_allocation(monkeypatch, capsys):
    """A model whose weights exceed the memory the device has: one `error:` line naming
    both sizes (from the parameter shapes, nothing allocated), with --dtype bfloat16
    offered only where the weights are wider."""
    import dejavu_jax as dj
    config = dj.preset("opt-tiny")
    shapes = jax.eval_shape(lambda: dj.init_params(config, jax.random.key(0), jnp.float32))
    need = sum(a.size * 4 for a in jax.tree.leaves(shapes))
    monkeypatch.setattr(cli, "available_bytes", lambda: need)
    for dtype, hint in ((jnp.float32, True), (jnp.bfloat16, False)):
        if dtype == jnp.bfloat16:
            monkeypatch.setattr(cli, "available_bytes", lambda: need // 2)
        with pytest.raises(SystemExit) as e:
            cli.check_weights_fit(config, dtype, "opt-tiny")
        err = capsys.readouterr().err
        assert e.value.code == 2 and "opt-tiny needs" in err and "available" in err
        assert ("--dtype bfloat16" in err) == hint
    monkeypatch.setattr(cli, "available_bytes", lambda: 2 * need)
    cli.check_weights_fit(config, jnp.float32, "opt-tiny")   # fits: no error
    monkeypatch.setattr(cli, "available_bytes", lambda: None)
    cli.check_weights_fit(config, jnp.float32, "opt-tiny")   # unknown: no claim


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(capsys):
    """--tokenizer of another model (more tokens than the model's vocabulary) is an error;
    one within it passes (models often pad their vocabulary past the tokenizer's)."""
    import types

    import dejavu_jax as dj
    config = dj.preset("opt-tiny").replace(vocab_size=512)
    with pytest.raises(SystemExit) as e:
        cli.check_tokenizer_fits(types.SimpleNamespace(vocab_size=600), config, "tiny")
    assert e.value.code == 2 and "600 tokens" in capsys.readouterr().err
    cli.check_tokenizer_fits(types.SimpleNamespace(vocab_size=500), config, "tiny")


@pytest.mark.parametrize("argv,expected,not_expected", [
    (["--predictors", "."], "add --sparse", "--oracle"),
    (["--select", "local"], "add --sparse", "--oracle"),
    (["--mlp-density", "0.5"], "add --sparse or --oracle", None),
    (["--sparse", "--select", "local"], "for --sparse --predictors DIR", "--oracle"),
    (["--sparse", "--mlp-density", "0.5"], "for --predictors and --oracle", None)])
def test_option_hints_name_a_mode_that_takes_the_option(capsys, argv, expected,
                                                         not_expected):
    """The hint for an option given without its mode names only modes that accept it
    (--oracle takes neither --predictors nor --select)."""
    with pytest.raises(SystemExit) as e:
        cli.check_options(cli.build_parser().parse_args(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err
    assert not_expected is None or not_expected not in err


def test_an_interrupt_ends_with_one_line(capsys):
    """Ctrl-C during a run: exit status 130 and 'interrupted', no traceback."""
    from dejavu_jax import cli as cli_lib

    def interrupted():
        raise KeyboardInterrupt
    assert cli_lib.interruptible(interrupted) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert cli_lib.interruptible(lambda: 0) == 0
