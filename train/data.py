"""Streaming training examples out of a records folder, one shard at a time.

An example is one token: every layer's predictor input and its labels. The pairing of
inputs with layers (lookahead or same-layer) happens here, so a predictor for layer l
sees `inputs[l]` = the recorded input of layer `input_layers(L, lookahead)[l]`.
Validation tokens are the last windows of every shard (windows are already shuffled
over the corpus at collection time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from dejavu_jax.train import records as rec
from dejavu_jax.train.predictor_model import input_layers


@dataclass
class Batch:
    """Numpy arrays for all layers: x_mlp, x_heads [L, B, d] fp16 (x_mlp is None when it
    equals x_heads), mlp_label [L, B, ceil(F/8)] uint8 packed, head_norm [L, B, H] fp16."""

    x_heads: np.ndarray
    x_mlp: np.ndarray | None
    mlp_label: np.ndarray
    head_norm: np.ndarray
    idx: np.ndarray | None = None
    mlp_in: np.ndarray | None = None  # each layer's own MLP input, for output metrics


def split_tokens(records: rec.Records, shard: int, val_fraction: float) -> tuple[int, int]:
    """(n_train, n) for a shard: tokens [0, n_train) train, [n_train, n) validate."""
    n = records.manifest["shards"][shard]["tokens"]
    per_window = records.manifest["tokens_per_window"]
    windows = n // per_window
    val_windows = int(np.ceil(val_fraction * windows)) if val_fraction > 0 else 0
    if windows > 1:
        val_windows = min(val_windows, windows - 1)
    return n - val_windows * per_window, n


def gather(arrays: dict[str, np.ndarray], idx: np.ndarray, lookahead: bool,
           with_mlp_in: bool = False) -> Batch:
    """The tokens `idx` of one shard's records, paired for lookahead or same-layer input."""
    idx = np.sort(idx)
    attn_in = arrays["attn_in"][:, idx]
    src = input_layers(attn_in.shape[0], lookahead)
    x_heads = attn_in[src]
    mlp_in = arrays["mlp_in"][:, idx] if with_mlp_in or not lookahead else None
    return Batch(x_heads=x_heads, x_mlp=None if lookahead else mlp_in,
                 mlp_label=arrays["mlp_label"][:, idx], head_norm=arrays["head_norm"][:, idx],
                 idx=idx, mlp_in=mlp_in if with_mlp_in else None)


def train_batches(records: rec.Records, batch_size: int, lookahead: bool,
                  val_fraction: float, rng: np.random.Generator) -> Iterator[Batch]:
    """One epoch of shuffled training batches: shards in random order, tokens shuffled
    within each shard; only the current shard is mapped. Drops each shard's remainder."""
    for s in rng.permutation(len(records.shards)):
        arrays = records.shard(int(s))
        n_train, _ = split_tokens(records, int(s), val_fraction)
        order = rng.permutation(n_train)
        for start in range(0, n_train - batch_size + 1, batch_size):
            yield gather(arrays, order[start:start + batch_size], lookahead)


def validation_set(records: rec.Records, lookahead: bool, val_fraction: float,
                   max_tokens: int) -> Batch:
    """Validation tokens from every shard (evenly capped at max_tokens), in RAM."""
    per_shard = max(1, max_tokens // len(records.shards))
    parts = []
    for s in range(len(records.shards)):
        n_train, n = split_tokens(records, s, val_fraction)
        if n == n_train:
            continue
        idx = np.arange(n_train, n)[:per_shard]
        parts.append(gather(records.shard(s), idx, lookahead, with_mlp_in=True))
    if not parts:
        raise rec.RecordsError(f"{records.root}: no validation tokens (val fraction "
                               f"{val_fraction}); collect more windows")

    def cat(name):
        vals = [getattr(p, name) for p in parts]
        return None if vals[0] is None else np.concatenate(vals, axis=1)

    return Batch(x_heads=cat("x_heads"), x_mlp=cat("x_mlp"), mlp_label=cat("mlp_label"),
                 head_norm=cat("head_norm"), mlp_in=cat("mlp_in"))


def sample_train(records: rec.Records, n: int, lookahead: bool, val_fraction: float,
                 rng: np.random.Generator) -> Batch:
    """Up to n training tokens from the first shard (for input statistics and priors)."""
    arrays = records.shard(0)
    n_train, _ = split_tokens(records, 0, val_fraction)
    return gather(arrays, rng.permutation(n_train)[:n], lookahead)


def mlp_inputs(batch: Batch) -> np.ndarray:
    """The MLP predictors' inputs [L, B, d]."""
    return batch.x_heads if batch.x_mlp is None else batch.x_mlp
