"""How much of each layer's MLP output a neuron-scoring rule captures at equal k, against
the oracle: which rules a predictor of a gated MLP can hope to match.

    python -m dejavu_jax.eval.mlp_selection_ceiling --model smollm2-135m --out DIR

Per layer, over held-out tokens, each rule scores the F neurons and keeps its top k; the
figure is `train.metrics.mlp_captured`'s mean 1 - ||y - y_S|| / ||y|| (y the MLP output,
y_S that of the kept neurons), divided by the oracle's at the same k. Rules:

  oracle         |act(g_i) u_i| ||down_i||: needs the whole gate and up products
  gate           |act(g_i)| ||down_i||: the exact gate, nothing of the up product
  gate-mean-up   |act(g_i)| E|u_i| ||down_i||, E|u_i| from calibration tokens
  gate-norms     |act(g_i)| ||up_i|| ||down_i||: the same from the weights alone
  gate-rR        gate-mean-up with g from the rank-R approximation of the gate product
                 that is best on the calibration tokens (their top R principal directions)
  gate-up-rR     |act(g_R) u_R| ||down_i||, both from one rank-R approximation of the
                 stacked gate and up products
A rank-R rule reads R (d + F) (gate) or R (d + 2F) (gate and up) weights per token:
`reads` is that as a fraction of the layer's three MLP matrices. The gate rule is the
ranking a linear predictor with full rank on the layer's own input can represent; the
trained predictors' figures are in their manifests (`train.predictors`).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dejavu_jax import cli

F32 = jnp.float32


def layer_inputs(config, params, windows: np.ndarray, batch: int) -> np.ndarray:
    """The residual stream entering each MLP block [L, n, T, d] (fp32) over windows [n, T]."""
    from dejavu_jax.model import sequence_forward

    @jax.jit
    def run(params, ids):
        return sequence_forward(config, params, ids, None, records=True)[2]["mlp_in"]

    parts = [np.asarray(run(params, jnp.asarray(windows[i:i + batch])))
             for i in range(0, len(windows), batch)]
    return np.concatenate(parts, axis=1).astype(np.float32)


def normalised(config, lp, x: np.ndarray) -> np.ndarray:
    """The MLP's input: the residual stream x [N, d] through the layer's MLP norm."""
    from dejavu_jax import ops
    if not config.pre_norm:
        return x
    return np.asarray(ops.norm(jnp.asarray(x), lp.mlp_norm_scale, lp.mlp_norm_bias,
                               config.norm_eps), np.float32)


def principal_basis(outputs: np.ndarray, rank: int) -> np.ndarray:
    """The top `rank` right singular vectors [n, rank] of calibration outputs [N, n], from
    the eigenvectors of the smaller of the two Gram matrices."""
    o = outputs.astype(np.float64)
    if o.shape[0] >= o.shape[1]:
        _, vecs = np.linalg.eigh(o.T @ o)
        return vecs[:, ::-1][:, :rank].astype(np.float32)
    vals, vecs = np.linalg.eigh(o @ o.T)
    vals, vecs = vals[::-1][:rank], vecs[:, ::-1][:, :rank]
    return (o.T @ vecs / np.sqrt(np.maximum(vals, 1e-30))).astype(np.float32)


def up_norms(lp) -> np.ndarray:
    """||up_i||: the norm of each neuron's up-projection weights [F]."""
    if lp.w_in is not None:
        return np.linalg.norm(np.asarray(lp.w_in, np.float32), axis=-1)
    return np.linalg.norm(np.asarray(lp.w_in_t, np.float32), axis=0)


def rule_scores(config, lp, x_cal: np.ndarray, x: np.ndarray, ranks: list[int]) -> dict:
    """Each rule's neuron scores [N, F] for one layer's MLP inputs x [N, d] (the residual
    stream; x_cal the calibration tokens'), see the module docstring."""
    from dejavu_jax import ops
    y_cal, y = normalised(config, lp, x_cal), normalised(config, lp, x)
    act = lambda g: np.asarray(ops.activation(config.activation, jnp.asarray(g)))  # noqa: E731
    down = np.linalg.norm(np.asarray(lp.w_out_t, np.float32), axis=-1)
    proj = lambda v, fn: np.asarray(fn(lp, jnp.asarray(v)), np.float32)  # noqa: E731
    g_cal, u_cal = proj(y_cal, ops.gate_projection), proj(y_cal, ops.up_projection)
    g, u = proj(y, ops.gate_projection), proj(y, ops.up_projection)
    if lp.b_in is not None:
        u_cal, u = u_cal + np.asarray(lp.b_in), u + np.asarray(lp.b_in)
    mean_up = np.abs(u_cal).mean(0)
    out = {"oracle": np.abs(act(g) * u) * down, "gate": np.abs(act(g)) * down,
           "gate-mean-up": np.abs(act(g)) * mean_up * down,
           "gate-norms": np.abs(act(g)) * up_norms(lp) * down}
    F = g.shape[-1]
    for r in ranks:
        basis = principal_basis(g_cal, r)
        out[f"gate-r{r}"] = np.abs(act(g @ basis @ basis.T)) * mean_up * down
        both = np.concatenate([g_cal, u_cal], -1)
        basis = principal_basis(both, r)
        gu = np.concatenate([g, u], -1) @ basis @ basis.T
        out[f"gate-up-r{r}"] = np.abs(act(gu[:, :F]) * gu[:, F:]) * down
    return out


def reads(config, rule: str) -> float:
    """The weights a rule reads per token, as a fraction of the layer's MLP matrices."""
    d, F = config.hidden, config.ffn
    if rule == "oracle":
        return 2 / 3
    if rule in ("gate", "gate-mean-up", "gate-norms"):
        return 1 / 3
    r = int(rule.rsplit("-r", 1)[1])
    return r * (d + (2 * F if rule.startswith("gate-up-") else F)) / (3 * d * F)


@functools.partial(jax.jit, static_argnames="k")
def captured_at_k(act: jax.Array, w_out_t: jax.Array, scores: jax.Array, k: int) -> jax.Array:
    """Mean 1 - ||y - y_S|| / ||y|| over tokens, y = act @ w_out_t and y_S the same with
    only each token's top-k neurons by `scores` (`train.metrics.mlp_captured`'s figure)."""
    from dejavu_jax.train.metrics import top_k_mask
    full = act @ w_out_t
    err = jnp.linalg.norm(full - (act * top_k_mask(scores, k)) @ w_out_t, axis=-1)
    return jnp.mean(1.0 - err / jnp.maximum(jnp.linalg.norm(full, axis=-1), 1e-12))


def study(config, params, x_cal: np.ndarray, x_test: np.ndarray, densities: list[float],
          ranks: list[int], progress: bool = True) -> list[dict]:
    """Rows {layer, density, rule, captured, ratio, reads} over every layer."""
    from dejavu_jax import ops
    rows = []
    for layer in tqdm(range(config.n_layers), desc="layers", disable=not progress):
        lp = jax.tree.map(lambda a: a[layer], params.layers)
        scores = rule_scores(config, lp, x_cal[layer], x_test[layer], ranks)
        act = ops.mlp_hidden(config, lp, jnp.asarray(normalised(config, lp, x_test[layer])))
        w = lp.w_out_t.astype(F32)
        for density in densities:
            k = max(1, round(density * config.ffn))
            captured = {rule: float(captured_at_k(act, w, jnp.asarray(s), k))
                        for rule, s in scores.items()}
            for rule, c in captured.items():
                rows.append(dict(layer=layer, density=density, k=k, rule=rule, captured=c,
                                 ratio=c / captured["oracle"], reads=reads(config, rule)))
    return rows


def summary(rows: list[dict]) -> str:
    """A markdown table: per density and rule, the mean and least ratio over layers."""
    lines = ["| density | rule | reads of the MLP | captured (mean) | ratio to oracle "
             "(mean) | least ratio (layer) | layers at >= 0.9 |", "|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["density"], r["rule"]) for r in rows)
    for density, rule in keys:
        sel = [r for r in rows if r["density"] == density and r["rule"] == rule]
        worst = min(sel, key=lambda r: r["ratio"])
        lines.append(f"| {density:g} | {rule} | {sel[0]['reads']:.1%} | "
                     f"{np.mean([r['captured'] for r in sel]):.3f} | "
                     f"{np.mean([r['ratio'] for r in sel]):.3f} | "
                     f"{worst['ratio']:.3f} (L{worst['layer']}) | "
                     f"{sum(r['ratio'] >= 0.9 for r in sel)}/{len(sel)} |")
    return "\n".join(lines) + "\n"


def build_parser():
    """The command line."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.mlp_selection_ceiling",
                           description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=cli.model_source, default="smollm2-135m",
                   help="checkpoint folder, .gguf file or fetchable model name")
    p.add_argument("--corpus", action="append", help="text file, folder or glob (repeat; "
                   "default: the data folder's corpus)")
    p.add_argument("--calibration-tokens", type=cli.positive_int, default=2048)
    p.add_argument("--tokens", type=cli.positive_int, default=2048,
                   help="held-out tokens the figures are measured on")
    p.add_argument("--window", type=cli.positive_int, default=256)
    p.add_argument("--densities", type=cli.fractions, default="0.3,0.45,0.6")
    p.add_argument("--ranks", default="64,128,256",
                   help="comma-separated ranks of the low-rank rules")
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        cli.fail(f"--ranks {args.ranks!r}: give comma-separated integers")
    if not ranks or min(ranks) < 1:
        cli.fail(f"--ranks {args.ranks!r}: ranks must be >= 1")
    from dejavu_jax.eval import common, provenance
    from dejavu_jax.fetch_model import resolve_model
    from dejavu_jax.loading import load_pretrained
    from dejavu_jax.train import corpus as corpus_lib
    try:
        files = corpus_lib.resolve_files(args.corpus or corpus_lib.default_corpus())
    except corpus_lib.CorpusError as e:
        cli.fail(str(e))
    from dejavu_jax.checkpoint_files import CheckpointError
    source = resolve_model(args.model)
    try:
        config, params = load_pretrained(source, dtype=F32, progress=not args.no_progress)
    except (CheckpointError, OSError) as e:
        cli.fail(str(e))
    if not config.gated_mlp:
        cli.fail(f"{config.name}: the MLP has no gate; the rules here score gated MLPs")
    if max(ranks) > config.hidden:
        cli.fail(f"--ranks: {max(ranks)} exceeds the model width {config.hidden}")
    args.tokenizer = None
    tok = common.load_tokenizer_for(args, config, Path(source))
    per = args.window - (config.bos_token_id is not None)
    if per < 1:
        cli.fail(f"--window {args.window}: a window needs at least one text token")
    need = -(-args.calibration_tokens // per) + -(-args.tokens // per)
    windows = []
    try:
        for w in corpus_lib.token_windows(tok, files, args.window, args.seed,
                                          config.bos_token_id):
            windows.append(w)
            if len(windows) == need:
                break
    except corpus_lib.CorpusError as e:
        cli.fail(str(e))
    if len(windows) < need:
        cli.fail(f"the corpus gave {len(windows)} windows of {args.window} tokens; "
                 f"{need} are needed")
    n_cal = -(-args.calibration_tokens // per)
    windows = np.stack(windows)
    x = layer_inputs(config, params, windows, batch=4)[:, :, int(config.bos_token_id is not None):]
    L, d = x.shape[0], x.shape[-1]
    x_cal = x[:, :n_cal].reshape(L, -1, d)[:, :args.calibration_tokens]
    x_test = x[:, n_cal:].reshape(L, -1, d)[:, :args.tokens]
    rows = study(config, params, x_cal, x_test, args.densities, ranks,
                 progress=not args.no_progress)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**provenance.run_meta(), "model": config.name, "command": " ".join(sys.argv),
            "calibration_tokens": args.calibration_tokens, "tokens": args.tokens}
    (args.out / "mlp_selection_ceiling.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    table = summary(rows)
    (args.out / "mlp_selection_ceiling.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
