"""Shared pieces of the evaluation CLIs: model, tokenizer, predictors, modes, batching."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dejavu_jax.eval.sparse_scoring import MODES, EvalMode, make_mode

DEFAULT_PREDICTORS = Path(__file__).resolve().parents[1] / ".cache" / "predictors" / "smollm2-135m"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--preset, --mode, densities, --predictors, --dense-layers, --dense-prefix,
    --batch-tokens, --no-progress."""
    p.add_argument("--model", help="checkpoint folder, .gguf file or hub id "
                   "(default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--preset", help="random weights in the shape of a preset (for smoke runs)")
    p.add_argument("--tokenizer", help="tokenizer folder or .gguf (default: the model's own)")
    p.add_argument("--mode", choices=MODES, default="dense")
    p.add_argument("--mlp-density", type=float, default=1.0)
    p.add_argument("--head-density", type=float, default=1.0)
    p.add_argument("--dense-layers", type=int, default=2,
                   help="the first N layers run dense (as in the decode engine)")
    p.add_argument("--predictors", default=str(DEFAULT_PREDICTORS),
                   help="trained predictor folder (for --mode sparse)")
    p.add_argument("--dense-prefix", type=int, default=1,
                   help="positions of each sequence that run dense, like a dense prefill "
                        "(default 1: every scored token is decoded sparsely)")
    p.add_argument("--batch-tokens", type=int, default=4096,
                   help="tokens per forward call (batch rows x length)")
    p.add_argument("--no-progress", action="store_true")


def load_model(args):
    """(config, fp32 params, tokenizer) from --model / --preset, default SmolLM2-135M."""
    import jax

    import dejavu_jax as dj
    from dejavu_jax.tokenizer import default_tokenizer_for, load_tokenizer
    if args.preset:
        config = dj.preset(args.preset)
        params = dj.init_params(config, jax.random.key(0), jnp.float32)
        path = None
    else:
        if args.model:
            path = Path(args.model)
        else:
            from dejavu_jax.gguf_loader import fetch_smollm2
            path = fetch_smollm2()
        config, params = dj.load_pretrained(path, dtype=jnp.float32, progress=False)
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        tok = default_tokenizer_for(config, path if path is not None and path.exists() else None)
    if tok is None:
        raise SystemExit("error: no tokenizer for this model; pass --tokenizer")
    return config, params, tok


def load_predictor_params(path: str, config):
    """Trained predictors for `config` from a folder (see dejavu_jax.train)."""
    from dejavu_jax.train.predict import load_predictors
    pred, _ = load_predictors(path, config)
    return pred


def mode_from_args(args, config) -> tuple[EvalMode, object]:
    """(EvalMode, predictor params or None) from the parsed CLI arguments."""
    mode = make_mode(config, args.mode, args.mlp_density, args.head_density, args.dense_layers)
    pred = load_predictor_params(args.predictors, config) if args.mode == "sparse" else None
    return mode, pred


def pad_rows(rows: list[list[int]], length: int, n_rows: int, fill: int = 0) -> np.ndarray:
    """Right-pad token lists to [n_rows, length] int32 (missing rows are all `fill`)."""
    out = np.full((n_rows, length), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def progress(iterable, total: int, desc: str, disable: bool):
    """A tqdm bar on stderr (or the plain iterable when disabled)."""
    if disable:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
