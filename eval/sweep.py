"""Quality against sparsity: dense plus a grid of (MLP density, head density) per mode.

    python -m dejavu_jax.eval.sweep --out eval/results/cpu/smollm2-quality \
        --mlp 1.0,0.9,0.8,0.7,0.6,0.5 --heads 1.0,0.67 --modes sparse,oracle \
        --ppl-tokens 4096 --tasks all --limit 20

Writes sweep.json (every point, rewritten after each so a long run can be resumed with
--resume), sweep.md (a table) and sweep.png (perplexity and mean task accuracy against
total sparsity, one line per mode and head density, like the paper's Figure 6).
Total sparsity is the fraction of attention + MLP block weights a token does not read,
over all layers (dense layers count as read).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dejavu_jax import cli, sparse
from dejavu_jax.eval import common, perplexity as ppl_mod, tasks as tasks_mod
from dejavu_jax.eval.sparse_scoring import EvalMode, make_mode
from dejavu_jax.tokenizer import leading_special_ids


LABELS = {"dense": "dense", "sparse": "predictors", "oracle": "oracle top-k"}


def total_sparsity(config, mode: EvalMode) -> float:
    """Fraction of attention and MLP weights skipped per token, over all layers (heads are
    query heads; their groups' k/v rows counted as skipped in the same proportion)."""
    if mode.scfg is None:
        return 0.0
    mlp_w = (3 if config.gated_mlp else 2) * config.hidden * config.ffn
    attn_w = config.hidden * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
    skipped = sum((1 - km / config.ffn) * mlp_w + (1 - kh / config.n_heads) * attn_w
                  for km, kh in zip(mode.scfg.mlp_k, mode.scfg.head_k))
    return skipped / (config.n_layers * (mlp_w + attn_w))


def grid(mlp: list[float], heads: list[float], modes: list[str]) -> list[tuple[str, float, float]]:
    """Dense first, then every (mode, mlp, heads) point of the cartesian grid except
    (1.0, 1.0), which computes exactly the dense figures (tests/test_eval.py)."""
    points = [("dense", 1.0, 1.0)]
    for m in modes:
        points += [(m, a, h) for h in heads for a in mlp if (a, h) != (1.0, 1.0)]
    return points


def _key(p: dict) -> tuple:
    return (p["mode"], round(p["mlp_density_set"], 4), round(p["head_density_set"], 4))


def markdown(points: list[dict]) -> str:
    """A markdown table of the sweep."""
    task_names = sorted({t for p in points for t in p.get("tasks", {})})
    head = ["mode", "MLP dens.", "head dens.", "total sparsity", "perplexity", "Δppl %"]
    head += task_names + (["task mean"] if task_names else [])
    dense = next((p for p in points if p["mode"] == "dense"), None)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {"dense": 0, "sparse": 1, "oracle": 2}
    for p in sorted(points, key=lambda p: (order[p["mode"]], -p["head_density_set"],
                                           p["total_sparsity"])):
        ppl = p.get("perplexity")
        rel = (f"{100 * (ppl / dense['perplexity'] - 1):+.1f}" if ppl and dense
               and dense.get("perplexity") else "")
        row = [LABELS[p["mode"]], f"{p['mlp_density_set']:.2f}", f"{p['head_density_set']:.2f}",
               f"{p['total_sparsity']:.1%}", f"{ppl:.3f}" if ppl else "", rel]
        row += [f"{100 * p['tasks'][t]['acc']:.1f}" if t in p.get("tasks", {}) else ""
                for t in task_names]
        if task_names:
            row.append(f"{100 * p['task_mean']:.1f}" if "task_mean" in p else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path, title: str) -> None:
    """Perplexity and mean task accuracy against total sparsity, one line per series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    has_tasks = any("task_mean" in p for p in points)
    fig, axes = plt.subplots(1, 2 if has_tasks else 1, figsize=(11 if has_tasks else 6, 4.2),
                             squeeze=False)
    series: dict[str, list[dict]] = {}
    for p in points:
        if p["mode"] == "dense":
            continue
        label = LABELS[p["mode"]]
        series.setdefault(f"{label}, heads {p['head_density_set']:.2f}", []).append(p)
    dense = next((p for p in points if p["mode"] == "dense"), None)
    panels = [("perplexity", "WikiText-2 perplexity", False)]
    if has_tasks:
        panels.append(("task_mean", "mean zero-shot accuracy", False))
    for ax, (key, ylabel, log) in zip(axes[0], panels):
        for label, ps in sorted(series.items()):
            ps = sorted((p for p in ps if key in p), key=lambda p: p["total_sparsity"])
            if dense and key in dense:
                ps = [dense] + ps
            if ps:
                ax.plot([100 * p["total_sparsity"] for p in ps], [p[key] for p in ps],
                        marker="o", label=label)
        if dense and key in dense:
            ax.axhline(dense[key], color="gray", ls="--", lw=0.8, label="dense")
        ax.set_xlabel("total sparsity (% of attention + MLP weights skipped)")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resumed_points(path: Path, meta: dict) -> list[dict]:
    """The points of an earlier sweep.json to resume (none when it does not exist); a file
    made by another model or other settings (its `meta`) is refused, since its points
    would then be labelled with these."""
    if not path.exists():
        return []
    try:
        earlier = json.loads(path.read_text())
        points, old_meta = earlier["points"], earlier["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        cli.fail(f"--resume: {path} is not a sweep.json ({cli.first_line(e)})")
    differ = sorted(k for k in set(meta) | set(old_meta) if meta.get(k) != old_meta.get(k))
    if differ:
        cli.fail(f"--resume: {path} was made with other settings ("
                 + ", ".join(f"{k}: {old_meta.get(k)!r} there, {meta.get(k)!r} now"
                             for k in differ) + "); use another --out")
    return points


def write_outputs(points: list[dict], out: Path, title: str, meta: dict) -> None:
    """sweep.json, sweep.md and sweep.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    (out / "sweep.md").write_text(markdown(points))
    plot(points, out / "sweep.png", title)


def _mode(text: str) -> str:
    if text not in ("sparse", "oracle"):
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}: sparse (predictors) or "
                                         "oracle")
    return text


def modes_list(text: str) -> list[str]:
    """An argparse type: a comma list of sparse / oracle."""
    return [_mode(m) for m in text.split(",") if m]


def points_list(text: str) -> list[tuple[str, float, float]]:
    """An argparse type: explicit points 'mode:mlp:heads,...' (densities in (0, 1])."""
    out = []
    for part in text.split(","):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 3:
            raise argparse.ArgumentTypeError(f"{part!r}: mode:mlp:heads expected, e.g. "
                                             "sparse:0.5:1.0")
        out.append((_mode(fields[0]), cli.fraction(fields[1]), cli.fraction(fields[2])))
    return out


PPL_TOKENS = "N > 0 (the first N tokens), 0 (the whole text) or -1 (skip perplexity)"


def ppl_tokens(text: str) -> int:
    """An argparse type for --ppl-tokens: N > 0, 0 (the whole text) or -1 (skip)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{PPL_TOKENS} expected, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be {PPL_TOKENS}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.sweep",
                           description=__doc__.split("\n")[0])
    p.add_argument("--out", type=cli.output_dir, required=True, help="output folder")
    p.add_argument("--mlp", type=cli.fractions, default=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5],
                   help="MLP densities, a comma list (default 1.0,0.9,0.8,0.7,0.6,0.5)")
    p.add_argument("--heads", type=cli.fractions, default=[1.0],
                   help="query-head densities, a comma list (default 1.0)")
    p.add_argument("--modes", type=modes_list, default=["sparse", "oracle"],
                   help="sparse (predictors), oracle (default both)")
    p.add_argument("--points", type=points_list, default=[],
                   help="explicit extra points mode:mlp:heads,... (added)")
    p.add_argument("--text", type=ppl_mod.text_source,
                   help="perplexity text (default WikiText-2 test)")
    p.add_argument("--ppl-tokens", type=ppl_tokens, default=4096,
                   help="perplexity on the first N tokens (0: the whole text; -1: skip)")
    p.add_argument("--window", type=cli.positive_int, default=1024,
                   help="tokens per perplexity window (default 1024)")
    p.add_argument("--stride", type=cli.positive_int,
                   help="tokens between window starts, at most --window (default: --window)")
    p.add_argument("--tasks", default="", help="task names/paths (see eval.tasks), '' = none")
    p.add_argument("--limit", type=cli.positive_int, help="items per task")
    p.add_argument("--task-points", type=points_list, default=[],
                   help="only these points get tasks: mode:mlp:heads,...")
    p.add_argument("--resume", action="store_true", help="skip points already in sweep.json")
    common.add_model_args(p, mode=False)
    return p


def check_measures(args, points) -> None:
    """One `error:` line when the sweep would measure nothing (no perplexity, no tasks) or
    --task-points names a point without tasks or outside the sweep."""
    if args.ppl_tokens < 0 and not args.tasks:
        cli.fail("--ppl-tokens -1 skips perplexity and --tasks names no task: nothing to "
                 "measure")
    if args.task_points and not args.tasks:
        cli.fail("--task-points picks the points that get tasks, and --tasks names none")
    keys = {(m, round(a, 4), round(h, 4)) for m, a, h in points}
    outside = [f"{m}:{a}:{h}" for m, a, h in args.task_points
               if (m, round(a, 4), round(h, 4)) not in keys]
    if outside:
        cli.fail(f"--task-points {','.join(outside)}: not a point of the sweep (--mlp, "
                 "--heads, --modes, --points)")


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns the process exit status (2 with one `error:` line for bad
    arguments, files or data)."""
    args = build_parser().parse_args(argv)
    if args.stride is None:
        args.stride = args.window
    if args.stride > args.window:
        cli.fail(f"--stride {args.stride} is larger than --window {args.window}")
    out = Path(args.out)
    points = grid(args.mlp, args.heads, args.modes) + args.points
    common.check_model_args(args, {m for m, _, _ in points})
    check_measures(args, points)
    prepared_items = tasks_mod.load_tasks(tasks_mod.parse_tasks(args.tasks), args.limit) \
        if args.tasks else {}
    text = None
    if args.ppl_tokens >= 0:
        try:
            text = ppl_mod.load_text(args.text)
        except (OSError, UnicodeDecodeError) as e:
            cli.fail(str(e))
    config = common.model_config(args)
    if args.ppl_tokens >= 0 and args.window > config.max_positions:
        cli.fail(f"--window {args.window}: the model has {config.max_positions} positions")
    dense_layers = (sparse.default_dense_layers(config.n_layers) if args.dense_layers is None
                    else args.dense_layers)
    if dense_layers >= config.n_layers:
        cli.fail(f"--dense-layers {dense_layers}: the model has {config.n_layers} layers, so "
                 "none would run sparse")
    pred = (common.load_predictor_params(common.predictors_dir(args), config)
            if any(m == "sparse" for m, _, _ in points) else None)
    meta = {"model": config.name, "predictors": str(common.predictors_dir(args)),
            "ppl_tokens": args.ppl_tokens,
            "text": args.text or str(ppl_mod.wikitext2_path()), "window": args.window,
            "stride": args.stride, "tasks": list(prepared_items), "limit": args.limit,
            "dense_layers": dense_layers, "dense_prefix": args.dense_prefix}
    done = resumed_points(out / "sweep.json", meta) if args.resume else []
    config, params, tok = common.load_model(args)
    ids = None
    if text is not None:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = ids[:args.ppl_tokens] if args.ppl_tokens else ids
        if len(ids) < 2:
            cli.fail(f"the text has {len(ids)} token(s); perplexity needs at least 2")
        common.check_ids(ids, config, "the tokenized text")
        n_lead = len(leading_special_ids(tok))
        if min(args.window, len(ids) - 1) + n_lead > config.max_positions:
            cli.fail(f"--window {args.window} and {n_lead} leading id(s) pass the model's "
                     f"{config.max_positions} positions")
        for mode_name in {m for m, _, _ in points}:
            common.check_dense_prefix(args.dense_prefix, mode_name,
                                      min(args.window, len(ids) - 1), f"--window {args.window}")
    prepared = {name: (its, tasks_mod.encode_items(tok, its))
                for name, its in prepared_items.items()}
    task_points = {(m, round(a, 4), round(h, 4)) for m, a, h in args.task_points}
    seen = {_key(p) for p in done}
    for name, mlp, heads in points:
        key = (name, round(mlp, 4), round(heads, 4))
        if key in seen:
            continue
        seen.add(key)
        mode = make_mode(config, name, mlp, heads, dense_layers)
        rec = {"mode": name, "mlp_density_set": mlp, "head_density_set": heads,
               "total_sparsity": total_sparsity(config, mode), **mode.describe(config)}
        rec.pop("mode_name", None)
        if ids is not None:
            r = ppl_mod.perplexity(config, mode, params, pred, ids, args.window, args.stride,
                                   args.batch_tokens, args.dense_prefix, not args.no_progress,
                                   lead=leading_special_ids(tok))
            rec.update(perplexity=r["perplexity"], nll=r["nll"], ppl_tokens=r["tokens"],
                       ppl_seconds=r["seconds"])
        if prepared and (not task_points or key in task_points or name == "dense"):
            r = tasks_mod.evaluate(config, mode, params, pred, prepared, args.batch_tokens,
                                   args.dense_prefix, not args.no_progress)
            rec.update(tasks=r["tasks"], task_mean=r["mean_acc"], task_seconds=r["seconds"])
        done.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("mlp_k", "head_k")}),
              flush=True)
        write_outputs(done, out, f"{config.name}: quality vs sparsity", meta)
    write_outputs(done, out, f"{config.name}: quality vs sparsity", meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
