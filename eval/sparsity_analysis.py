"""Measuring contextual sparsity on a model's own activations (used by the notebook).

Everything here works on the per-layer records of `dejavu_jax.model.sequence_forward(...,
records=True)`, as numpy arrays [L, N, ...] (layers, tokens, units):

  model, ids        load_model(spec), text_windows(...), layer_records(...)
  unit sets         neuron_contributions, mass_count, mass_sets, top_fraction_sets
  contextuality     captured_mass, jaccard, static_mask, overlap_by_pairing
  slow change       cosine_across_layers
  batching          union_density
  results files     manifest_metrics, predictor_recall, eval_points

"Active" for a SwiGLU model (SmolLM2, Llama) cannot mean "exactly zero", because
silu(gate) * up is almost never 0. `mass_sets` therefore calls a token's active set the
smallest set of units that carries a fraction `mass` (e.g. 0.9) of the token's total
contribution, sum_i |a_i| * ||w_out_i|| for neurons or sum_i ||H_i W_O^i|| for heads;
for ReLU models `(mlp_act > 0)` is the paper's exact rule.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax.config import ModelConfig, preset
from dejavu_jax.model import sequence_forward
from dejavu_jax.params import ModelParams, init_params

__all__ = [
    "load_model", "text_windows", "layer_records", "neuron_contributions", "mass_count",
    "mass_sets", "top_fraction_sets", "captured_mass", "jaccard", "static_mask",
    "overlap_by_pairing",
    "cosine_across_layers", "union_density", "manifest_metrics", "predictor_recall",
    "eval_points",
]

SMOLLM2 = "smollm2"


# --------------------------------------------------------------------------- model and text

def load_model(spec: str, dtype=jnp.float32, tokenizer: bool = True):
    """(config, params, tokenizer or None, description) for a model spec.

    spec: "smollm2" (SmolLM2-135M-Instruct GGUF, fetched once into the cache),
    "preset:NAME" or "preset:NAME@SEED" (random weights, seed 0 by default, the
    convention of `dejavu_jax.train.collect --preset`), or a checkpoint path / hub id
    for `dejavu_jax.load_pretrained`. A preset gets its family's offline tokenizer when
    one is found (OPT: the shared OPT tokenizer; Llama: the cached SmolLM2 GGUF's).
    tokenizer=False skips looking for one (the third item is then None).
    """
    from dejavu_jax.loading import load_pretrained
    from dejavu_jax.tokenizer import default_tokenizer_for, load_tokenizer

    if spec.startswith("preset:"):
        name, _, seed = spec[len("preset:"):].partition("@")
        config = preset(name)
        params = init_params(config, jax.random.key(int(seed or 0)), dtype)
        tok = default_tokenizer_for(config, None) if tokenizer else None
        if tokenizer and tok is None and config.family == "llama":
            from dejavu_jax.gguf_loader import smollm2_cache_path
            gguf = smollm2_cache_path()
            if gguf.is_file() and config.vocab_size == 49152:
                tok = load_tokenizer(gguf)
        return config, params, tok, f"{name} (random weights, seed {int(seed or 0)})"
    if spec == SMOLLM2:
        from dejavu_jax.gguf_loader import fetch_smollm2
        path = fetch_smollm2()
    else:
        path = Path(spec).expanduser()
    config, params = load_pretrained(str(path), dtype=dtype, progress=False)
    local = Path(path) if Path(path).exists() else None
    tok = default_tokenizer_for(config, local) if tokenizer else None
    return config, params, tok, f"{config.name} ({path})"


def text_windows(tokenizer, config: ModelConfig, n_windows: int, window: int, seed: int = 0,
                 corpus: list[str] | None = None) -> np.ndarray:
    """int32 [n_windows, window] token windows from different places of the corpus.

    Uses `dejavu_jax.train.corpus` (default corpus `<data root>/corpus/*.txt`; chunks of
    all files shuffled with `seed`), so windows come from different documents. Each
    window starts with BOS when the model has one. Without a tokenizer or a corpus
    (a bare test machine), deterministic pseudo-random ids stand in for text.
    """
    from dejavu_jax.train import corpus as corpus_lib
    bos = config.bos_token_id
    try:
        if tokenizer is None:
            raise corpus_lib.CorpusError("no tokenizer")
        files = corpus_lib.resolve_files(corpus or corpus_lib.default_corpus())
        it = corpus_lib.token_windows(tokenizer, files, window, seed, bos)
        rows = [row for _, row in zip(range(n_windows), it)]
        if len(rows) == n_windows:
            return np.stack(rows).astype(np.int32)
    except corpus_lib.CorpusError:
        pass
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, min(config.vocab_size, 32000), (n_windows, window), dtype=np.int32)
    if bos is not None:
        ids[:, 0] = bos
    return ids


@functools.partial(jax.jit, static_argnums=0)
def _records(config, params, ids):
    _, _, recs = sequence_forward(config, params, ids, None, records=True)
    return recs


def layer_records(config: ModelConfig, params: ModelParams, ids: np.ndarray,
                  batch: int = 8, skip_first: bool = True) -> dict[str, np.ndarray]:
    """Dense forward over token windows; per-layer records as float32 numpy [L, N, T, ...].

    ids [N, T] int32 are run `batch` windows at a time. Keys: attn_in, mlp_in (residual
    stream entering attention / MLP, pre-norm), mlp_act [.., F], head_norm [.., H] (see
    `dejavu_jax.model.sequence_forward`). skip_first drops position 0 (the BOS token,
    whose activations are atypical and which decoding never sees as input).
    """
    ids = np.asarray(ids, np.int32)
    parts = []
    for start in range(0, len(ids), batch):
        chunk = ids[start:start + batch]
        pad = batch - len(chunk)
        if pad:  # keep one compiled shape
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
        recs = _records(config, params, jnp.asarray(chunk))
        parts.append({k: np.asarray(v, np.float32)[:, :batch - pad] for k, v in recs.items()})
    out = {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}
    if skip_first:
        out = {k: v[:, :, 1:] for k, v in out.items()}
    return out


# --------------------------------------------------------------------------- unit sets

def neuron_contributions(params: ModelParams, mlp_act: np.ndarray) -> np.ndarray:
    """|a_i| * ||w_out_i||: each neuron's contribution norm, [L, ..., F] from mlp_act.

    Neuron i adds a_i * w_out_t[i] to the MLP output, so this is the norm of its
    term; the sum over a set bounds the norm of the set's output.
    """
    w = np.asarray(params.layers.w_out_t, np.float32)  # [L, F, d]
    norms = np.linalg.norm(w, axis=-1)  # [L, F]
    shape = (norms.shape[0],) + (1,) * (mlp_act.ndim - 2) + (norms.shape[1],)
    return np.abs(mlp_act) * norms.reshape(shape)


def mass_count(scores: np.ndarray, mass: float = 0.9) -> np.ndarray:
    """Size of the smallest set of units holding `mass` of sum(scores), per row [...].

    scores [..., n] are non-negative; rows summing to 0 count 0 units.
    """
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    s = -np.sort(-np.asarray(scores, np.float64), axis=-1)
    cum = np.cumsum(s, axis=-1)
    total = cum[..., -1:]
    # the tolerance keeps mass=1.0 from asking for round-off beyond the last unit
    need = mass * total * (1 - 1e-9)
    count = (cum < need).sum(axis=-1) + 1
    return np.where(total[..., 0] > 0, np.minimum(count, s.shape[-1]), 0)


def mass_sets(scores: np.ndarray, mass: float = 0.9) -> np.ndarray:
    """Boolean [..., n]: each row's smallest set of units holding `mass` of its sum.

    Ties at the boundary are broken by unit order (exactly mass_count units per row).
    """
    scores = np.asarray(scores)
    count = mass_count(scores, mass)
    order = np.argsort(-scores, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(scores.shape[-1]), axis=-1)
    return rank < count[..., None]


def top_fraction_sets(scores: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean [..., n]: each row's top `fraction` of units by |score| (at least one).

    The label rule `top:FRACTION` of `dejavu_jax.train` (its default for SiLU models).
    """
    from dejavu_jax.train.records import LabelRule, apply_rule
    return np.asarray(apply_rule(LabelRule("top", fraction), np.asarray(scores)))


# --------------------------------------------------------------------------- contextuality

def captured_mass(scores: np.ndarray, sets: np.ndarray) -> np.ndarray:
    """Share of each row's sum(scores) that falls inside its set: [...] in [0, 1].

    sets broadcasts against scores [..., n] (e.g. a static mask [L, 1, n] for scores
    [L, N, n]); rows summing to 0 give 1.
    """
    scores = np.asarray(scores, np.float64)
    total = scores.sum(-1)
    inside = np.where(np.asarray(sets, bool), scores, 0.0).sum(-1)
    return np.where(total > 0, inside / np.where(total > 0, total, 1.0), 1.0)


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a ∩ b| / |a ∪ b| over the last axis of boolean arrays (1 where both are empty)."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def static_mask(sets: np.ndarray) -> np.ndarray:
    """The best input-independent mask for boolean sets [L, N, n]: per layer, the units
    most often active, as many as the mean set size. [L, n] boolean."""
    sets = np.asarray(sets, bool)
    freq = sets.mean(axis=1)  # [L, n]
    k = np.rint(sets.sum(-1).mean(axis=1)).astype(int)  # [L]
    order = np.argsort(-freq, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(freq.shape[-1])[None], axis=-1)
    return rank < k[:, None]


def overlap_by_pairing(sets: np.ndarray, seed: int = 0, n_pairs: int = 2000) -> dict:
    """Mean Jaccard per layer [L] of token sets [L, W, T, n] (W windows of T tokens):

      adjacent: token t and t+1 of the same window;
      same_window: two random tokens of one window;
      other_window: tokens of two different windows (different prompts);
      static: each token's set against `static_mask` (the best fixed set).
    """
    sets = np.asarray(sets, bool)
    L, W, T, n = sets.shape
    rng = np.random.default_rng(seed)
    out = {"adjacent": jaccard(sets[:, :, :-1], sets[:, :, 1:]).mean(axis=(1, 2))}
    w = rng.integers(0, W, n_pairs)
    t1, t2 = rng.integers(0, T, n_pairs), rng.integers(0, T, n_pairs)
    keep = t1 != t2
    out["same_window"] = jaccard(sets[:, w[keep], t1[keep]], sets[:, w[keep], t2[keep]]).mean(1)
    if W > 1:
        w2 = (w + rng.integers(1, W, n_pairs)) % W
        out["other_window"] = jaccard(sets[:, w, t1], sets[:, w2, t2]).mean(1)
    flat = sets.reshape(L, W * T, n)
    out["static"] = jaccard(flat, static_mask(flat)[:, None]).mean(1)
    return out


# --------------------------------------------------------------------------- slow change

def cosine_across_layers(stream: np.ndarray, offsets=(1, 2, 4, 8)) -> dict[int, np.ndarray]:
    """{k: [L] mean cosine similarity of stream[l] and stream[l+k] over tokens}.

    stream [L, N, d] (e.g. each layer's attention input); entries with l+k >= L are NaN.
    Offset 0 is special: the cosine between two *different* random tokens of the same
    layer, the baseline that shows how much of the similarity is a shared direction.
    """
    x = np.asarray(stream, np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
    L, N, _ = x.shape
    out = {}
    for k in offsets:
        vals = np.full(L, np.nan)
        if k == 0:
            perm = np.random.default_rng(0).permutation(N)
            vals = np.einsum("lnd,lnd->ln", x, x[:, perm]).mean(1)
        else:
            for l in range(L - k):
                vals[l] = np.einsum("nd,nd->n", x[l], x[l + k]).mean()
        out[k] = vals
    return out


# --------------------------------------------------------------------------- batching

def union_density(sets: np.ndarray, batch_sizes, n_draws: int = 64, seed: int = 0,
                  groups: np.ndarray | None = None) -> np.ndarray:
    """Mean fraction of units in the union of B tokens' sets: [len(batch_sizes), L].

    sets [L, N, n] boolean. A batch of B draws B distinct tokens; with `groups` [N]
    (e.g. the window of each token) and B <= the number of groups, one token from each
    of B distinct groups, like B sequences decoding together (the paper's Figure 8).
    """
    sets = np.asarray(sets, bool)
    L, N, n = sets.shape
    rng = np.random.default_rng(seed)
    by_group = None
    if groups is not None:
        groups = np.asarray(groups)
        by_group = [np.flatnonzero(groups == g) for g in np.unique(groups)]
    out = np.zeros((len(batch_sizes), L))
    for i, B in enumerate(batch_sizes):
        if B > N:
            raise ValueError(f"batch {B} is larger than the {N} tokens")
        acc = np.zeros(L)
        for _ in range(n_draws):
            if by_group is not None and B <= len(by_group):
                picks = rng.choice(len(by_group), B, replace=False)
                tok = np.array([rng.choice(by_group[g]) for g in picks])
            else:
                tok = rng.choice(N, B, replace=False)
            acc += sets[:, tok].any(axis=1).mean(-1)
        out[i] = acc / n_draws
    return out


# --------------------------------------------------------------------------- results files

def manifest_metrics(manifest: dict) -> dict[str, np.ndarray]:
    """Per-layer arrays [L] from a predictor manifest (`dejavu_jax.train.predictors`).

    Keys "<kind>_<metric>" for kind in mlp / heads / groups and every numeric metric in
    the manifest's per_layer entries (recall, precision, output_captured, ...); a metric
    missing for some layer is NaN there.
    """
    per_layer = manifest["per_layer"]
    keys = {}
    for entry in per_layer:
        for kind in ("mlp", "heads", "groups"):
            for name, value in (entry.get(kind) or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    keys.setdefault(f"{kind}_{name}", None)
    out = {}
    for key in keys:
        kind, name = key.split("_", 1)
        out[key] = np.array([float((e.get(kind) or {}).get(name, np.nan)) for e in per_layer])
    return out


def predictor_recall(pred_params, manifest: dict, records: dict[str, np.ndarray],
                     k_mlp: int, k_heads: int, mlp_sets: np.ndarray,
                     head_sets: np.ndarray) -> dict[str, np.ndarray]:
    """Recall and precision [L] of trained predictors on tokens the notebook recorded.

    records: `layer_records` output flattened to [L, N, ...]; inputs are taken as the
    manifest says (lookahead: layer l reads attn_in[l-1]; same layer: mlp_in[l] for
    neurons, attn_in[l] for heads). mlp_sets [L, N, F] / head_sets [L, N, H] are the
    true active sets; each token's predicted set is its top-k of
    `dejavu_jax.train.predict.predictor_scores`.
    """
    from dejavu_jax.train.predict import predictor_scores
    L = mlp_sets.shape[0]
    score = jax.jit(predictor_scores)
    out = {k: np.zeros(L) for k in ("mlp_recall", "mlp_precision", "heads_recall",
                                     "heads_precision")}
    for l in range(L):
        if manifest.get("lookahead", True):
            x_mlp = x_heads = records["attn_in"][max(l - 1, 0)]
        else:
            x_mlp, x_heads = records["mlp_in"][l], records["attn_in"][l]
        m, _ = score(pred_params, l, jnp.asarray(x_mlp))
        _, h = score(pred_params, l, jnp.asarray(x_heads))
        for kind, s, truth, k in (("mlp", m, mlp_sets[l], k_mlp), ("heads", h, head_sets[l],
                                                                     k_heads)):
            s = np.asarray(s)
            top = np.argpartition(-s, k - 1, axis=-1)[:, :k]
            hits = np.take_along_axis(truth, top, axis=-1).sum()
            out[f"{kind}_recall"][l] = hits / max(truth.sum(), 1)
            out[f"{kind}_precision"][l] = hits / top.size
    return out


_SPARSITY_KEYS = ("total_sparsity", "sparsity")
_DENSITY_KEYS = ("total_density", "density")
_METRIC_KEYS = ("perplexity", "ppl", "task_mean", "avg_accuracy", "mean_accuracy", "accuracy",
                "acc", "task_average")


def _number(value):
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(float(value)) else None


def eval_points(paths) -> list[dict]:
    """Accuracy/perplexity-vs-sparsity points found in evaluation JSON files.

    The evaluation writes its own schema; this reads it leniently: every JSON object
    (at any depth) with a sparsity (`total_sparsity`/`sparsity`, or 1 - `total_density`/
    `density`, or the mean of 1 - `mlp_density` and 1 - `head_density`) and a metric
    (`perplexity`/`ppl`, `task_mean`, or an accuracy key) becomes a point {file, mode, sparsity,
    metric, value}. `mode` is the object's `mode` (or `predictor`/`method`), else the
    nearest enclosing key. Unreadable files are skipped. Returns [] when nothing fits.
    """
    points = []

    def sparsity_of(obj):
        for k in _SPARSITY_KEYS:
            if _number(obj.get(k)) is not None:
                return _number(obj[k])
        for k in _DENSITY_KEYS:
            if _number(obj.get(k)) is not None:
                return 1.0 - _number(obj[k])
        m, h = _number(obj.get("mlp_density")), _number(obj.get("head_density"))
        if m is not None and h is not None:
            return 1.0 - (m + h) / 2
        if m is not None:
            return 1.0 - m
        return None

    def walk(obj, file, context):
        if isinstance(obj, dict):
            s = sparsity_of(obj)
            if s is not None:
                mode = obj.get("mode") or obj.get("predictor") or obj.get("method") or context
                for k in _METRIC_KEYS:
                    v = _number(obj.get(k))
                    if v is not None:
                        points.append({"file": file, "mode": str(mode), "sparsity": s,
                                       "metric": k, "value": v})
            for k, v in obj.items():
                walk(v, file, k if isinstance(v, (dict, list)) else context)
        elif isinstance(obj, list):
            for v in obj:
                walk(v, file, context)

    for path in sorted(Path(p) for p in paths):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        walk(data, os.path.basename(str(path)), "")
    return points


def frontier_results(folder) -> dict | None:
    """An `eval.frontier` output folder read back: {"model", "rows" (its JSONL rows),
    "profiles" ({file stem: SparsityProfile})}, or None when the folder holds no rows."""
    from dejavu_jax.sparsity_profile import ProfileError, load_profile
    folder = Path(folder)
    rows_file = folder / "frontier.jsonl"
    if not rows_file.is_file():
        return None
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    profiles = {}
    for path in sorted((folder / "profiles").glob("*.json")):
        try:
            profiles[path.stem] = load_profile(path)
        except ProfileError:
            continue
    model = folder.name.removesuffix("-frontier")
    return {"model": model, "rows": rows, "profiles": profiles}


def frontier_curves(rows: list[dict], text: str = "wikitext2") -> dict[str, list[tuple]]:
    """{method: [(bytes skipped, perplexity cost), ...] sorted} of one text's sweep rows
    (allocation paths, the oracle, predictors), costs against the dense row."""
    dense = [r for r in rows if r["kind"] == "dense" and r["text"] == text]
    if not dense:
        return {}
    base = dense[0]["perplexity"]
    curves = {}
    for r in rows:
        if r["text"] == text and r["kind"] in ("path", "oracle", "predictors"):
            curves.setdefault(r["method"], []).append(
                (r["bytes_skipped"], r["perplexity"] / base - 1))
    return {m: sorted(v) for m, v in curves.items()}
