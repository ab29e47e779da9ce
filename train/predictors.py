"""Train every layer's neuron and head predictors from recorded activations.

  python -m dejavu_jax.train.predictors --records .cache/records/opt-tiny \\
      --out .cache/predictors/opt-tiny

All layers train together: one jitted step vmaps the per-layer weighted-BCE loss over
the stacked predictors, and AdamW updates them. After each epoch the validation recall
at the evaluation k is measured per layer; each layer keeps its best weights (so a
layer that has converged is not spoiled by further epochs) and training stops when
every layer reaches --stop-recall, after --patience epochs without improvement, or at
--epochs. The result is an orbax checkpoint plus manifest.json with per-layer metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from dejavu_jax import cli
from dejavu_jax.train import data as data_lib
from dejavu_jax.train import metrics as metrics_lib
from dejavu_jax.train import records as rec
from dejavu_jax.train.checkpoint import save_predictors
from dejavu_jax.train.predictor_model import (ACTIVATIONS, Predictor, PredictorParams,
                                              all_layer_logits, init_predictor, input_stats,
                                              layer_slice, predictor_logits)

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of predictor training (defaults follow the paper where it has one)."""

    rank: int = 1000            # r; capped at d (no gain above d without a nonlinearity)
    activation: str = "none"    # between the two layers: none (official), relu, gelu
    lookahead: bool = True
    head_rule: str = "top:0.3"
    epochs: int = 20
    batch_size: int = 1024
    lr: float = 1e-3
    weight_decay: float = 1e-2
    max_pos_weight: float = 20.0  # cap on the BCE weight of positives (neg/pos ratio)
    stop_recall: float = 0.99
    patience: int = 3
    val_fraction: float = 0.1
    max_val_tokens: int = 4096
    k_mlp: int | None = None    # evaluation k; default 1.5x the mean number of actives
    k_heads: int | None = None
    seed: int = 0


def effective_rank(tc: TrainConfig, d: int) -> int:
    """r actually used: the requested rank, at most d."""
    return max(1, min(tc.rank, d))


def weighted_bce(logits: jax.Array, labels: jax.Array, pos_weight: jax.Array) -> jax.Array:
    """Mean of -[w y log σ(s) + (1-y) log σ(-s)], w = pos_weight."""
    y = labels.astype(F32)
    return -jnp.mean(pos_weight * y * jax.nn.log_sigmoid(logits)
                     + (1 - y) * jax.nn.log_sigmoid(-logits))


def unpack_mlp_labels(packed: jax.Array, ffn: int) -> jax.Array:
    """uint8 [..., ceil(F/8)] -> bool [..., F] (inside jit)."""
    return jnp.unpackbits(packed, axis=-1, count=ffn, bitorder="little").astype(bool)


def loss_fn(params: PredictorParams, x_mlp, x_heads, mlp_packed, head_norm, pos_weight,
            ffn: int, head_rule: rec.LabelRule):
    """Sum over layers of the MLP and head losses; also returns both per-layer [L]."""

    def layer(p_mlp, p_heads, xm, xh, packed, norms, w_mlp, w_heads):
        y_mlp = unpack_mlp_labels(packed, ffn)
        y_heads = rec.apply_rule(head_rule, norms.astype(F32))
        lm = weighted_bce(predictor_logits(p_mlp, xm, params.activation), y_mlp, w_mlp)
        lh = weighted_bce(predictor_logits(p_heads, xh, params.activation), y_heads, w_heads)
        return lm, lh

    lm, lh = jax.vmap(layer)(params.mlp, params.heads, x_mlp, x_heads, mlp_packed, head_norm,
                             pos_weight[0], pos_weight[1])
    return jnp.sum(lm + lh), (lm, lh)


def make_optimizer(tc: TrainConfig, params: PredictorParams) -> optax.GradientTransformation:
    """AdamW on w1, w2, b2 (weight decay on w1, w2 only); input statistics frozen."""
    kind = Predictor(mean="freeze", inv_std="freeze", w1="decay", w2="decay", b2="train")
    labels = PredictorParams(mlp=kind, heads=kind, activation=params.activation)
    adam = lambda wd: optax.adamw(tc.lr, weight_decay=wd)  # noqa: E731
    return optax.multi_transform({"decay": adam(tc.weight_decay), "train": adam(0.0),
                                  "freeze": optax.set_to_zero()}, labels)


def make_train_step(optimizer, ffn: int, head_rule: rec.LabelRule):
    """The jitted step (params, opt_state, batch arrays, pos_weight) -> (params, state, losses)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x_mlp, x_heads, mlp_packed, head_norm, pos_weight):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (lm, lh)), grads = grad_fn(params, x_mlp, x_heads, mlp_packed, head_norm,
                                          pos_weight, ffn, head_rule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, (loss, lm, lh)

    return step


@functools.partial(jax.jit, static_argnames=("ffn", "head_rule", "k_mlp", "k_heads"))
def _val_hits(params, x_mlp, x_heads, mlp_packed, head_norm, ffn, head_rule, k_mlp, k_heads):
    s_mlp = all_layer_logits(params.mlp, x_mlp, params.activation)
    s_heads = all_layer_logits(params.heads, x_heads, params.activation)
    y_mlp = unpack_mlp_labels(mlp_packed, ffn)
    y_heads = rec.apply_rule(head_rule, head_norm.astype(F32))
    hm = jax.vmap(lambda s, y: metrics_lib.hits_at_k(s, y, k_mlp))(s_mlp, y_mlp)
    hh = jax.vmap(lambda s, y: metrics_lib.hits_at_k(s, y, k_heads))(s_heads, y_heads)
    return hm, hh


def validation_recall(params, val: data_lib.Batch, ffn, head_rule, k_mlp, k_heads,
                      chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer recall@k [L] of the MLP and head predictors on the validation set."""
    x_mlp = data_lib.mlp_inputs(val)
    tot = np.zeros((2, 2, x_mlp.shape[0]))
    for s in range(0, x_mlp.shape[1], chunk):
        sl = slice(s, s + chunk)
        hm, hh = _val_hits(params, x_mlp[:, sl], val.x_heads[:, sl], val.mlp_label[:, sl],
                           val.head_norm[:, sl], ffn, head_rule, k_mlp, k_heads)
        tot[0] += np.asarray(hm)
        tot[1] += np.asarray(hh)
    recall = tot[:, 0] / np.maximum(tot[:, 1], 1)
    return recall[0], recall[1]


def select_layers(better: np.ndarray, new: Predictor, old: Predictor) -> Predictor:
    """Per layer, the new predictor where `better` [L] is set, else the old one."""
    b = jnp.asarray(better)
    return jax.tree.map(lambda n, o: jnp.where(b.reshape(-1, *[1] * (n.ndim - 1)), n, o),
                        new, old)


def initial_params(records: rec.Records, tc: TrainConfig, head_rule: rec.LabelRule,
                   rng: np.random.Generator):
    """(params, pos_weight [2, L], mean actives (mlp, heads)) from a training sample."""
    L, d, F, H = records.n_layers, records.hidden, records.ffn, records.n_heads
    sample = data_lib.sample_train(records, 4096, tc.lookahead, tc.val_fraction, rng)
    y_mlp = rec.unpack_labels(sample.mlp_label, F)
    y_heads = np.asarray(rec.apply_rule(head_rule, sample.head_norm.astype(np.float32)))
    r = effective_rank(tc, d)
    key_m, key_h = jax.random.split(jax.random.key(tc.seed))
    mean_m, inv_m = input_stats(data_lib.mlp_inputs(sample))
    mean_h, inv_h = input_stats(sample.x_heads)
    params = PredictorParams(
        mlp=init_predictor(key_m, L, d, r, F, mean_m, inv_m, y_mlp.mean(axis=1)),
        heads=init_predictor(key_h, L, d, r, H, mean_h, inv_h, y_heads.mean(axis=1)),
        activation=tc.activation)

    def pos_weight(y):
        p = np.clip(y.mean(axis=(1, 2)), 1e-6, 1.0)
        return np.clip((1 - p) / p, 1.0, tc.max_pos_weight)

    weights = np.stack([pos_weight(y_mlp), pos_weight(y_heads)]).astype(np.float32)
    actives = (float(y_mlp.sum(-1).mean()), float(y_heads.sum(-1).mean()))
    return params, weights, actives


def check_k(tc: TrainConfig, ffn: int, n_heads: int) -> None:
    """ValueError when an evaluation k asks for more units than a layer has."""
    for flag, k, n, what in (("--k-mlp", tc.k_mlp, ffn, "MLP neurons"),
                             ("--k-heads", tc.k_heads, n_heads, "query heads")):
        if k is not None and k > n:
            raise ValueError(f"{flag} {k}: the model's layers have {n} {what}")


def train(records: rec.Records, tc: TrainConfig, progress: bool = True, log=print):
    """Train predictors on `records`; returns (best params, training summary dict, the
    validation set they were scored on). ValueError when a step's loss is not finite
    (records holding NaN or inf)."""
    if tc.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {tc.activation!r}; known: {ACTIVATIONS}")
    head_rule = rec.LabelRule.parse(tc.head_rule)
    F, H = records.ffn, records.n_heads
    check_k(tc, F, H)
    train_tokens = [data_lib.split_tokens(records, s, tc.val_fraction)[0]
                    for s in range(len(records.shards))]
    if train_tokens[0] == 0:  # the first shard gives the input statistics
        raise rec.RecordsError(
            f"{records.root}: its first shard has {records.manifest['shards'][0]['tokens']} "
            f"tokens, all of them held out for validation (--val-fraction "
            f"{tc.val_fraction}); collect more windows per shard (train.collect --tokens, "
            "--shard-tokens)")
    rng = np.random.default_rng(tc.seed)
    params, pos_weight, actives = initial_params(records, tc, head_rule, rng)
    if actives[0] == 0:
        rule = records.manifest.get("label_rules", {}).get("mlp")
        raise rec.RecordsError(f"{records.root}: no MLP neuron is labelled active in the "
                               f"training sample (label rule {rule}); collect again with "
                               "another --mlp-rule")
    if actives[1] == 0:
        raise ValueError(f"--head-rule {tc.head_rule} labels no query head active in the "
                         "training sample; choose a lower threshold or a top:FRACTION rule")
    k_mlp = min(F, tc.k_mlp or math.ceil(1.5 * actives[0]))
    k_heads = min(H, tc.k_heads or math.ceil(1.5 * actives[1]))
    val = data_lib.validation_set(records, tc.lookahead, tc.val_fraction, tc.max_val_tokens)
    optimizer = make_optimizer(tc, params)
    opt_state = optimizer.init(params)
    step = make_train_step(optimizer, F, head_rule)
    pw = jnp.asarray(pos_weight)
    best = jax.tree.map(jnp.copy, params)  # the step donates `params`
    best_recall = [np.full(records.n_layers, -1.0), np.full(records.n_layers, -1.0)]
    history, stale, stop_reason = [], 0, f"reached --epochs {tc.epochs}"
    n_train = sum(train_tokens)
    steps_per_epoch = sum(n // tc.batch_size for n in train_tokens)
    if steps_per_epoch == 0:
        raise rec.RecordsError(f"{records.root}: fewer training tokens per shard than "
                               f"--batch-size {tc.batch_size}")
    log(f"training {records.n_layers} layers x (mlp {F}, heads {H}) predictors, "
        f"r={effective_rank(tc, records.hidden)}, {n_train} train / {val.x_heads.shape[1]} "
        f"val tokens, eval k: mlp {k_mlp}, heads {k_heads}")
    train_seconds, trained_tokens, wall = 0.0, 0, time.perf_counter()
    for epoch in range(tc.epochs):
        bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}", disable=not progress,
                   unit="step")
        losses = []
        for b in data_lib.train_batches(records, tc.batch_size, tc.lookahead,
                                        tc.val_fraction, rng):
            t0 = time.perf_counter()
            params, opt_state, (loss, lm, lh) = step(
                params, opt_state, data_lib.mlp_inputs(b), b.x_heads, b.mlp_label,
                b.head_norm, pw)
            loss = float(loss)
            if not math.isfinite(loss):  # NaN weights would be saved with NaN metrics
                raise ValueError(f"{records.root}: the training loss is not finite ({loss}) "
                                 f"in epoch {epoch + 1}: the records hold NaN or inf values "
                                 "(record them again), or --lr is too large")
            if losses or epoch:  # the first step compiles; keep it out of the throughput
                train_seconds += time.perf_counter() - t0
                trained_tokens += tc.batch_size
            losses.append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        bar.close()
        r_mlp, r_heads = validation_recall(params, val, F, head_rule, k_mlp, k_heads)
        improved = [r_mlp > best_recall[0] + 1e-4, r_heads > best_recall[1] + 1e-4]
        best = dataclasses.replace(best, mlp=select_layers(improved[0], params.mlp, best.mlp),
                                   heads=select_layers(improved[1], params.heads, best.heads))
        best_recall = [np.maximum(best_recall[0], r_mlp), np.maximum(best_recall[1], r_heads)]
        history.append({"epoch": epoch + 1, "train_loss": float(np.mean(losses)),
                        "val_recall_mlp": float(r_mlp.mean()),
                        "val_recall_heads": float(r_heads.mean()),
                        "val_recall_min": float(min(r_mlp.min(), r_heads.min()))})
        log(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}, val recall@k mlp "
            f"{r_mlp.mean():.4f} (min {r_mlp.min():.4f}), heads {r_heads.mean():.4f} "
            f"(min {r_heads.min():.4f})")
        stale = 0 if (improved[0].any() or improved[1].any()) else stale + 1
        if min(best_recall[0].min(), best_recall[1].min()) > tc.stop_recall:
            stop_reason = f"every layer reached recall > {tc.stop_recall}"
            break
        if stale >= tc.patience:
            stop_reason = f"no layer improved for {tc.patience} epochs"
            break
    wall = time.perf_counter() - wall
    summary = {"history": history, "stop_reason": stop_reason, "epochs_run": len(history),
               "k_mlp": k_mlp, "k_heads": k_heads, "pos_weight": pos_weight.tolist(),
               "mean_active": {"mlp": actives[0], "heads": actives[1]},
               "train_tokens_per_epoch": n_train,
               "throughput": {"tokens": trained_tokens, "seconds": round(train_seconds, 2),
                              "tokens_per_s": round(trained_tokens / max(train_seconds, 1e-9),
                                                    1),
                              "backend": jax.default_backend(),
                              "note": "jitted steps after the first; data loading excluded",
                              "wall_seconds": round(wall, 2),
                              "wall_tokens_per_s": round(
                                  len(history) * n_train / max(wall, 1e-9), 1)}}
    return best, summary, val


@functools.partial(jax.jit, static_argnames=("ffn", "head_rule", "k_mlp", "k_heads",
                                             "group_size", "k_groups", "model_config"))
def _layer_eval(params, layer, x_mlp, x_heads, packed, norms, mlp_in, model_layers, *, ffn,
                head_rule, k_mlp, k_heads, group_size, k_groups, model_config):
    """One layer's metric arrays; `layer` is traced so all layers share one compilation."""
    p_mlp, p_heads = layer_slice(params.mlp, layer), layer_slice(params.heads, layer)
    s_mlp = predictor_logits(p_mlp, x_mlp, params.activation)
    s_heads = predictor_logits(p_heads, x_heads, params.activation)
    norms = norms.astype(F32)
    arrays = metrics_lib.layer_arrays(
        s_mlp, unpack_mlp_labels(packed, ffn), s_heads, rec.apply_rule(head_rule, norms),
        norms, k_mlp=k_mlp, k_heads=k_heads, group_size=group_size, k_groups=k_groups)
    if model_config is not None:
        arrays["mlp_captured"] = metrics_lib.mlp_captured(
            model_config, layer_slice(model_layers, layer), mlp_in, s_mlp, k_mlp)
    return arrays


def evaluate(params: PredictorParams, val: data_lib.Batch, records: rec.Records,
             head_rule: rec.LabelRule, k_mlp: int, k_heads: int, model=None,
             progress: bool = True) -> list[dict]:
    """Per-layer metrics (see metrics.py) on the validation set.

    model: optional (config, ModelParams) for the MLP output-capture measure.
    """
    L, F = records.n_layers, records.ffn
    g = records.n_heads // records.n_kv_heads
    k_groups = max(1, math.ceil(k_heads / g))
    x_mlp = data_lib.mlp_inputs(val)
    config, layers = (model[0], model[1].layers) if model is not None else (None, None)
    out = []
    for layer in tqdm(range(L), desc="metrics", disable=not progress):
        arrays = _layer_eval(params, jnp.int32(layer), x_mlp[layer], val.x_heads[layer],
                             val.mlp_label[layer], val.head_norm[layer],
                             None if config is None else val.mlp_in[layer], layers, ffn=F,
                             head_rule=head_rule, k_mlp=k_mlp, k_heads=k_heads, group_size=g,
                             k_groups=k_groups, model_config=config)
        captured = arrays.pop("mlp_captured", None)
        report = metrics_lib.layer_report(arrays, k_mlp=k_mlp, k_heads=k_heads, group_size=g,
                                          k_groups=k_groups, n_tokens=x_mlp.shape[1],
                                          captured=captured)
        out.append({"layer": layer, **report})
    return out


def recommended(per_layer: list[dict], gqa: bool) -> dict:
    """Per-layer recommended k lists, keyed by recall target; heads count query heads (the
    unit the sparse step selects, also for GQA; the group report stays per layer)."""
    targets = per_layer[0]["mlp"]["recommended_k"].keys()
    return {"mlp": {t: [m["mlp"]["recommended_k"][t] for m in per_layer] for t in targets},
            "heads": {t: [m["heads"]["recommended_k"][t] for m in per_layer]
                      for t in targets},
            "heads_unit": "query_heads"}


def build_manifest(records: rec.Records, tc: TrainConfig, summary: dict,
                   per_layer: list[dict]) -> dict:
    """The predictor manifest: provenance, settings, training summary and metrics."""
    rm = records.manifest
    gqa = records.n_kv_heads != records.n_heads
    src = "attn_in[l-1] (layer 0: attn_in[0])" if tc.lookahead else None
    return {
        "model": rm["model"], "config_fingerprint": rm["config_fingerprint"],
        "model_source": rm["model_source"],
        "records": {"path": str(records.root), "tokens": rm["tokens"], "window": rm["window"],
                    "corpus": [c["path"] for c in rm["corpus"]], "mlp_rule": rm["label_rules"]
                    ["mlp"]},
        "rank": effective_rank(tc, records.hidden), "activation": tc.activation,
        "lookahead": tc.lookahead,
        "inputs": {"mlp": src or "mlp_in[l]", "heads": src or "attn_in[l]",
                   "note": "residual stream before the norm; any scale (inputs are "
                           "RMS-normalised inside the predictor)"},
        "head_rule": tc.head_rule,
        "train_config": dataclasses.asdict(tc),
        "training": summary,
        "eval_k": {"mlp": summary["k_mlp"], "heads": summary["k_heads"],
                   "groups": per_layer[0].get("groups", {}).get("k")},
        "recommended_k": recommended(per_layer, gqa),
        "per_layer": per_layer,
        "summary": summarise(per_layer),
    }


def summarise(per_layer: list[dict]) -> dict:
    """Means over layers of the headline metrics."""
    def mean(kind, key):
        vals = [m[kind][key] for m in per_layer if kind in m and key in m[kind]]
        return round(float(np.mean(vals)), 4) if vals else None

    return {f"{kind}_{key}": mean(kind, key)
            for kind, keys in (("mlp", ("recall", "precision", "output_captured")),
                               ("heads", ("recall", "precision", "norm_captured")),
                               ("groups", ("recall", "norm_captured")))
            for key in keys if mean(kind, key) is not None}


def format_summary(summary: dict) -> str:
    """`summarise`'s means as text: a heading, then one `key: value` line each."""
    width = max(map(len, summary), default=0)
    return "\n".join(["summary (means over layers):"]
                     + [f"  {key + ':':{width + 1}} {value}" for key, value in summary.items()])


def format_table(per_layer: list[dict]) -> str:
    """A per-layer text table of the manifest's metrics."""
    gqa = "groups" in per_layer[0]
    head = "layer  mlp_rec  mlp_prec  mlp_capt  k95_mlp | head_rec  head_prec  norm_capt"
    head += "  grp_rec  k95_grp" if gqa else "  k95_head"
    rows = [head]
    for m in per_layer:
        mm, hh = m["mlp"], m["heads"]
        cap = mm.get("output_captured")
        row = (f"{m['layer']:5d}  {mm['recall']:.4f}   {mm['precision']:.4f}    "
               f"{'  n/a ' if cap is None else f'{cap:.4f}'}   {mm['recommended_k']['0.95']:6d}"
               f" | {hh['recall']:.4f}    {hh['precision']:.4f}     {hh['norm_captured']:.4f}")
        if gqa:
            row += f"    {m['groups']['recall']:.4f}   {m['groups']['recommended_k']['0.95']:6d}"
        else:
            row += f"    {hh['recommended_k']['0.95']:6d}"
        rows.append(row)
    return "\n".join(rows)


def _head_rule(text: str) -> str:
    try:
        rec.LabelRule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _open_fraction(text: str) -> float:
    value = cli.fraction(text)
    if value == 1:
        raise argparse.ArgumentTypeError("must be in (0, 1), got 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    d = TrainConfig()
    p = cli.ArgumentParser(prog="python -m dejavu_jax.train.predictors", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", required=True, type=cli.existing_dir,
                   help="records folder from train.collect")
    p.add_argument("--out", required=True, help="predictor folder to write")
    p.add_argument("--rank", type=cli.positive_int, default=d.rank,
                   help="r, capped at d (default: %(default)s)")
    p.add_argument("--activation", choices=ACTIVATIONS, default=d.activation,
                   help="the predictors' hidden activation (default: %(default)s)")
    p.add_argument("--same-layer", action="store_true",
                   help="predict from the layer's own inputs instead of lookahead")
    p.add_argument("--head-rule", type=_head_rule, default=d.head_rule,
                   help="head label rule: 'top:FRACTION' or 'threshold:NORM' "
                        "(default: %(default)s)")
    p.add_argument("--epochs", type=cli.positive_int, default=d.epochs,
                   help="most passes over the records (default: %(default)s)")
    p.add_argument("--batch-size", type=cli.positive_int, default=d.batch_size,
                   help="tokens per step (default: %(default)s)")
    p.add_argument("--lr", type=cli.positive_float, default=d.lr,
                   help="learning rate (default: %(default)s)")
    p.add_argument("--weight-decay", type=cli.non_negative_float, default=d.weight_decay,
                   help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--stop-recall", type=cli.fraction, default=d.stop_recall,
                   help="stop once every layer's validation recall exceeds this "
                        "(default: %(default)s)")
    p.add_argument("--patience", type=cli.positive_int, default=d.patience,
                   help="epochs without improvement before stopping (default: %(default)s)")
    p.add_argument("--val-fraction", type=_open_fraction, default=d.val_fraction,
                   help="records held out for validation (default: %(default)s)")
    p.add_argument("--max-val-tokens", type=cli.positive_int, default=d.max_val_tokens,
                   help="validation tokens at most (default: %(default)s)")
    p.add_argument("--k-mlp", type=cli.positive_int, help="evaluation k for neurons "
                   "(default: 1.5x the mean number of active neurons)")
    p.add_argument("--k-heads", type=cli.positive_int, help="evaluation k for query heads "
                   "(default: 1.5x the mean active)")
    p.add_argument("--seed", type=cli.seed, default=d.seed,
                   help="initialisation and batch-order seed (default: %(default)s)")
    p.add_argument("--no-output-metric", action="store_true",
                   help="skip the MLP output-capture metric (it loads the model weights)")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_out(out: Path) -> None:
    """One `error:` line unless `out` can take predictors: not a file, nor a records folder
    (its manifest.json would be replaced)."""
    if out.exists() and not out.is_dir():
        cli.fail(f"--out {out}: is a file; give a folder for the predictors")
    try:
        holds_records = "shards" in (rec.read_manifest(out) or {}) if out.is_dir() else False
    except rec.RecordsError:
        holds_records = False
    if holds_records:
        cli.fail(f"--out {out} holds records of train.collect, whose manifest.json the "
                 "predictors' would replace; give another folder")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with one `error:` line for bad
    arguments or records)."""
    from dejavu_jax.checkpoint_files import CheckpointError
    args = build_parser().parse_args(argv)
    check_out(Path(args.out).expanduser())
    tc = TrainConfig(rank=args.rank, activation=args.activation, lookahead=not args.same_layer,
                     head_rule=args.head_rule, epochs=args.epochs, batch_size=args.batch_size,
                     lr=args.lr, weight_decay=args.weight_decay, stop_recall=args.stop_recall,
                     patience=args.patience, val_fraction=args.val_fraction,
                     max_val_tokens=args.max_val_tokens, k_mlp=args.k_mlp,
                     k_heads=args.k_heads, seed=args.seed)
    progress = not args.no_progress
    err = lambda s: print(s, file=sys.stderr)  # noqa: E731
    try:
        records = rec.Records(args.records)
        source = records.manifest.get("model_source") or {}
        if not args.no_output_metric and source.get("path") and not Path(
                source["path"]).exists():
            cli.fail(f"{source['path']}: the records' model is not there (the MLP output "
                     "metric loads it); pass --no-output-metric to train without it")
        params, summary, val = train(records, tc, progress, log=err)
        model = None
        if not args.no_output_metric:
            from dejavu_jax.train.collect import ModelSource
            try:
                model = ModelSource(**records.manifest["model_source"]).load()
            except (CheckpointError, OSError, ValueError) as e:
                err(f"warning: the records' model did not load ({cli.first_line(e)}); "
                    "skipping output metric")
            if model is not None and not model[0].fits_fingerprint(
                    records.manifest["config_fingerprint"]):
                err("warning: model weights do not match the records; skipping output metric")
                model = None
        per_layer = evaluate(params, val, records, rec.LabelRule.parse(tc.head_rule),
                             summary["k_mlp"], summary["k_heads"], model, progress)
        manifest = build_manifest(records, tc, summary, per_layer)
        save_predictors(args.out, params, manifest)
    except (rec.RecordsError, CheckpointError, OSError, ValueError) as e:
        cli.fail(str(e))
    print(format_table(per_layer))
    print(format_summary(manifest["summary"]))
    t = summary["throughput"]
    speed = (f"{t['tokens_per_s']} tokens/s" if t["tokens"] else
             f"{t['wall_tokens_per_s']} tokens/s wall (one step, which compiled)")
    print(f"stopped after {summary['epochs_run']} epochs ({summary['stop_reason']}); "
          f"training {speed}; saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
