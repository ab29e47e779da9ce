"""A user's mistakes at the command line: one `error:` line and exit status 2, or the
result the option asks for, never a traceback or garbage tokens.

Each CLI case checks its input before any weights load (the loaders here fail the test).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax import generate, loading
from dejavu_jax.config import preset
from dejavu_jax.eval import common, frontier, perplexity, sweep
from dejavu_jax.eval import tasks as tasks_mod
from dejavu_jax.sampling import SamplingConfig, sample
from dejavu_jax.sparsity_profile import METHODS
from dejavu_jax.train import predictors

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "opt-preln"  # no gated MLP, 128 positions


@pytest.fixture
def no_loading(monkeypatch):
    """Loaders that fail the test: what a case checks must come before any weights."""
    def forbidden(*args, **kwargs):
        pytest.fail("weights were loaded before the input was checked")

    monkeypatch.setattr(generate, "load_params", forbidden)
    monkeypatch.setattr(common, "load_weights", forbidden)
    monkeypatch.setattr(predictors, "train", forbidden)


def _error_line(main, argv: list[str], capsys) -> str:
    """The one `error:` line `main(argv)` exits with (status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in err, err
    return last


def test_a_prompt_that_is_not_utf8_is_one_error_line(capsys, no_loading):
    """Bytes of a command line that do not decode as UTF-8 arrive as lone surrogates
    ('\\udcff' for 0xff); the tokenizer raised a TypeError on them."""
    last = _error_line(generate.main, ["--preset", "opt-tiny", "--prompt", "caf\udcff",
                                       "--max-new-tokens", "2"], capsys)
    assert "--prompt" in last and "not UTF-8" in last and "0xff" in last, last


@pytest.mark.parametrize("top_p", [1e-300, 1e-46])
def test_a_top_p_that_float32_rounds_to_0_samples_the_argmax(rng, top_p):
    """A top_p in (0, 1] that is 0 in float32 kept no token, and every row drew id 0."""
    logits = jnp.asarray(rng.normal(size=(4, 60)) * 3 + 1, jnp.float32)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=top_p)
    for key in jax.random.split(jax.random.key(3), 5):
        np.testing.assert_array_equal(sample(logits, key, cfg),
                                      np.argmax(np.asarray(logits), -1))


def test_a_file_given_as_the_predictor_folder_is_named_so(tmp_path, capsys, no_loading):
    file = tmp_path / "manifest.json"
    file.write_text("{}")
    last = _error_line(perplexity.main, ["--mode", "sparse", "--predictors", str(file)],
                       capsys)
    assert "a file, not a predictor folder" in last and str(file) in last, last


def test_a_temperature_past_float32_is_one_error_line(capsys, no_loading):
    """A finite temperature above float32's largest value became inf in the division and
    every token was drawn uniformly, after a numpy overflow warning."""
    last = _error_line(generate.main, ["--preset", "opt-tiny", "--prompt-ids", "2,3",
                                       "--temperature", "1e300"], capsys)
    assert "--temperature" in last and "float32" in last, last
    with pytest.raises(ValueError, match="finite in float32"):
        SamplingConfig(temperature=1e39)
    assert SamplingConfig(temperature=3e38).temperature == 3e38


@pytest.mark.parametrize("main, argv", [
    (generate.main, ["--preset", "opt-tiny", "--prompt-ids", "2,3", "--distributed"]),
    (perplexity.main, ["--preset", "opt-tiny", "--text", "TEXT", "--distributed"])])
def test_distributed_without_a_coordinator_is_one_error_line(main, argv, tmp_path, capsys,
                                                             monkeypatch, no_loading):
    """--distributed on a machine with no coordinator set or detected: jax's ValueError
    ended the run in a traceback."""
    def no_coordinator(**kwargs):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", no_coordinator)
    text = tmp_path / "text.txt"
    text.write_text("Some text to score. " * 8)
    last = _error_line(main, [str(text) if a == "TEXT" else a for a in argv], capsys)
    assert "--distributed" in last and "coordinator_address" in last, last
    assert "JAX_COORDINATOR_ADDRESS" in last, last


@pytest.mark.parametrize("lr", ["0", "1e-400"])
def test_a_learning_rate_that_trains_nothing_is_refused(lr, tmp_path, capsys, no_loading):
    """--lr 0 (or one that is 0 as a float) trained for its epochs, left the predictors as
    initialised and saved them."""
    last = _error_line(predictors.main, ["--records", str(tmp_path), "--out",
                                         str(tmp_path / "out"), "--lr", lr], capsys)
    assert "--lr" in last and "> 0" in last and lr in last, last
    assert not (tmp_path / "out").exists()


def test_all_beside_other_tasks_means_every_known_task():
    """'all' alone was every task; beside another name it failed as 'no such task file'."""
    every = list(tasks_mod.TASK_FILES)
    assert tasks_mod.parse_tasks("all,copa") == every
    assert tasks_mod.parse_tasks("mine.jsonl, all") == ["mine.jsonl", *every]
    assert tasks_mod.parse_tasks("copa,copa") == ["copa"]


@pytest.mark.parametrize("argv, words", [
    (["--methods", "nope"], ["--methods", "'nope'", "teal, cats, teal+cats"]),
    (["--methods", "cats"], ["--methods", "'cats'", "no gated MLP"]),
    (["--window", "1024"], ["--window 1024", "128 positions"])])
def test_frontier_checks_methods_and_window_before_loading(argv, words, tmp_path, capsys,
                                                           monkeypatch):
    """An unknown method, or one the model cannot run, ended in a ProfileError traceback
    after the weights loaded; a window past the model's positions, in a ValueError."""
    def forbidden(*args, **kwargs):
        pytest.fail("weights were loaded before the input was checked")

    monkeypatch.setattr(loading, "load_pretrained", forbidden)
    out = tmp_path / "out"
    last = _error_line(frontier.main, ["--model", str(FIXTURE), "--out", str(out),
                                       "--window", "64", *argv], capsys)
    for word in words:
        assert word in last, (word, last)
    assert not out.exists()


def test_frontier_default_methods_are_those_the_model_runs():
    """The default was every method, and the gate's failed on a model without a gated MLP."""
    assert frontier.frontier_methods(preset("opt-tiny"), None) == ["teal"]
    assert frontier.frontier_methods(preset("llama-tiny"), None) == list(METHODS)


def test_sweep_stride_defaults_to_the_window(tmp_path, capsys, monkeypatch):
    """A --window below 1024 without --stride failed on a --stride 1024 never given."""
    def measured(*args, **kwargs):
        raise SystemExit(0)

    text = tmp_path / "text.txt"
    text.write_text("Some text to score. " * 8)
    monkeypatch.setattr(common, "load_model", measured)
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["--preset", "opt-tiny", "--out", str(tmp_path / "out"), "--modes",
                    "oracle", "--text", str(text), "--window", "16"])
    assert exit_.value.code == 0, capsys.readouterr().err


def test_frontier_refuses_another_models_profile_before_scoring(tmp_path, capsys,
                                                                  monkeypatch):
    """A --profile made for another model was found only after the dense rows and the
    calibration had run (minutes of scoring), then failed."""
    def forbidden(*args, **kwargs):
        pytest.fail("scoring started before the profile was checked")

    monkeypatch.setattr(frontier, "score_row", forbidden)
    shipped = Path(frontier.__file__).resolve().parents[1] / "dejavu_jax" / "shipped_profiles"
    other = shipped / "qwen2.5-0.5b.json"
    assert other.is_file()
    last = _error_line(frontier.main, ["--model", str(FIXTURE), "--out", str(tmp_path / "o"),
                                       "--window", "64", "--profile", str(other)], capsys)
    assert "--profile" in last and "does not fit" in last, last


def test_profile_help_describes_every_option():
    """train.profile --help cut its description at "allocate per-layer", and four options
    had no help text."""
    import argparse

    from dejavu_jax.train import profile
    parser = profile.build_parser()
    assert parser.description.endswith("within a perplexity budget."), parser.description
    bare = [a.option_strings[0] for a in parser._actions
            if a.help is None or a.help == argparse.SUPPRESS]
    assert bare == [], bare
    text = parser.format_help()
    assert "seed of the order" in text and "no calibration progress bars" in text


def test_sweep_help_does_not_offer_profile():
    """The sweep scores no threshold mode: its --help listed --profile all the same."""
    assert "--profile" not in sweep.build_parser().format_help()
    assert "--profile" in perplexity.build_parser().format_help()
