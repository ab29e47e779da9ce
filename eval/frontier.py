"""Quality against bytes skipped, one model, every selection method, one paired test text.

    python -m dejavu_jax.eval.frontier --model smollm2-135m --out eval/results/cpu/smollm2-frontier
    python -m dejavu_jax.eval.frontier --model qwen2.5-1.5b --python --tokens 16384 --out DIR

The x-axis is the fraction of the decoder layers' matmul weight bytes a decode step does
not read, counted per scored token by the scorer that equals the sparse decode step (and
for predictors, their own weights as bytes read). Rows:
  * dense;
  * each threshold method (`sparsity_profile.METHODS`): points along its allocation path
    (`train.allocate`, calibrated once on the corpus), and its profiles at the budgets
    (`--budgets`), chosen on search windows of the corpus, never on the test text;
  * the oracle MLP top-k at densities whose skip matches `--skips` (an upper bound: it
    computes every neuron to rank them), and with `--predictors` trained predictors;
  * `--profile FILE` rows for profiles made elsewhere.
Every row scores the same tokens: WikiText-2 test (`--tokens`) and, with `--python`, the
standard library's test files. Rows go to OUT/frontier.jsonl as they finish, and a rerun
with the same OUT skips the rows it has; the profiles go to OUT/profiles/, the figure to
OUT/frontier.png and the table to OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli
from dejavu_jax.models_registry import registry_name

DEFAULT_SKIPS = (0.1, 0.2, 0.3, 0.4, 0.5)


def test_texts(tok, args) -> dict[str, np.ndarray]:
    """{name: token ids} of the evaluation texts."""
    from dejavu_jax.eval import python_source
    from dejavu_jax.eval.perplexity import load_text
    texts = {"wikitext2": (load_text(None), args.tokens)}
    if args.python:
        texts["python"] = (python_source.python_text("test"), args.python_tokens or args.tokens)
    return {name: np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n], np.int32)
            for name, (text, n) in texts.items()}


class Rows:
    """The JSONL file of finished rows, keyed by (kind, method, label, text)."""

    def __init__(self, path: Path):
        self.path = path
        self.rows = [json.loads(line) for line in path.read_text().splitlines()] \
            if path.is_file() else []

    def has(self, key: tuple) -> bool:
        return any(tuple(r[k] for k in ("kind", "method", "label", "text")) == key
                   for r in self.rows)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def score_row(config, mode, params, selector_params, ids, args, lead=()) -> dict:
    """Perplexity, bytes skipped and time of one mode on one text (`lead`: the ids before
    every window, `eval.perplexity.score_windows`)."""
    from dejavu_jax.eval.perplexity import perplexity
    r = perplexity(config, mode, params, selector_params, ids, window=args.window,
                   stride=args.window, batch_tokens=args.batch_tokens, lead=lead)
    return {k: r[k] for k in ("tokens", "nll", "perplexity", "bytes_skipped", "bytes_read",
                              "selector_bytes", "seconds")}


def path_points(config, sites, stats, levels, skips):
    """For each target skip, the allocation on the path whose predicted skip is closest."""
    from dejavu_jax.train import allocate
    path = allocate.allocation_path(allocate.unit_costs(stats), levels,
                                    allocate.site_bytes(config, sites))
    predicted = np.asarray([allocate.predicted_skip(config, sites, lv) for _, lv in path])
    out = []
    for target in skips:
        i = int(np.argmin(np.abs(predicted - target)))
        out.append((target, path[i][1], float(predicted[i])))
    return out


def oracle_density(config, skip: float) -> float:
    """The MLP density whose skipped bytes (neurons' gate, up and down rows) are `skip` of
    the decoder matmul bytes."""
    from dejavu_jax.activation_sparsity import layer_elements, matmul_elements
    m = matmul_elements(config)
    mlp_share = (m["gate"] + m["up"] + m["down"]) / layer_elements(config)
    return max(0.02, 1.0 - skip / mlp_share)


def record_test(path: Path, text: str, row: dict, dense_perplexity: float) -> None:
    """Write a profile row's measured figures on a test text into the profile file, where
    `generate --sparse` reports them."""
    from dejavu_jax.sparsity_profile import load_profile
    prof = load_profile(path)
    prof.measured.setdefault("test", {})[text] = {
        "ppl_cost": row["perplexity"] / dense_perplexity - 1,
        "bytes_skipped": row["bytes_skipped"], "tokens": row["tokens"]}
    prof.save(path)


def plot(rows: list[dict], out: Path, model: str) -> None:
    """Perplexity cost against bytes skipped, a panel per text, a line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    texts = sorted({r["text"] for r in rows})
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    for ax, text in zip(axes[0], texts):
        dense = next(r for r in rows if r["text"] == text and r["kind"] == "dense")
        methods = sorted({r["method"] for r in rows if r["kind"] != "dense"})
        for i, method in enumerate(methods):
            color = f"C{i % 10}"  # one colour per method, for its line and its profiles
            pts = sorted((r["bytes_skipped"], 100 * (r["perplexity"] / dense["perplexity"] - 1))
                         for r in rows if r["text"] == text and r["method"] == method
                         and r["kind"] in ("path", "oracle", "predictors"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method, color=color)
            prof = [(r["bytes_skipped"], 100 * (r["perplexity"] / dense["perplexity"] - 1))
                    for r in rows if r["text"] == text and r["method"] == method
                    and r["kind"] == "profile"]
            if prof:
                ax.scatter(*zip(*prof), marker="*", s=160, zorder=5, color=color,
                           label=f"{method} profiles")
        ax.axhline(1, color="grey", ls=":", lw=1)
        ax.axhline(3, color="grey", ls="--", lw=1)
        ax.set_xlabel("decoder weight bytes skipped per token")
        ax.set_ylabel("perplexity cost (%)")
        ax.set_title(f"{model}: {text} (dense {dense['perplexity']:.2f})")
        ax.set_ylim(-2, 12)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(rows: list[dict]) -> str:
    """Markdown: per text and method, the largest measured skip at <= 1% and <= 3% cost
    along the sweep, and each profile's measured point."""
    lines = ["| text | method | best skip at <= 1% (sweep) | best skip at <= 3% (sweep) | "
             "profiles (budget: skip, cost) |", "|---|---|---|---|---|"]
    for text in sorted({r["text"] for r in rows}):
        dense = next(r for r in rows if r["text"] == text and r["kind"] == "dense")
        for method in sorted({r["method"] for r in rows if r["kind"] != "dense"}):
            mine = [r for r in rows if r["text"] == text and r["method"] == method]
            if not mine:
                continue
            cost = lambda r: r["perplexity"] / dense["perplexity"] - 1  # noqa: E731
            best = []
            for budget in (0.01, 0.03):
                ok = [r["bytes_skipped"] for r in mine if r["kind"] != "profile"
                      and cost(r) <= budget]
                best.append(f"{max(ok):.1%}" if ok else "–")
            prof = ", ".join(f"{r['label']}: {r['bytes_skipped']:.1%}, {cost(r):+.2%}"
                             for r in mine if r["kind"] == "profile")
            lines.append(f"| {text} | {method} | {best[0]} | {best[1]} | {prof or '–'} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    from dejavu_jax.sparsity_profile import METHODS
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.frontier",
                           description=__doc__.split("\n")[0])
    p.add_argument("--model", type=cli.model_source, help="default: smollm2-135m")
    p.add_argument("--out", type=cli.output_dir, required=True,
                   help="folder for the frontier's JSON, table and profiles")
    p.add_argument("--methods", help="threshold methods, comma-separated: "
                   f"{', '.join(METHODS)} (default: all the model runs)")
    p.add_argument("--skips", type=cli.fractions, default=list(DEFAULT_SKIPS),
                   help="target skips of the sweep's points (default 0.1,...,0.5)")
    p.add_argument("--budgets", type=cli.fractions, default=[0.01, 0.03],
                   help="perplexity budgets of the profiles searched (default 0.01,0.03)")
    p.add_argument("--tokens", type=cli.positive_int, default=16384,
                   help="test tokens per text (default 16384)")
    p.add_argument("--python-tokens", type=cli.positive_int,
                   help="test tokens of the Python text (default: --tokens)")
    p.add_argument("--window", type=cli.positive_int, default=1024,
                   help="tokens per perplexity window (default 1024)")
    p.add_argument("--python", action="store_true",
                   help="also the standard library's test files, and its calibration "
                        "files in the calibration text (coder models)")
    p.add_argument("--calibration-tokens", type=cli.positive_int, default=2048,
                   help="tokens whose activations set the thresholds (default 2048)")
    p.add_argument("--search-tokens", type=cli.positive_int, default=4096,
                   help="tokens scored while a profile's levels are searched (default 4096)")
    p.add_argument("--rounds", type=cli.positive_int, default=2,
                   help="calibration and search rounds of each profile (train.profile's)")
    p.add_argument("--no-sweep", action="store_true",
                   help="profiles and dense only: no path or oracle points")
    p.add_argument("--no-profiles", action="store_true",
                   help="no profile searches: only the sweep's rows (and --profile files)")
    p.add_argument("--sweep-texts",
                   help="the texts of the path, oracle and predictor rows, comma-separated "
                        "(default: every test text)")
    p.add_argument("--oracle", action="store_true", help="oracle MLP top-k rows")
    p.add_argument("--predictors", type=cli.existing_dir, help="trained predictor rows")
    p.add_argument("--profile", type=cli.existing_path, action="append", default=[],
                   help="also score this profile file (repeatable)")
    p.add_argument("--batch-tokens", type=cli.positive_int, default=4096,
                   help="tokens per forward pass of the scoring (memory; default 4096)")
    p.add_argument("--rows", type=cli.positive_int, default=4,
                   help="calibration and search windows per forward pass (memory; default 4)")
    return p


def frontier_methods(config, text: str | None) -> list[str]:
    """The threshold methods of --methods, default every one the model runs (without a
    gated MLP only teal); one `error:` line for an unknown method or one the model cannot
    run."""
    from dejavu_jax.sparsity_profile import METHODS, ProfileError, method_sites
    if text is None:
        return [m for m in METHODS if config.gated_mlp or "gate" not in METHODS[m]]
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        cli.fail("--methods names no method")
    for m in methods:
        try:
            method_sites(config, m)
        except ProfileError as e:
            cli.fail(f"--methods: {e}")
    return methods


def percent_label(fraction: float) -> str:
    """A budget or target as a label: 0.01 -> "1%", 0.005 -> "0.5%"."""
    return f"{fraction * 100:.4g}%"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    names = {"wikitext2"} | ({"python"} if args.python else set())
    if args.sweep_texts and set(args.sweep_texts.split(",")) - names:
        cli.fail(f"--sweep-texts: the test texts are {', '.join(sorted(names))}")
    from dejavu_jax.checkpoint_files import CheckpointError
    from dejavu_jax.eval import common, provenance
    from dejavu_jax.eval.sparse_scoring import make_mode
    from dejavu_jax.fetch_model import resolve_model
    from dejavu_jax.loading import load_pretrained, read_config
    from dejavu_jax.params import with_gate_weights
    from dejavu_jax.sparsity_profile import ProfileError, load_profile, method_sites
    from dejavu_jax.tokenizer import leading_special_ids
    from dejavu_jax.train import profile as profile_mod
    from dejavu_jax.train.corpus import default_corpus, resolve_files
    from dejavu_jax.train.thresholds import thresholds_at
    try:
        source = resolve_model(args.model or "smollm2-135m")
        known = read_config(source)
    except (RuntimeError, CheckpointError) as e:  # a failed fetch, an unreadable config
        cli.fail(cli.first_line(e))
    methods = frontier_methods(known, args.methods)
    if args.window > known.max_positions:
        cli.fail(f"--window {args.window}: the model has {known.max_positions} positions")
    config, params = load_pretrained(source, dtype=jnp.float32)
    try:  # another model's profiles or predictors: refused before any scoring
        given_profiles = [(f, load_profile(f, config)) for f in args.profile]
    except ProfileError as e:
        cli.fail(f"--profile: {cli.first_line(e)}")
    predictors = (common.load_predictor_params(args.predictors, config) if args.predictors
                  else None)
    args.tokenizer = None
    tok = common.load_tokenizer_for(args, config, Path(source))
    texts = test_texts(tok, args)
    for name, ids in texts.items():
        common.check_ids(ids, config, f"the tokenized {name} text")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = Rows(args.out / "frontier.jsonl")
    meta = {**provenance.run_meta(), "model": config.name, "command": " ".join(sys.argv)}
    (args.out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    lead = leading_special_ids(tok)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    def dense_ppl(text):
        return next(r["perplexity"] for r in rows.rows
                    if r["kind"] == "dense" and r["text"] == text)

    sweep_texts = set(args.sweep_texts.split(",")) if args.sweep_texts else set(texts)

    def run(kind, method, label, mode, selector_params, extra=None, profile_path=None,
            model_params=None):
        for text, ids in texts.items():
            if kind in ("path", "oracle", "predictors") and text not in sweep_texts:
                continue
            if rows.has((kind, method, label, text)):
                continue
            start = time.perf_counter()
            r = score_row(config, mode, params if model_params is None else model_params,
                          selector_params, ids, args, lead)
            rows.add({"kind": kind, "method": method, "label": label, "text": text, **r,
                      **(extra or {})})
            log(f"{kind} {method} {label} {text}: ppl {r['perplexity']:.4f}, skip "
                f"{r['bytes_skipped']:.1%} ({time.perf_counter() - start:.0f} s)")
            if profile_path is not None:
                record_test(profile_path, text, r, dense_ppl(text))

    run("dense", "dense", "dense", make_mode(config, "dense"), None)
    files = resolve_files(default_corpus())
    if args.python:
        from dejavu_jax.eval import python_source
        files += python_source.stdlib_files("calibration")
    windows_for = lambda n: -(-n // ((256 - 1) * args.rows)) * args.rows  # noqa: E731
    n_calib, n_search = windows_for(args.calibration_tokens), windows_for(args.search_tokens)
    windows = profile_mod.text_windows(tok, files, 256, n_calib + n_search, 0,
                                       config.bos_token_id)
    stats_file = args.out / "calibration.npz"
    levels = profile_mod.DEFAULT_LEVELS
    # the gate site's weights come from the same windows and are kept with the stats
    if stats_file.is_file():
        stats = dict(np.load(stats_file))
        weights = stats.pop("gate_weights", None)
        weighted = with_gate_weights(params, weights)
    else:
        start = time.perf_counter()
        weighted = profile_mod.gate_weighted(
            config, params, windows[:n_calib], args.rows,
            ("gate",) if any("gate" in method_sites(config, m) for m in methods) else ())
        stats = profile_mod.calibrate(config, weighted, windows[:n_calib], levels, args.rows)
        extra = ({} if weighted.layers.gate_weight is None
                 else {"gate_weights": np.asarray(weighted.layers.gate_weight)})
        np.savez(stats_file, **stats, **extra)
        log(f"calibrated on {n_calib} windows in {time.perf_counter() - start:.0f} s")
    if args.oracle and not args.no_sweep:
        for target in args.skips:
            density = oracle_density(config, target)
            run("oracle", "oracle-mlp", percent_label(target),
                make_mode(config, "oracle", density, 1.0, dense_layers=0), None,
                {"mlp_density": density})
    for method in methods:
        sites = method_sites(config, method)
        mode = make_mode(config, "threshold", sites=sites)
        searched = {}
        for budget in [] if args.no_profiles else args.budgets:
            label = percent_label(budget)
            path = args.out / "profiles" / f"{registry_name(config.name)}-{method}-{label}.json"
            if path.is_file():
                prof = load_profile(path, config)
            else:
                prof = profile_mod.make_profile(
                    config, weighted, windows[:n_calib], windows[n_calib:], method, budget,
                    levels, args.rows, log=log, stats=stats, measured=searched,
                    rounds=args.rounds)
                prof.calibration.update(corpus=[str(f) for f in files], seed=0,
                                        source=str(source))
                prof.save(path)
            run("profile", method, label, mode, jnp.asarray(prof.threshold_array()),
                {"search_ppl_cost": prof.measured.get("ppl_cost"),
                 "search_bytes_skipped": prof.measured.get("bytes_skipped")}, path,
                prof.weighted_params(params))
        if args.no_sweep:
            continue
        for target, lv, predicted in path_points(config, sites, stats, levels, args.skips):
            th = jnp.asarray(thresholds_at(stats["quantiles"], lv))
            run("path", method, percent_label(target), mode, th, {"predicted_skip": predicted},
                model_params=weighted)
    for profile_file, prof in given_profiles:
        mode = make_mode(config, "threshold", sites=prof.sites)
        run("profile", prof.method, Path(profile_file).stem, mode,
            jnp.asarray(prof.threshold_array()), profile_path=Path(profile_file),
            model_params=prof.weighted_params(params))
    if predictors is not None:
        pred = predictors
        for target in args.skips:
            density = oracle_density(config, target)
            run("predictors", "dejavu-predictors", percent_label(target),
                make_mode(config, "sparse", density, 1.0, dense_layers=0), pred,
                {"mlp_density": density})
    for r in rows.rows:  # also rows of earlier runs of this OUT
        path = (args.out / "profiles"
                / f"{registry_name(config.name)}-{r['method']}-{r['label']}.json")
        if r["kind"] == "profile" and path.is_file():
            record_test(path, r["text"], r, dense_ppl(r["text"]))
    plot(rows.rows, args.out / "frontier.png", config.name)
    (args.out / "table.md").write_text(table(rows.rows) + "\n")
    print(table(rows.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
