"""Executes notebooks/sparsity_per_layer.ipynb headlessly on a tiny random model.

The notebook reads its parameters from DEJAVU_NOTEBOOK_* environment variables in its first
code cell; here it runs `preset:opt-tiny` on a few hundred tokens, with tiny predictors
trained in the test (on a made-up corpus, through a word-level tokenizer built here, so no
data folder is needed) and a made-up evaluation file, so every section executes; the fetch
cache is an empty folder, so section 9 (a larger fetched model) prints its skip line. Any cell
error (for example a changed public API) fails the test. The kernel is this interpreter
(a kernelspec written for sys.executable), so it sees the same installed dejavu_jax.
"""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "sparsity_per_layer.ipynb"
KERNEL = "dejavu-notebook-test"


def word_tokenizer(folder: Path, text: str) -> Path:
    """A Hugging Face word-level tokenizer of `text`'s words (ids 1.., 0 unknown), saved to
    `folder`: collection needs a tokenizer, and this one needs no data folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    split = pre_tokenizers.Whitespace()
    words = sorted({word for word, _ in split.pre_tokenize_str(text)})
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return folder


def tiny_predictors(tmp_path: Path) -> Path:
    """Predictors for preset:opt-tiny (seed 0, the notebook's default), collected with a
    word-level tokenizer of the made-up corpus."""
    from dejavu_jax.train import collect, predictors
    corpus = "".join(f"Line {i}: the river carried {i % 7} stones past the mill.\n"
                     for i in range(300))
    text = tmp_path / "corpus.txt"
    text.write_text(corpus)
    tokenizer = word_tokenizer(tmp_path / "tokenizer", corpus)
    assert collect.main(["--preset", "opt-tiny", "--corpus", str(text), "--tokens", "600",
                         "--window", "32", "--tokenizer", str(tokenizer), "--out",
                         str(tmp_path / "records"), "--no-progress"]) == 0
    assert predictors.main(["--records", str(tmp_path / "records"), "--out",
                            str(tmp_path / "pred"), "--epochs", "1", "--batch-size", "128",
                            "--rank", "16", "--no-progress", "--no-output-metric"]) == 0
    return tmp_path / "pred"


def test_notebook_runs_on_tiny_model(tmp_path, monkeypatch):
    kernel_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dejavu test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel draws inline

    pred = tiny_predictors(tmp_path)
    evals = tmp_path / "eval"
    evals.mkdir()
    (evals / "sweep.json").write_text(json.dumps({"runs": [
        {"mode": "oracle", "mlp_density": d, "head_density": 1.0, "perplexity": 20 + 10 * (1 - d)}
        for d in (1.0, 0.5, 0.25)]}))
    monkeypatch.setenv("DEJAVU_NOTEBOOK_MODEL", "preset:opt-tiny")
    monkeypatch.setenv("DEJAVU_NOTEBOOK_WINDOWS", "32")
    monkeypatch.setenv("DEJAVU_NOTEBOOK_WINDOW", "13")
    monkeypatch.setenv("DEJAVU_NOTEBOOK_PREDICTORS", str(pred))
    monkeypatch.setenv("DEJAVU_NOTEBOOK_EVAL", str(evals / "*.json"))
    # an empty fetch cache: section 9 (the larger model) must skip with a line, as in CI
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path / "empty-cache"))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "opt-tiny (random weights, seed 0)" in text
    assert "recorded 32 windows x 12 tokens" in text
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images >= 6  # sections 1-4 and 6 always plot, 7 plots the made-up sweep
    assert "on this notebook's tokens" in text  # section 5 ran the trained predictors
    assert "section 9 skipped: qwen2.5-1.5b is not in the fetch cache" in text
    assert "./dejavu run fetch_model qwen2.5-1.5b" in text
