"""Shared pieces of the evaluation CLIs: model, tokenizer, predictors, modes, batching."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
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


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """--devices N / --mesh tp=N[,data=M] / --distributed, as `python -m dejavu_jax.generate`
    has them (`dejavu_jax.multidevice`)."""
    from dejavu_jax import multidevice
    multidevice.add_mesh_arguments(p)


def mesh_from_args(args):
    """The ("data", "tp") mesh of --devices / --mesh, or None for one device (exits with a
    clear message for a malformed mesh or one larger than the devices present)."""
    from dejavu_jax import multidevice
    if not hasattr(args, "devices"):
        return None
    return multidevice.mesh_from_args(args)


def load_weights(args, mesh=None):
    """(config, fp32 params, checkpoint path or None) from --model / --preset, default
    SmolLM2-135M. With a mesh every weight is created or read straight into its
    tensor-parallel shard (`sharding.init_params_sharded`, `sharded_loading`); raises
    sharding.ShardingError when the mesh does not divide the heads and neurons."""
    import dejavu_jax as dj
    from dejavu_jax import sharding
    if args.preset:
        config = dj.preset(args.preset)
        key = jax.random.key(0)
        params = (dj.init_params(config, key, jnp.float32) if mesh is None
                  else sharding.init_params_sharded(config, key, jnp.float32, mesh))
        return config, params, None
    if args.model:
        path = Path(args.model)
    else:
        from dejavu_jax.gguf_loader import fetch_smollm2
        path = fetch_smollm2()
    if mesh is None:
        config, params = dj.load_pretrained(path, dtype=jnp.float32, progress=False)
    else:
        from dejavu_jax.sharded_loading import load_pretrained_sharded
        config, params = load_pretrained_sharded(path, mesh, jnp.float32)
    return config, params, path


def load_tokenizer_for(args, config, path):
    """--tokenizer, else the model's own (exits when there is none)."""
    from dejavu_jax.tokenizer import default_tokenizer_for, load_tokenizer
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        tok = default_tokenizer_for(config, path if path is not None and path.exists() else None)
    if tok is None:
        raise SystemExit("error: no tokenizer for this model; pass --tokenizer")
    return tok


def load_model(args, mesh=None):
    """(config, fp32 params, tokenizer) from --model / --preset, default SmolLM2-135M; with
    a mesh, weights in the tensor-parallel layout (a ShardingError exits with its message,
    as in `python -m dejavu_jax.generate`)."""
    from dejavu_jax import sharding
    try:
        config, params, path = load_weights(args, mesh)
    except sharding.ShardingError as e:
        raise SystemExit(f"error: {e}")
    return config, params, load_tokenizer_for(args, config, path)


def load_predictor_params(path: str, config):
    """Trained predictors for `config` from a folder (see dejavu_jax.train)."""
    from dejavu_jax.train.predict import load_predictors
    pred, _ = load_predictors(path, config)
    return pred


def mode_from_args(args, config, mesh=None) -> tuple[EvalMode, object]:
    """(EvalMode, predictor params or None) from the parsed CLI arguments.

    On a mesh with tp > 1, sparse and oracle modes select per shard as the tensor-parallel
    decode does (ceil(k / tp) of each device's own units; `sparse_scoring` module doc) and
    the predictors are placed split by unit like the model.
    """
    from dejavu_jax import sharding
    shards = 1 if mesh is None else sharding.tp_size(mesh)
    try:
        mode = make_mode(config, args.mode, args.mlp_density, args.head_density,
                         args.dense_layers, shards=shards)
    except sharding.ShardingError as e:
        raise SystemExit(f"error: {e}")
    pred = load_predictor_params(args.predictors, config) if args.mode == "sparse" else None
    if pred is not None and mesh is not None:
        from dejavu_jax.tp_decode import shard_predictors
        pred = shard_predictors(pred, mesh)
    return mode, pred


def mesh_rows(rows: int, mesh) -> int:
    """`rows` rounded up to a multiple of the mesh's "data" axis (the batch splits evenly)."""
    data = 1 if mesh is None else mesh.shape["data"]
    return -(-rows // data) * data


def put_batch(mesh, array) -> jax.Array:
    """A host batch [B, ...] on the device(s): split over "data" on a mesh (replicated over
    "tp"), built per device so that it also works with several processes."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    arr = np.asarray(array)
    if mesh is None:
        return jnp.asarray(arr)
    spec = P("data") if arr.shape[0] % mesh.shape["data"] == 0 else P()
    return jax.make_array_from_callback(arr.shape, NamedSharding(mesh, spec),
                                        lambda index: arr[index])


def to_host(x, dtype=None) -> np.ndarray:
    """A device array as numpy, gathered from every process when it spans several."""
    if not getattr(x, "is_fully_addressable", True):
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, dtype)


def mesh_label(mesh) -> str:
    """' on mesh data=1,tp=2' (empty for one device), for the CLIs' summary line."""
    if mesh is None:
        return ""
    return " on mesh " + ",".join(f"{k}={v}" for k, v in mesh.shape.items())


def is_main_process() -> bool:
    """True in the process that writes results (process 0 of a --distributed run)."""
    return jax.process_index() == 0


def save_result(path: str | None, result: dict) -> None:
    """Write `result` as JSON to `path` (if given) from the main process only."""
    if path and is_main_process():
        Path(path).write_text(json.dumps(result, indent=1))


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
