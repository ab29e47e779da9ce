"""Zero-shot tasks, scored by log-likelihood as lm-eval-harness does, in any mode.

    python -m dejavu_jax.eval.tasks --tasks copa,piqa --limit 100
    python -m dejavu_jax.eval.tasks --tasks all --mode oracle --mlp-density 0.5
    python -m dejavu_jax.eval.tasks --tasks path/to/new_task.jsonl
    python -m dejavu_jax.eval.tasks --tasks copa --model path/to/opt-30b --devices 4

A task is a file; its format is recognised from its content (see data/README.md):
  *.jsonl {"query", "choices", "gold"}            multiple choice (COPA, PIQA, OpenBookQA)
  *.jsonl {"context_options", "continuation", "gold"}  partial scoring (Winogrande)
  *.jsonl {"context", "continuation"}             greedy last-word accuracy (LAMBADA)
  *.txt[.bz2] 6 lines per item: context, gold index, 4 endings (HellaSwag)
  *.tsv sentence1, sentence2, label (0 = entailment) (RTE: " True" / " False")
A continuation is joined to its context by one space unless either side already has
whitespace there. Multiple choice reports accuracy and length-normalised accuracy
(log-likelihood per character of the continuation, lm-eval's acc_norm); greedy tasks
report accuracy (every continuation token is the argmax) and continuation perplexity.
--devices N / --mesh tp=N[,data=M] run the scorer tensor-parallel, as in `perplexity`.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from dejavu_jax import cli
from dejavu_jax.eval import common
from dejavu_jax.eval.sparse_scoring import EvalMode, token_scores
from dejavu_jax.paths import data_file, data_root
from dejavu_jax.tokenizer import leading_special_ids

TASK_FILES = {
    "copa": "copa.jsonl", "piqa": "piqa.jsonl", "openbookqa": "openbook_qa.jsonl",
    "winogrande": "winogrande.jsonl", "lambada": "lambada_openai.jsonl",
    "hellaswag": "hellaswag_val.txt.bz2", "rte": "rte_dev.tsv",
}
BUCKETS = (32, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class Item:
    """One example: (context, continuation) pairs to score, the gold pair, the kind."""

    pairs: tuple[tuple[str, str], ...]
    gold: int
    kind: str  # "choice" (pick the best pair) or "greedy" (one pair, argmax match)


def join(context: str, choice: str) -> str:
    """The continuation string for `choice` after `context` (adds the separating space)."""
    if context and choice and not context[-1].isspace() and not choice[0].isspace():
        return " " + choice
    return choice


def _read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file; ValueError naming the file's line that is not JSON."""
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number} is not JSON ({e.msg} at column "
                                 f"{e.colno})") from None
    return rows


def _field(row, key: str, kind: str, path: Path, index: int):
    """row[key] checked to be a string ("str"), a list of strings ("strs") or an integer
    ("int", not a bool): ValueError naming the file, the row (1-based) and the field."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}: row {index + 1} is not a JSON object")
    if key not in row:
        raise ValueError(f"{path}: row {index + 1} has no field {key!r} (the first row's "
                         "fields set the file's format)")
    value = row[key]
    ok = {"str": isinstance(value, str),
          "strs": isinstance(value, list) and all(isinstance(v, str) for v in value),
          "int": isinstance(value, int) and not isinstance(value, bool)}[kind]
    if not ok:
        want = {"str": "a string", "strs": "a list of strings", "int": "an integer"}[kind]
        raise ValueError(f"{path}: row {index + 1}: {key!r} must be {want}, got "
                         f"{json.dumps(value)[:60]}")
    return value


def _jsonl_items(rows: list[dict], path: Path) -> list[Item]:
    keys = set(rows[0]) if rows and isinstance(rows[0], dict) else set()
    if not ({"query", "choices", "gold"} <= keys or {"context", "continuation"} <= keys
            or {"context_options", "continuation", "gold"} <= keys):
        raise ValueError(f"{path}: unknown jsonl task format with keys {sorted(keys)}")
    items = []
    for i, r in enumerate(rows):
        f = functools.partial(_field, r, path=path, index=i)
        if {"query", "choices", "gold"} <= keys:
            query = f("query", "str")
            items.append(Item(tuple((query, join(query, c)) for c in f("choices", "strs")),
                              f("gold", "int"), "choice"))
        elif {"context_options", "continuation", "gold"} <= keys:
            cont = f("continuation", "str")
            items.append(Item(tuple((c, join(c, cont)) for c in f("context_options", "strs")),
                              f("gold", "int"), "choice"))
        elif {"context", "continuation"} <= keys:
            context = f("context", "str")
            items.append(Item(((context, join(context, f("continuation", "str"))),), 0,
                              "greedy"))
    return items


def _hellaswag_items(path: Path) -> list[Item]:
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines is not a multiple of 6")
    items = []
    for i in range(0, len(lines), 6):
        ctx, endings = lines[i], lines[i + 2:i + 6]
        try:
            gold = int(lines[i + 1])
        except ValueError:
            raise ValueError(f"{path}: line {i + 2}: the gold index {lines[i + 1][:40]!r} is "
                             "not an integer (6 lines per item: context, gold index, 4 "
                             "endings)") from None
        items.append(Item(tuple((ctx, join(ctx, e)) for e in endings), gold, "choice"))
    return items


def _rte_items(path: Path) -> list[Item]:
    """RTE items of a tab-separated file with a header naming sentence1, sentence2 and
    label; ValueError naming the line of a row with another number of fields or a label
    that is not an integer."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, [])
        missing = [k for k in ("sentence1", "sentence2", "label") if k not in header]
        if missing:
            raise ValueError(f"{path}: the header line has no column {', '.join(missing)} "
                             f"(it has {header})")
        items = []
        for fields in reader:
            if not fields:
                continue
            where = f"{path}: line {reader.line_num}"
            if len(fields) != len(header):
                raise ValueError(f"{where} has {len(fields)} tab-separated fields, the header "
                                 f"{len(header)}")
            r = dict(zip(header, fields))
            try:
                label = int(r["label"])
            except ValueError:
                raise ValueError(f"{where}: label {r['label']!r} is not an integer "
                                 "(0 = entailment, 1 = not)") from None
            ctx = f"{r['sentence1']}\nQuestion: {r['sentence2']} True or False?\nAnswer:"
            items.append(Item(((ctx, " True"), (ctx, " False")), label, "choice"))
    return items


def task_path(name_or_path: str) -> Path:
    """A known task name (TASK_FILES, in data_root()/eval/tasks) or a file path."""
    if name_or_path in TASK_FILES:
        return data_root() / "eval" / "tasks" / TASK_FILES[name_or_path]
    return Path(name_or_path)


def check_task(name_or_path: str) -> Path:
    """The task's file; MissingDataError (a FileNotFoundError) saying how to provide a
    known task's file, FileNotFoundError for another path that does not exist."""
    if name_or_path in TASK_FILES:
        return data_file(f"eval/tasks/{TASK_FILES[name_or_path]}", f"task {name_or_path!r}",
                         ", or pass the task file's path")
    path = Path(name_or_path)
    if path.is_dir():
        raise IsADirectoryError(f"{name_or_path}: is a folder; give a task file")
    if not path.is_file():
        raise FileNotFoundError(f"{name_or_path}: no such task file (known tasks: "
                                f"{', '.join(TASK_FILES)})")
    return path


def task_name(path: Path) -> str:
    """The task's name: a known name for the known files, else the file name's stem."""
    for name, file in TASK_FILES.items():
        if path.name == file:
            return name
    return path.name.split(".")[0]


def result_names(names: list[str]) -> dict[str, str]:
    """{task name or path: the name its results go under}: `task_name`, or the file's path
    when an earlier file of another folder has that name (a file given twice keeps one)."""
    out, files = {}, {}
    for t in names:
        path = task_path(t)
        name = task_name(path)
        if files.setdefault(name, path.resolve()) != path.resolve():
            name = str(path)
        out[t] = name
    return out


def load_task(name_or_path: str, limit: int | None = None) -> list[Item]:
    """The items of a task file (format recognised from the file), the first `limit`.
    A missing file raises FileNotFoundError (`check_task`), one in no known format
    ValueError naming the line or row (a row without a field its format needs too), one
    without items ValueError, an item that cannot be scored ValueError (`check_item`)."""
    path = check_task(name_or_path)
    if path.suffix == ".tsv":
        items = _rte_items(path)
    elif path.suffix == ".bz2" or path.suffix == ".txt":
        items = _hellaswag_items(path)
    else:
        items = _jsonl_items(_read_jsonl(path), path)
    if not items:
        raise ValueError(f"{path}: no items in the file")
    items = items[:limit] if limit else items
    for i, item in enumerate(items):
        check_item(item, path, i)
    return items


def check_item(item: Item, path: Path, index: int) -> None:
    """ValueError naming the file and the item (1-based) unless the item can be scored:
    at least one pair, `gold` the index of one, and each pair a context with text before
    a continuation with text (an empty context leaves the first token unpredicted)."""
    where = f"{path}: item {index + 1}"
    if not item.pairs:
        raise ValueError(f"{where} has no choices")
    if not 0 <= item.gold < len(item.pairs):
        raise ValueError(f"{where}: gold {item.gold} is not the index of one of its "
                         f"{len(item.pairs)} choices")
    for context, continuation in item.pairs:
        if not context.strip():
            raise ValueError(f"{where} has an empty context: the continuation would have "
                             "no text to be scored after")
        if not continuation.strip():
            raise ValueError(f"{where} has an empty continuation or choice")


def encode_pair(tok, context: str, continuation: str,
                lead: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval does: trailing spaces of the context move
    to the continuation, the whole string is encoded once and split at the context's
    length; the context starts with the tokenizer's leading special ids (`lead`, by default
    `leading_special_ids(tok)`)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
    n_ctx = min(n_ctx, len(whole) - 1)
    lead = leading_special_ids(tok) if lead is None else lead
    return lead + whole[:n_ctx], whole[n_ctx:]


def encode_items(tok, items: list[Item]) -> list[tuple[list[int], list[int]]]:
    """Token pairs of every item's pairs, flattened in order."""
    lead = leading_special_ids(tok)
    return [encode_pair(tok, c, x, lead) for item in items for c, x in item.pairs]


def _bucket(n: int) -> int:
    for b in BUCKETS:
        if n <= b:
            return b
    return BUCKETS[-1]


def scored_length(config, max_len: int = 1024) -> int:
    """Tokens one request is scored on at most: `max_len`, or the model's positions
    (`max_position_embeddings`, as lm-eval truncates) if fewer."""
    return min(max_len, config.max_positions)


def score_requests(config, mode: EvalMode, params, pred_params, requests, batch_tokens=4096,
                   dense_prefix: int = 1, max_len: int = 1024, show_progress=False,
                   mesh=None):
    """(log-likelihood [N], all-greedy [N]) of each (context, continuation) token pair.

    Requests are sorted by length and batched in a few padded shapes (one compile each).
    A request longer than `max_len` tokens (or the model's positions) keeps its
    last ones, as lm-eval-harness truncates. A continuation longer than that is an error.
    mesh: params placed on it (`common.load_weights`); rows split over its "data" axis.
    """
    max_len = scored_length(config, max_len)
    seqs = []
    for ctx, cont in requests:
        if len(cont) > max_len:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit the "
                             f"{max_len} tokens scored at once")
        whole = (ctx + cont)[-(max_len + 1):]
        seqs.append((whole, len(cont)))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    batches, i = [], 0
    while i < len(order):
        length = min(_bucket(len(seqs[order[i]][0]) - 1), max_len)
        rows = common.mesh_rows(max(1, batch_tokens // length), mesh)
        group = [j for j in order[i:i + rows] if len(seqs[j][0]) - 1 <= length]
        batches.append((length, rows, group))
        i += len(group)
    loglik = np.zeros(len(seqs))
    greedy = np.zeros(len(seqs), bool)
    for length, rows, group in common.progress(batches, len(batches), f"tasks ({mode.name})",
                                               not show_progress):
        inputs = common.pad_rows([seqs[j][0][:-1] for j in group], length, rows)
        targets = common.pad_rows([seqs[j][0][1:] for j in group], length, rows)
        mask = (np.arange(length)[None] < np.asarray(
            [len(seqs[j][0]) - 1 for j in group] + [0] * (rows - len(group)))[:, None])
        put = functools.partial(common.put_batch, mesh)
        logp, hit, _ = token_scores(config, mode.scfg, params, pred_params, put(inputs),
                                 put(mask.astype(np.int32)),
                                 put(np.full((rows,), dense_prefix, np.int32)), put(targets),
                                 shards=mode.shards)
        logp, hit = common.to_host(logp, np.float64), common.to_host(hit)
        for r, j in enumerate(group):
            n_in, n_cont = len(seqs[j][0]) - 1, seqs[j][1]
            span = slice(n_in - n_cont, n_in)
            loglik[j] = logp[r, span].sum()
            greedy[j] = hit[r, span].all()
    return loglik, greedy


def task_metrics(items: list[Item], loglik: np.ndarray, greedy: np.ndarray,
                 n_tokens: list[int] | None = None) -> dict:
    """Accuracy (and acc_norm, or greedy perplexity) from per-pair scores in item order."""
    acc, acc_norm, k = [], [], 0
    nll_tokens = 0
    for item in items:
        n = len(item.pairs)
        ll = loglik[k:k + n]
        if item.kind == "greedy":
            acc.append(bool(greedy[k]))
            if n_tokens is not None:
                nll_tokens += n_tokens[k]
        else:
            chars = np.asarray([max(1, len(cont)) for _, cont in item.pairs])
            acc.append(int(np.argmax(ll)) == item.gold)
            acc_norm.append(int(np.argmax(ll / chars)) == item.gold)
        k += n
    out = {"items": len(items), "acc": float(np.mean(acc))}
    if acc_norm:
        out["acc_norm"] = float(np.mean(acc_norm))
    elif n_tokens is not None:
        out["perplexity"] = math.exp(-float(loglik.sum()) / max(1, nll_tokens))
    return out


def evaluate(config, mode: EvalMode, params, pred_params, prepared: dict, batch_tokens=4096,
             dense_prefix: int = 1, show_progress=False, mesh=None) -> dict:
    """Metrics per task for prepared = {name: (items, requests)}, plus the mean accuracy.

    mesh: the ("data", "tp") mesh the params are placed on (None: one device).
    """
    names = list(prepared)
    requests = [r for n in names for r in prepared[n][1]]
    start = time.perf_counter()
    loglik, greedy = score_requests(config, mode, params, pred_params, requests, batch_tokens,
                                    dense_prefix, show_progress=show_progress, mesh=mesh)
    results, k = {}, 0
    for n in names:
        items, reqs = prepared[n]
        sl = slice(k, k + len(reqs))
        results[n] = task_metrics(items, loglik[sl], greedy[sl], [len(c) for _, c in reqs])
        k += len(reqs)
    out = {"tasks": results, "mean_acc": float(np.mean([r["acc"] for r in results.values()])),
           "seconds": round(time.perf_counter() - start, 2), "dense_prefix": dense_prefix,
           **mode.describe(config)}
    if mesh is not None:
        out["mesh"] = dict(mesh.shape)
    return out


def prepare(tok, task_names: list[str], limit: int | None) -> dict:
    """{task name: (items, token pairs)} for task names or paths."""
    out = {}
    for t, name in result_names(task_names).items():
        items = load_task(t, limit)
        out[name] = (items, encode_items(tok, items))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.tasks",
                           description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="all",
                   help=f"comma list of names ({', '.join(TASK_FILES)}; all: every one) "
                        "or task file paths (default: all)")
    p.add_argument("--limit", type=cli.positive_int,
                   help="score only the first N items of each task")
    p.add_argument("--out", help="write the result as JSON here")
    common.add_model_args(p)
    common.add_mesh_args(p)
    return p


def parse_tasks(text: str) -> list[str]:
    """Task names/paths from a comma list, spaces around each dropped ('copa, piqa'); 'all'
    stands for every known task, also beside others ('all,my_task.jsonl')."""
    try:
        names = cli.comma_items(text, unique=False)
    except argparse.ArgumentTypeError as e:
        cli.fail(f"--tasks: {e}")
    expanded = [n for t in names for n in (TASK_FILES if t == "all" else [t])]
    return list(dict.fromkeys(expanded))


def load_tasks(names: list[str], limit: int | None) -> dict[str, list[Item]]:
    """{task name: items} of every task, read before any model loads; one `error:` line
    for a missing file or one in no known format."""
    if not names:
        cli.fail("--tasks names no task")
    out = {}
    for t, name in result_names(names).items():
        try:
            out[name] = load_task(t, limit)
        except OSError as e:
            cli.fail(str(e))
        except (ValueError, KeyError) as e:  # JSON, a field, an index: a row is malformed
            what = f"a row has no field {e}" if isinstance(e, KeyError) else str(e)
            cli.fail(what if what.startswith(str(task_path(t))) else
                     f"{task_path(t)}: not a task file in a known format ({what})")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with one `error:` line for bad
    arguments, files or data)."""
    args = build_parser().parse_args(argv)
    common.check_model_args(args)
    common.check_out_path(args.out)
    items = load_tasks(parse_tasks(args.tasks), args.limit)
    mesh = common.mesh_from_args(args)  # None: one device
    mode, pred = common.mode_from_args(args, common.model_config(args), mesh)
    config, params, tok = common.load_model(args, mesh)
    params = common.mode_params(mode, params)
    prepared = {name: (its, encode_items(tok, its)) for name, its in items.items()}
    for name, (_, requests) in prepared.items():
        common.check_ids([t for ctx, cont in requests for t in ctx + cont], config,
                         f"the tokenized task {name!r}")
        longest = max((len(cont) for _, cont in requests), default=0)
        if longest > scored_length(config):
            cli.fail(f"task {name!r}: a continuation of {longest} tokens does not fit the "
                     f"{scored_length(config)} tokens the model scores at once")
    longest = max(min(len(ctx) + len(cont), scored_length(config) + 1) - 1
                  for _, requests in prepared.values() for ctx, cont in requests)
    common.check_dense_prefix(args.dense_prefix, mode.name, longest, "the longest request")
    result = evaluate(config, mode, params, pred, prepared, args.batch_tokens,
                      args.dense_prefix, not args.no_progress, mesh)
    result["limit"] = args.limit
    for name, r in result["tasks"].items():
        extra = "  ".join(f"{k} {v:.4f}" for k, v in r.items() if k not in ("items", "acc"))
        print(f"{name:12s} n={r['items']:5d}  acc {r['acc']:.4f}  {extra}")
    print(f"mean acc {result['mean_acc']:.4f}  ({result['seconds']:.0f} s, {result['mode']}"
          f"{common.mesh_label(mesh)})")
    common.save_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
