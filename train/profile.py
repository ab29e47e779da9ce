"""Make a model's sparsity profile: calibrate activation thresholds, allocate per-layer
budgets, and search for the sparsest allocation within a perplexity budget.

    python -m dejavu_jax.train.profile                       # SmolLM2-135M, a few minutes
    python -m dejavu_jax.train.profile --model qwen2.5-1.5b --python --budget 0.01
    python -m dejavu_jax.train.profile --model path/to/model.gguf --method cats

Calibration text is the shared corpus (`--corpus`; with `--python` also the standard
library's calibration files, `eval.python_source`): `--calibration-tokens` of it give the
thresholds and cost estimates (`train.thresholds`), and the next `--search-tokens`, other
windows of the same text, measure the allocations the search tries (`train.allocate`)
with the scorer that equals the sparse decode step. Evaluation text (WikiText-2 test, the
standard library's test files) is never read. Nothing but the profile is written: by
default `$DEJAVU_CACHE/profiles/<model>-<method>.json` (a fetchable model by its registry
name, e.g. `smollm2-135m`), where `generate --sparse` finds it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax.models_registry import registry_name
from dejavu_jax.sparsity_profile import (METHODS, SparsityProfile, encode_gate_weights,
                                         method_sites)

DEFAULT_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def text_windows(tokenizer, files, window: int, count: int, seed: int,
                 bos_id: int | None) -> np.ndarray:
    """`count` token windows [count, window] of the corpus files (`train.corpus`), in a
    seeded order; ValueError when the corpus holds fewer."""
    from dejavu_jax.train.corpus import token_windows
    out = []
    for ids in token_windows(tokenizer, files, window, seed, bos_id):
        out.append(ids)
        if len(out) == count:
            return np.stack(out)
    raise ValueError(f"the corpus gives {len(out)} windows of {window} tokens; "
                     f"{count} needed")


# standard errors of the search text's cost added before comparing it with the budget
SEARCH_MARGIN = 1.0


def paired_standard_error(differences: np.ndarray) -> float:
    """The standard error of the mean of per-window NLL differences (sparse less dense
    on the same windows): how far the search text's cost may sit from the cost on other
    text of its kind; 0 with fewer than two windows."""
    d = np.asarray(differences, np.float64)
    return float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0


def score(config, scfg, params, thresholds, windows: np.ndarray, rows: int):
    """(mean next-token NLL, mean fraction of decoder matmul bytes read, each window's mean
    NLL [n_windows]) of the windows under thresholds [L, len(SITES)] (scfg: a threshold
    SparseConfig)."""
    from dejavu_jax.eval.sparse_scoring import token_scores
    nll, read, n, window_nll = 0.0, 0.0, 0, []
    for i in range(0, len(windows), rows):
        batch = windows[i:i + rows]
        pad = rows - len(batch)
        ids = np.concatenate([batch, np.zeros((pad, batch.shape[1]), np.int32)])
        mask = np.ones_like(ids)
        mask[len(batch):] = 0
        logp, _, reads = token_scores(config, scfg, params, jnp.asarray(thresholds),
                                      jnp.asarray(ids[:, :-1]), jnp.asarray(mask[:, :-1]),
                                      jnp.ones((rows,), jnp.int32), jnp.asarray(ids[:, 1:]))
        logp, reads = np.asarray(logp)[:len(batch)], np.asarray(reads)[:len(batch)]
        nll -= float(logp.sum())
        read += float(reads.sum())
        n += logp.size
        window_nll.append(-logp.mean(axis=1))
    return nll / n, read / n, np.concatenate(window_nll)


def calibrate(config, params, windows: np.ndarray, levels, rows: int, progress=True,
              base=None) -> dict:
    """`train.thresholds.calibration_stats` of the windows (around thresholds `base`, None:
    dense), `rows` windows at a time, merged by token count."""
    from tqdm import tqdm

    from dejavu_jax.train.thresholds import calibration_stats, merge_stats
    parts, weights = [], []
    batches = range(0, len(windows), rows)
    for i in tqdm(batches, desc="calibrating", disable=not progress):
        batch = windows[i:i + rows]
        stats = calibration_stats(config, params, jnp.asarray(batch), jnp.ones_like(batch),
                                  tuple(levels), base=None if base is None else
                                  jnp.asarray(base, jnp.float32))
        parts.append({k: np.asarray(v) for k, v in stats.items()})
        weights.append(batch.size)
    return merge_stats(parts, weights)


def gate_weighted(config, params, windows: np.ndarray, rows: int, sites):
    """`params` with the gate site's per-neuron weights (`train.thresholds.gate_weights`
    on the calibration windows) when `sites` hold the gate site, else unchanged."""
    if "gate" not in sites:
        return params
    from dejavu_jax.params import with_gate_weights
    from dejavu_jax.train.thresholds import gate_weights
    return with_gate_weights(params, gate_weights(config, params, windows, rows))


def make_profile(config, params, calib: np.ndarray, search_windows: np.ndarray, method: str,
                 budget: float, levels=DEFAULT_LEVELS, rows: int = 4, progress=True,
                 log=print, stats: dict | None = None, measured: dict | None = None,
                 rounds: int = 2, margin: float = SEARCH_MARGIN) -> SparsityProfile:
    """The profile of `method` for the model: thresholds calibrated on `calib` windows
    (or the dense `calibrate` stats given), per-layer levels on the allocation path, the
    sparsest whose perplexity cost on `search_windows` is at most `budget` (a fraction,
    0.01 = 1%). Each further round (`rounds`) calibrates again around the point chosen,
    where its layers' errors compound, and searches on from it. `measured`: a dict that
    keeps the search's measurements between calls for the same model, windows and method
    (profiles at several budgets). An allocation is within the budget when its cost plus
    `margin` standard errors of it (`paired_standard_error`) is. The gate site ranks
    neurons with `params`' gate weights (`gate_weighted`), which the profile stores."""
    from dejavu_jax.sparse import threshold_config
    from dejavu_jax.train import allocate
    from dejavu_jax.train.thresholds import thresholds_at
    sites = method_sites(config, method)
    start = time.perf_counter()
    if stats is None:
        stats = calibrate(config, params, calib, levels, rows, progress)
    calib_s = time.perf_counter() - start
    measured = {} if measured is None else measured
    unit_bytes = allocate.site_bytes(config, sites)
    scfg = threshold_config(config, sites)
    zero = np.zeros((config.n_layers, len(unit_bytes)), np.float32)
    if "dense" not in measured:
        nll, _, windows = score(config, scfg, params, zero, search_windows, rows)
        measured["dense"] = (nll, windows)
    dense_nll, dense_windows = measured["dense"]

    def measure(thresholds):
        """(NLL cost, bytes skipped, the cost's standard error over the search windows)."""
        key = np.asarray(thresholds, np.float32).tobytes()
        if key not in measured:
            nll, read, windows = score(config, scfg, params, thresholds, search_windows,
                                       rows)
            measured[key] = (nll - dense_nll, 1.0 - read,
                             paired_standard_error(windows - dense_windows))
        return measured[key]

    def report(point):
        log(f"  price {point.price:.3g}: predicted skip "
            f"{allocate.predicted_skip(config, sites, point.levels):.1%}, measured skip "
            f"{point.bytes_skipped:.1%}, perplexity cost {math.expm1(point.nll_cost):+.2%} "
            f"± {point.nll_se:.2%}")

    chosen, chosen_t, chosen_point, points = zero, zero, None, []
    round_stats = stats
    for r in range(rounds):
        if r:
            t0 = time.perf_counter()
            round_stats = calibrate(config, params, calib, levels, rows, progress,
                                    base=chosen_t)
            calib_s += time.perf_counter() - t0

        def thresholds_of(lv, q=round_stats["quantiles"], base=chosen, base_t=chosen_t):
            return np.where(lv > base, thresholds_at(q, lv), base_t).astype(np.float32)

        log(f"round {r + 1}: searching the allocation path for the sparsest within "
            f"{budget:.1%} perplexity cost ({search_windows.size} search tokens)")
        best, found = allocate.refined_search(
            allocate.unit_costs(round_stats), levels, unit_bytes,
            lambda lv: measure(thresholds_of(lv)), math.log1p(budget), chosen, report,
            margin=margin)
        points += found
        if best is None or np.array_equal(best[1], chosen):
            break
        chosen, chosen_t = best[1], thresholds_of(best[1])
        chosen_point = next(p for p in found if p.levels is chosen)
    summary = {"text": "search windows of the calibration corpus", "dense_nll": dense_nll,
               "search_tokens": int(search_windows[:, 1:].size), "budget": budget,
               "rounds": rounds,
               "margin_se": margin,
               "nll_cost": chosen_point.nll_cost if chosen_point else 0.0,
               "nll_se": chosen_point.nll_se if chosen_point else 0.0,
               "ppl_cost": math.expm1(chosen_point.nll_cost) if chosen_point else 0.0,
               "bytes_skipped": chosen_point.bytes_skipped if chosen_point else 0.0,
               "points": [{"price": p.price, "nll_cost": p.nll_cost, "nll_se": p.nll_se,
                           "bytes_skipped": p.bytes_skipped,
                           "predicted_skip": allocate.predicted_skip(config, sites, p.levels)}
                          for p in points]}
    calibration = {"tokens": int(calib[:, 1:].size), "window": int(calib.shape[1]),
                   "levels": list(levels), "seconds": round(calib_s, 1),
                   "search_seconds": round(time.perf_counter() - start - calib_s, 1)}
    return SparsityProfile(
        model=config.name, fingerprint=config.fingerprint(), method=method, sites=sites,
        levels=np.asarray(chosen, float).round(4).tolist(),
        thresholds=np.asarray(chosen_t, float).tolist(), measured=summary,
        calibration=calibration,
        gate_weights=encode_gate_weights(params.layers.gate_weight) if "gate" in sites
        else None)


def window_length(text: str) -> int:
    """An argparse type: a window of at least 3 tokens (its first input runs dense, as a
    prompt does, so 2 would measure no sparse token)."""
    value = cli.positive_int(text)
    if value < 3:
        raise argparse.ArgumentTypeError(f"must be >= 3 (the first position of a window runs "
                                         f"dense), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.train.profile",
                           description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", type=cli.model_source,
                   help="a fetchable model's name, a checkpoint folder or a .gguf file "
                        "(default: smollm2-135m)")
    p.add_argument("--tokenizer", type=cli.existing_path,
                   help="tokenizer folder or .gguf (default: the model's own)")
    p.add_argument("--method", choices=sorted(METHODS),
                   help="threshold sites: teal (q/k/v, o, gate/up and down inputs), cats "
                        "(the gate), teal+cats (all; default for gated MLPs, else teal)")
    p.add_argument("--budget", type=cli.fraction, default=0.01,
                   help="largest perplexity cost on the search text, one standard error of it "
                        "included (default 0.01 = 1%%)")
    p.add_argument("--calibration-tokens", type=cli.positive_int, default=2048,
                   help="corpus tokens whose activations set the thresholds and cost "
                        "estimates, rounded up to whole forward calls of --rows windows "
                        "(default 2048)")
    p.add_argument("--search-tokens", type=cli.positive_int, default=4096,
                   help="tokens of other corpus windows on which the search measures each "
                        "allocation's perplexity cost, rounded up like --calibration-tokens "
                        "(default 4096)")
    p.add_argument("--window", type=window_length,
                   help="tokens per calibration and search window, at least 3 (default 256, "
                        "or the model's positions if fewer)")
    p.add_argument("--corpus", action="append",
                   help="calibration text: file, folder or glob, repeatable (default: the "
                        "shared corpus, <data root>/corpus/*.txt)")
    p.add_argument("--python", action="store_true",
                   help="add the standard library's calibration files (coder models)")
    p.add_argument("--rounds", type=cli.positive_int, default=2,
                   help="calibrate and search again around the point found, this many "
                        "times in all (default 2)")
    p.add_argument("--rows", type=cli.positive_int, default=4,
                   help="windows per forward call (memory)")
    p.add_argument("--seed", type=cli.seed, default=0,
                   help="seed of the order in which the corpus windows are drawn "
                        "(default 0)")
    p.add_argument("--out", type=Path, help="profile file (default: "
                   "$DEJAVU_CACHE/profiles/<model>-<method>.json)")
    p.add_argument("--no-progress", action="store_true",
                   help="no calibration progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 with one `error:` line for bad input)."""
    args = build_parser().parse_args(argv)
    from dejavu_jax.eval import common, python_source
    common.check_out_path(None if args.out is None else str(args.out))
    from dejavu_jax.paths import cache_root
    from dejavu_jax.sparsity_profile import ProfileError
    from dejavu_jax.train.corpus import CorpusError, default_corpus, resolve_files
    try:
        files = resolve_files(args.corpus or default_corpus())
        if args.python:
            files += python_source.stdlib_files("calibration")
    except (CorpusError, FileNotFoundError) as e:
        cli.fail(str(e))
    from dejavu_jax.fetch_model import FetchError, resolve_model
    try:
        source = resolve_model(args.model or "smollm2-135m")
    except FetchError as e:
        cli.fail(str(e))
    from dejavu_jax.checkpoint_files import CheckpointError
    from dejavu_jax.loading import load_pretrained, read_config
    try:
        config = read_config(source)
    except CheckpointError as e:
        cli.fail(cli.first_line(e))
    if args.window is None:
        args.window = max(3, min(256, config.max_positions))
    elif args.window > config.max_positions:  # past OPT's learned positions: NaN scores
        cli.fail(f"--window {args.window} is longer than the model's {config.max_positions} "
                 "positions")
    method = args.method or ("teal+cats" if config.gated_mlp else "teal")
    try:
        method_sites(config, method)
    except ProfileError as e:
        cli.fail(str(e))
    def windows_for(tokens):  # whole forward calls of --rows windows
        return -(-tokens // ((args.window - 1) * args.rows)) * args.rows

    n_calib, n_search = windows_for(args.calibration_tokens), windows_for(args.search_tokens)
    print(f"profile {method} for {config.name}: {n_calib} calibration and {n_search} search "
          f"windows of {args.window} tokens; about {_estimate(config, n_calib, n_search, args)}"
          f" on this machine's CPU; writes one JSON file of {_size(config, method)}",
          file=sys.stderr)
    try:
        tok = common.load_tokenizer_for(args, config, Path(source))
        windows = text_windows(tok, files, args.window, n_calib + n_search, args.seed,
                               config.bos_token_id)
    except (CheckpointError, CorpusError, OSError, ValueError) as e:
        cli.fail(str(e))
    common.check_ids(windows.ravel(), config, "the calibration text")
    try:
        _, params = load_pretrained(source, dtype=jnp.float32)
    except CheckpointError as e:
        cli.fail(cli.first_line(e))
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    params = gate_weighted(config, params, windows[:n_calib], args.rows,
                               method_sites(config, method))
    profile = make_profile(config, params, windows[:n_calib], windows[n_calib:], method,
                           args.budget, rows=args.rows, progress=not args.no_progress, log=log,
                           rounds=args.rounds)
    profile.calibration.update(corpus=[str(f) for f in files], seed=args.seed,
                               source=str(source))
    out = args.out or cache_root() / "profiles" / f"{registry_name(config.name)}-{method}.json"
    profile.save(out)
    print(profile.summary(), file=sys.stderr)
    print(out)
    return 0


def _size(config, method: str) -> str:
    """The profile file's rough size: a few KB, plus the gate weights (float16 in base64)."""
    if "gate" not in METHODS[method]:
        return "a few KB"
    return f"about {round(config.n_layers * config.ffn * 8 / 3 / 1e3)} KB"


def _estimate(config, n_calib: int, n_search: int, args) -> str:
    """A rough wall time: about 25 forward-equivalents per calibration token and 8 search
    evaluations, at 2 * params FLOPs per token and 40 GFLOP/s."""
    from dejavu_jax.activation_sparsity import layer_elements
    flops = 2.0 * layer_elements(config) * config.n_layers
    tokens = n_calib * args.window * 25 + n_search * args.window * 9
    minutes = tokens * flops / 40e9 / 60
    return f"{max(1, round(minutes))} minutes"


if __name__ == "__main__":
    sys.exit(main())
