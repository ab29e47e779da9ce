"""Where a sparsity profile's perplexity cost comes from, on one text.

    python -m dejavu_jax.eval.profile_ablation --model gemma3-270m --profile FILE --out DIR

Scores the text dense, under the whole profile, then with each threshold site and each
layer left dense in turn (their thresholds 0), all on the same tokens. Each row gives the
perplexity cost against dense and the decoder bytes skipped. The profile's cost is also
split over tokens (how much of the NLL increase the worst 1% and 10% of the tokens carry)
and over the text's two halves, which shows how far a cost measured on this many tokens
moves from text to text. Rows go to OUT/ablation.jsonl, a table to OUT/ablation.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli


def token_cost_split(dense_nll: np.ndarray, sparse_nll: np.ndarray, worst: int = 20) -> dict:
    """The profile's NLL increase per token, summarised: the mean increase, the share of
    the total increase carried by the worst 1% and 10% of the tokens, the perplexity
    cost of each half of the text, and the `worst` targets' text positions (target i + 1
    at i) with their increases."""
    delta = sparse_nll - dense_nll
    total = float(delta.sum())
    order = np.argsort(-delta, kind="stable")
    n = len(delta)

    def share(frac):
        k = max(1, int(round(n * frac)))
        return float(delta[order[:k]].sum() / total) if total > 0 else None

    half = n // 2
    halves = [float(np.exp(delta[s].mean()) - 1) for s in (slice(0, half), slice(half, n))]
    return {"mean_nll_increase": total / n, "worst_1pct_share": share(0.01),
            "worst_10pct_share": share(0.10), "half_costs": halves,
            "worst_targets": [[int(i), float(delta[i])] for i in order[:worst]]}


def ablation_rows(config, params, ids, thresholds: np.ndarray, sites, window: int,
                  batch_tokens: int, log=print, show_progress: bool = False,
                  lead=()) -> list[dict]:
    """Rows: dense, the whole profile, then each site and each layer left dense (`lead`:
    the ids before every window, `eval.perplexity.score_windows`)."""
    from dejavu_jax.eval.common import progress
    from dejavu_jax.eval.perplexity import score_windows
    from dejavu_jax.eval.sparse_scoring import make_mode
    mode = make_mode(config, "threshold", sites=tuple(sites))
    jobs = [("dense", "dense", None), ("profile", "all sites", thresholds)]
    for s, site in enumerate(sites):
        th = thresholds.copy()
        th[:, s] = 0
        jobs.append(("site dense", site, th))
    for layer in range(thresholds.shape[0]):
        th = thresholds.copy()
        th[layer] = 0
        jobs.append(("layer dense", str(layer), th))
    rows, scored = [], {}
    for kind, name, th in progress(jobs, len(jobs), "profile ablation", not show_progress):
        per_token = kind in ("dense", "profile")
        r = score_windows(config, make_mode(config, "dense") if th is None else mode, params,
                          None if th is None else jnp.asarray(th), ids, window, window,
                          batch_tokens, token_nll=per_token, lead=lead)
        scored[kind] = r
        extra = (token_cost_split(scored["dense"]["token_nll"], r["token_nll"])
                 if kind == "profile" else {})
        rows.append({"kind": kind, "name": name, "tokens": r["tokens"],
                     "perplexity": r["perplexity"],
                     "cost": r["perplexity"] / scored["dense"]["perplexity"] - 1,
                     "bytes_skipped": r.get("bytes_skipped", 0.0), **extra})
        log(json.dumps(rows[-1]))
    return rows


def worst_token_lines(full: dict, ids: np.ndarray, decode) -> list[str]:
    """Markdown lines: each worst target in its context (`decode(ids) -> str`)."""
    lines = ["| NLL increase | context → target |", "|---|---|"]
    for i, inc in full["worst_targets"]:
        before = decode(ids[max(0, i - 7):i + 1]).replace("|", "\\|").replace("\n", "⏎")
        target = decode(ids[i + 1:i + 2]).replace("|", "\\|").replace("\n", "⏎")
        lines.append(f"| {inc:+.2f} | `{before}` → `{target}` |")
    return lines


def markdown(rows: list[dict], extra: list[str] = ()) -> str:
    """The rows as a markdown table, then `extra` lines."""
    lines = ["| rows | left dense | perplexity | cost | skipped |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['name']} | {r['perplexity']:.4f} | "
                     f"{r['cost']:+.2%} | {r['bytes_skipped']:.1%} |")
    full = next(r for r in rows if r["kind"] == "profile")
    lines += ["", f"Worst 1% of tokens: {full['worst_1pct_share']:.0%} of the NLL increase; "
              f"worst 10%: {full['worst_10pct_share']:.0%}. Cost on the text's halves: "
              + ", ".join(f"{c:+.2%}" for c in full["half_costs"]) + ".", "", *extra]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    from dejavu_jax.eval.perplexity import text_source
    p = argparse.ArgumentParser(prog="python -m dejavu_jax.eval.profile_ablation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="a fetchable model's name, a checkpoint folder or a .gguf file")
    p.add_argument("--profile", required=True, help="sparsity profile file")
    p.add_argument("--text", type=text_source, default=None,
                   help="text file or hf:NAME[:CONFIG[:SPLIT]] to score (default: "
                        "WikiText-2 test)")
    p.add_argument("--tokens", type=cli.positive_int, default=4096)
    p.add_argument("--window", type=cli.positive_int, default=1024)
    p.add_argument("--batch-tokens", type=cli.positive_int, default=4096)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    if not Path(args.profile).is_file():
        cli.fail(f"{args.profile}: no such profile file")
    from dejavu_jax.eval import common, provenance
    from dejavu_jax.eval.perplexity import load_text
    from dejavu_jax.fetch_model import resolve_model
    from dejavu_jax.loading import load_pretrained
    from dejavu_jax.sparsity_profile import ProfileError, load_profile
    from dejavu_jax.tokenizer import leading_special_ids
    source = resolve_model(args.model)
    config, params = load_pretrained(source, dtype=jnp.float32)
    try:
        prof = load_profile(args.profile, config)
    except (ProfileError, OSError) as e:
        cli.fail(str(e))
    args.tokenizer = None
    tok = common.load_tokenizer_for(args, config, Path(source))
    ids = np.asarray(tok(load_text(args.text), add_special_tokens=False)["input_ids"]
                     [:args.tokens], np.int32)
    common.check_ids(ids, config, "text")
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    rows = ablation_rows(config, prof.weighted_params(params), ids,
                         np.asarray(prof.threshold_array()),
                         prof.sites, args.window, args.batch_tokens, log,
                         show_progress=not args.no_progress,
                         lead=leading_special_ids(tok))
    meta = {**provenance.run_meta(), "model": config.name, "profile": str(args.profile),
            "command": " ".join(sys.argv)}
    (args.out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    with open(args.out / "ablation.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    full = next(r for r in rows if r["kind"] == "profile")
    text = markdown(rows, worst_token_lines(full, ids, lambda t: tok.decode(list(map(int, t)))))
    (args.out / "ablation.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
