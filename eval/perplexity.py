"""Sliding-window perplexity (the standard fixed-window, strided method) in any mode.

    python -m dejavu_jax.eval.perplexity                          # SmolLM2, WikiText-2 test
    python -m dejavu_jax.eval.perplexity --mode sparse --mlp-density 0.5 --max-tokens 16384
    python -m dejavu_jax.eval.perplexity --text file.txt --window 1024 --stride 512
    python -m dejavu_jax.eval.perplexity --text hf:wikitext:wikitext-2-raw-v1:test
    python -m dejavu_jax.eval.perplexity --model path/to/opt-30b --devices 4

Windows of `window` tokens start every `stride` tokens; each token (except the first of
the text) is scored exactly once, in the first window that predicts it after the previous
window's scored span, so after the first window every scored token sees at least
window - stride tokens of context. Sparse and oracle modes run
`sparse_scoring.token_scores`, which equals the token-by-token sparse decode step.

--devices N / --mesh tp=N[,data=M]: weights go straight into the tensor-parallel layout and
the same jitted scorer runs under GSPMD (dense figures equal one device's); windows are
split over "data". Sparse and oracle modes then select per shard, ceil(k / tp) of each
device's own units, as the tensor-parallel decode engine does.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dejavu_jax import cli, model
from dejavu_jax.eval import common
from dejavu_jax.eval.sparse_scoring import EvalMode, token_scores
from dejavu_jax.paths import data_file, data_root, hub_offline, hub_reachable
from dejavu_jax.tokenizer import leading_special_ids


WIKITEXT2 = "eval/wikitext-2/wiki.test.raw"


def wikitext2_path() -> Path:
    """Where the offline WikiText-2 raw test file is looked for (it may be absent)."""
    return data_root() / WIKITEXT2


def load_text(source: str | None) -> str:
    """Text of a file path, or of a Hugging Face dataset 'hf:NAME[:CONFIG[:SPLIT]]'
    (rows joined by blank lines, as in the HF perplexity guide); default the WikiText-2
    test split: the data folder's file, else through `datasets` when the hub is reachable,
    else MissingDataError saying how to provide it."""
    if source and source.startswith("hf:"):
        if not hub_offline() and not hub_reachable():  # offline: the datasets cache only
            raise ConnectionError(f"{source}: the Hugging Face hub is not reachable (pass "
                                  "--text FILE)")
        from datasets import load_dataset
        name, config, split = (source[3:].split(":") + [None, "test"])[:3]
        rows = load_dataset(name, config, split=split or "test")
        return "\n\n".join(rows["text"])
    if source is None and not wikitext2_path().is_file():
        return wikitext2_from_hub()
    path = Path(source) if source else wikitext2_path()
    return path.read_text(encoding="utf-8-sig").replace("\r\n", "\n")


def wikitext2_from_hub() -> str:
    """The WikiText-2 raw test split through `datasets` (for a machine without the data
    folder); MissingDataError when `datasets` is absent or the hub unreachable."""
    if not hub_reachable():
        data_file(WIKITEXT2, "WikiText-2", ", or pass --text FILE (the Hugging Face hub, "
                  "where `datasets` would fetch it, is not reachable)")
    print(f"{wikitext2_path()} is absent: fetching WikiText-2 through `datasets` ...",
          file=sys.stderr)
    try:
        return load_text("hf:wikitext:wikitext-2-raw-v1:test")
    except Exception as e:  # ImportError, or a network error (which come in many types)
        reason = f"{type(e).__name__}: {cli.first_line(e)}"
        data_file(WIKITEXT2, "WikiText-2", f", or pass --text FILE (`datasets` could not "
                  f"fetch it: {reason})")
        raise


def plan_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window over a token stream of n_tokens.

    A window's inputs are tokens [begin, end) and it predicts tokens begin+1 .. end; it
    scores the targets from first_scored to end (inclusive). Every target 1..n-1 is
    scored exactly once.
    """
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride} window={window}")
    plans, scored_until, begin = [], 1, 0
    while scored_until < n_tokens:
        end = min(begin + window, n_tokens - 1)
        plans.append((begin, end, scored_until))
        scored_until = end + 1
        begin += stride
    return plans


def score_windows(config, mode: EvalMode, params, pred_params, ids: np.ndarray,
                  window: int, stride: int, batch_tokens: int = 4096, dense_prefix: int = 1,
                  show_progress: bool = False, mesh=None, token_nll: bool = False,
                  lead: Sequence[int] = ()) -> dict:
    """Total NLL and token count of `ids` under `mode`, windows batched into one shape.

    mesh: params placed on it (`common.load_weights`); rows split over its "data" axis.
    token_nll: also return each scored target's NLL in text order (`token_nll`, float64
    [tokens]: target i + 1 at index i).
    lead: ids put before every window and never scored (the tokenizer's leading special
    ids, `tokenizer.leading_special_ids`: Gemma's <bos>); they run dense, as the prompt.
    """
    plans = plan_windows(len(ids), window, stride)
    rows_per_call = common.mesh_rows(max(1, batch_tokens // window), mesh)
    share = mode.shared_rows
    rows_per_call = -(-rows_per_call // share) * share   # whole groups of shared rows
    lead = [int(i) for i in lead]
    n_lead = len(lead)
    length = min(window, len(ids) - 1) + n_lead
    model.check_positions(config, length)
    nll, count, greedy, read = 0.0, 0, 0, 0.0
    per_token = np.zeros(len(ids) - 1) if token_nll else None
    batches = [plans[i:i + rows_per_call] for i in range(0, len(plans), rows_per_call)]
    for batch in common.progress(batches, len(batches), f"perplexity ({mode.name})",
                                 not show_progress):
        inputs = common.pad_rows([lead + list(ids[b:e]) for b, e, _ in batch], length,
                                 rows_per_call)
        targets = common.pad_rows([lead[1:] + list(ids[b if n_lead else b + 1:e + 1])
                                   for b, e, _ in batch], length, rows_per_call)
        weight = np.zeros((rows_per_call, length), bool)
        mask = np.zeros((rows_per_call, length), np.int32)
        for r, (b, e, first) in enumerate(batch):
            mask[r, :n_lead + e - b] = 1
            # position n_lead + i predicts token b + i + 1
            weight[r, n_lead + first - b - 1:n_lead + e - b] = True
        put = functools.partial(common.put_batch, mesh)
        logp, hit, reads = token_scores(
            config, mode.scfg, params, pred_params, put(inputs), put(mask),
            put(np.full((rows_per_call,), dense_prefix + n_lead, np.int32)), put(targets),
            shards=mode.shards, share=share)
        logp, hit = common.to_host(logp, np.float64), common.to_host(hit)
        nll -= float(logp[weight].sum())
        if per_token is not None:
            for r, (b, e, first) in enumerate(batch):
                per_token[first - 1:e] = -logp[r, n_lead + first - b - 1:n_lead + e - b]
        greedy += int(hit[weight].sum())
        read += float(common.to_host(reads, np.float64)[weight].sum())
        count += int(weight.sum())
    return {"tokens": count, "nll": nll / count, "perplexity": math.exp(nll / count),
            "total_nll": nll, "greedy_accuracy": greedy / count, "windows": len(plans),
            **common.bytes_summary(config, mode, pred_params, read / count),
            **({} if per_token is None else {"token_nll": per_token})}


def perplexity(config, mode: EvalMode, params, pred_params, ids, window: int = 1024,
               stride: int = 512, batch_tokens: int = 4096, dense_prefix: int = 1,
               show_progress: bool = False, mesh=None, lead: Sequence[int] = ()) -> dict:
    """Perplexity result dict (tokens, nll, perplexity, timing, settings) for token ids.

    mesh: the ("data", "tp") mesh the params are placed on (None: one device).
    lead: ids before every window, unscored (`score_windows`).
    """
    ids = np.asarray(ids, np.int32)
    start = time.perf_counter()
    result = score_windows(config, mode, params, pred_params, ids, window, stride,
                           batch_tokens, dense_prefix, show_progress, mesh, lead=lead)
    result.update(seconds=round(time.perf_counter() - start, 2), window=window, stride=stride,
                  dense_prefix=dense_prefix, text_tokens=int(len(ids)),
                  lead_ids=[int(i) for i in lead],
                  **mode.describe(config))
    if mesh is not None:
        result["mesh"] = dict(mesh.shape)
    return result


def default_window(config, n_lead: int) -> int:
    """Tokens per window when --window is not given: 1024, or fewer where the model's
    positions must hold the `n_lead` leading ids and the window."""
    return max(1, min(1024, config.max_positions - n_lead))


def text_source(text: str) -> str:
    """An argparse type for --text: an existing file, or hf:NAME[:CONFIG[:SPLIT]]."""
    if text.startswith("hf:"):
        parts = text[3:].split(":")
        if not parts[0] or len(parts) > 3:
            raise argparse.ArgumentTypeError(f"{text!r}: hf:NAME[:CONFIG[:SPLIT]] expected")
        return text
    if Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a text file")
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.perplexity",
                           description=__doc__.split("\n")[0])
    p.add_argument("--text", type=text_source, help="text file, or hf:NAME[:CONFIG[:SPLIT]] "
                   "(default: WikiText-2 raw test from the data folder, $DEJAVU_DATA)")
    p.add_argument("--window", type=cli.positive_int,
                   help="tokens per window (default 1024, or the model's positions if "
                        "fewer)")
    p.add_argument("--stride", type=cli.positive_int,
                   help="tokens between window starts, at most --window (default half the "
                        "window, at most 512)")
    p.add_argument("--max-tokens", type=cli.positive_int,
                   help="score only the first N tokens of the text")
    p.add_argument("--shared-rows", type=cli.positive_int, default=1,
                   help="sparse mode: score windows in groups of N decoded together under "
                        "the batch policy 'shared' (each position's sets are the group's "
                        "top-k of summed predicted probabilities; default 1: each its own)")
    p.add_argument("--out", help="write the result as JSON here")
    common.add_model_args(p)
    common.add_mesh_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with one `error:` line for bad
    arguments, files or data)."""
    args = build_parser().parse_args(argv)
    common.check_model_args(args)
    common.check_out_path(args.out)
    if args.shared_rows > 1 and args.mode != "sparse":
        cli.fail(f"--shared-rows {args.shared_rows} shares predicted sets: it needs "
                 f"--mode sparse")
    known = common.model_config(args)
    if args.window is not None:
        try:
            model.check_positions(known, args.window)
        except ValueError as e:
            cli.fail(f"--window {args.window}: {e}")
        if args.window > known.max_positions:  # rotary models: past their context
            cli.fail(f"--window {args.window}: the model has {known.max_positions} positions "
                     "of context")
    if args.stride is not None and args.stride > (args.window or 1024):
        cli.fail(f"--stride {args.stride} is larger than --window {args.window or 1024}")
    try:
        text = load_text(args.text)  # before the model: a missing text fails fast
    except UnicodeDecodeError as e:
        cli.fail(f"{args.text or wikitext2_path()}: not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        cli.fail(str(e))
    mesh = common.mesh_from_args(args)  # None: one device
    mode, pred = common.mode_from_args(args, common.model_config(args), mesh)
    config, params, tok = common.load_model(args, mesh)
    params = common.mode_params(mode, params)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    if len(ids) < 2:
        cli.fail(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    common.check_ids(ids, config, "the tokenized text")
    lead = leading_special_ids(tok)
    if args.window is None:
        args.window = default_window(config, len(lead))
    if args.stride is None:
        args.stride = max(1, min(512, args.window // 2))
    if args.stride > args.window:
        cli.fail(f"--stride {args.stride} is larger than --window {args.window}")
    common.check_dense_prefix(args.dense_prefix, mode.name, min(args.window, len(ids) - 1),
                              f"--window {args.window}")
    length = min(args.window, len(ids) - 1) + len(lead)   # leading ids before every window
    try:
        model.check_positions(config, length)
    except ValueError as e:
        cli.fail(f"--window {args.window} and {len(lead)} leading id(s): {e}")
    if length > config.max_positions:   # rotary models: past their context
        cli.fail(f"--window {args.window} and {len(lead)} leading id(s) pass the model's "
                 f"{config.max_positions} positions of context")
    result = perplexity(config, mode, params, pred, ids, args.window, args.stride,
                        args.batch_tokens, args.dense_prefix, not args.no_progress, mesh,
                        lead=lead)
    result["text"] = args.text or str(wikitext2_path())
    print(f"{result['mode']}: {result['tokens']} tokens, NLL {result['nll']:.4f}, "
          f"perplexity {result['perplexity']:.3f} ({result['seconds']:.0f} s"
          f"{common.mesh_label(mesh)})")
    common.save_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
