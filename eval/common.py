"""Shared pieces of the evaluation CLIs: model, tokenizer, predictors, modes, batching."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli, sparse
from dejavu_jax.eval.sparse_scoring import MODES, EvalMode, make_mode

DEFAULT_PREDICTORS = Path(__file__).resolve().parents[1] / ".cache" / "predictors" / "smollm2-135m"


def add_model_args(p: argparse.ArgumentParser, mode: bool = True) -> None:
    """--model/--preset, --mode and densities (unless `mode` is False), --predictors,
    --dense-layers, --dense-prefix, --batch-tokens, --no-progress; `check_model_args`
    checks them together."""
    from dejavu_jax.config import PRESETS
    p.add_argument("--model", type=cli.model_source,
                   help="checkpoint folder, .gguf file or hub id "
                   "(default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--preset", choices=PRESETS, metavar="NAME",
                   help=f"random weights in the shape of a preset (for smoke runs): "
                        f"{', '.join(PRESETS)}")
    p.add_argument("--tokenizer", type=cli.existing_path,
                   help="tokenizer folder or .gguf (default: the model's own)")
    if mode:
        p.add_argument("--mode", choices=MODES, default="dense")
        p.add_argument("--mlp-density", type=cli.fraction,
                       help="MLP neurons kept per token, in (0, 1] (sparse and oracle "
                            "modes; default 1.0)")
        p.add_argument("--head-density", type=cli.fraction,
                       help="query heads kept per token, in (0, 1] (sparse and oracle "
                            "modes; default 1.0)")
    p.add_argument("--dense-layers", type=cli.non_negative_int,
                   help="the first N layers run dense, as in the decode engine (sparse and "
                        "oracle modes; default 2, or fewer so that one layer is sparse)")
    p.add_argument("--predictors", type=Path,
                   help=f"trained predictor folder (sparse mode; default {DEFAULT_PREDICTORS})")
    # without --mode there is no threshold mode to score: --profile stays, hidden, so that
    # check_model_args can say which commands score a profile
    p.add_argument("--profile", type=cli.existing_path,
                   help="sparsity profile file (threshold mode; default: the model's own, "
                        "shipped or made by train.profile)" if mode else argparse.SUPPRESS)
    p.add_argument("--dense-prefix", type=cli.non_negative_int, default=1,
                   help="positions of each sequence that run dense, like a dense prefill "
                        "(default 1: every scored token is decoded sparsely)")
    p.add_argument("--batch-tokens", type=cli.positive_int, default=4096,
                   help="tokens per forward call (batch rows x length)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_model_args(args, modes: set[str] | None = None) -> None:
    """The rules between the model options, before anything loads (one `error:` line):
    one model source; sparse options only with a sparse or oracle mode; an existing
    predictor folder for the sparse mode. `modes`: the modes the run scores (default
    {args.mode})."""
    if args.model and args.preset:
        cli.fail("give --model or --preset, not both")
    modes = modes if modes is not None else {args.mode}
    see = "--mode" if hasattr(args, "mode") else "--modes"   # eval.sweep: --modes
    options = {"--mlp-density": getattr(args, "mlp_density", None),
               "--head-density": getattr(args, "head_density", None),
               "--dense-layers": args.dense_layers}
    given = [flag for flag, value in options.items() if value is not None]
    if given and modes <= {"dense"}:
        cli.fail(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the "
                 f"sparse and oracle modes, and this run scores dense only (see {see})")
    if getattr(args, "profile", None) is not None and "threshold" not in modes:
        if hasattr(args, "mode"):
            cli.fail("--profile is for the threshold mode, which this run does not score "
                     "(pass --mode threshold)")
        cli.fail("--profile is for the threshold mode, which this command does not score: "
                 "use eval.perplexity or eval.tasks with --mode threshold --profile FILE, "
                 "or eval.frontier --profile FILE")
    if "threshold" in modes and (getattr(args, "mlp_density", None) is not None
                                 or getattr(args, "head_density", None) is not None
                                 or args.dense_layers is not None):
        cli.fail("--mlp-density, --head-density and --dense-layers are for the sparse and "
                 "oracle modes; a threshold profile sets each layer itself")
    if args.predictors is not None and "sparse" not in modes:
        cli.fail("--predictors is for the sparse mode, which this run does not score "
                 f"(see {see})")
    if "sparse" in modes:
        folder = predictors_dir(args)
        if folder.exists() and not folder.is_dir():
            cli.fail(f"--predictors {folder}: a file, not a predictor folder (pass the "
                     "folder train.predictors wrote)")
        if not folder.is_dir():
            cli.fail(f"{folder}: no such predictor folder (train one, see train/README.md, "
                     "or pass --predictors DIR)")


def predictors_dir(args) -> Path:
    """--predictors, else the default SmolLM2 predictor folder."""
    return Path(args.predictors or DEFAULT_PREDICTORS).expanduser()


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


def model_path(args) -> Path | None:
    """The checkpoint of --model, or of the default model (fetched once; exits with one
    line when that fails); None for --preset."""
    if args.preset:
        return None
    from dejavu_jax.fetch_model import resolve_model
    from dejavu_jax.gguf_loader import fetch_smollm2
    try:
        if args.model:
            return Path(resolve_model(args.model))  # a registered name: its cached file
        return fetch_smollm2()
    except RuntimeError as e:
        cli.fail(cli.first_line(e) + " (see `python -m dejavu_jax.fetch_model`)")


def model_config(args):
    """The ModelConfig of --model / --preset / the default model, read without its weights
    (exits with one `error:` line for a missing or unreadable checkpoint)."""
    import dejavu_jax as dj
    from dejavu_jax.checkpoint_files import CheckpointError
    from dejavu_jax.loading import read_config
    if args.preset:
        return dj.preset(args.preset)
    try:
        return read_config(model_path(args))
    except CheckpointError as e:
        cli.fail(str(e))


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
    path = model_path(args)
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
        cli.fail("no tokenizer for this model; pass --tokenizer DIR (OPT models use "
                 "tokenizers/opt in the data folder, $DEJAVU_DATA, when it is there)")
    return tok


def load_model(args, mesh=None):
    """(config, fp32 params, tokenizer) from --model / --preset, default SmolLM2-135M; with
    a mesh, weights in the tensor-parallel layout. A bad checkpoint file or a mesh that does
    not divide the model exits with one `error:` line, as in `python -m dejavu_jax.generate`."""
    from dejavu_jax import sharding
    from dejavu_jax.checkpoint_files import CheckpointError
    try:
        config, params, path = load_weights(args, mesh)
        return config, params, load_tokenizer_for(args, config, path)
    except (CheckpointError, sharding.ShardingError, OSError) as e:
        cli.fail(str(e))


def load_predictor_params(path, config):
    """Trained predictors for `config` from a folder (see dejavu_jax.train); one `error:`
    line when the folder holds none, or none for this model."""
    from dejavu_jax.train.predict import PredictorCheckpointError, load_predictors
    try:
        pred, _ = load_predictors(path, config)
    except PredictorCheckpointError as e:
        cli.fail(str(e))
    return pred


def mode_from_args(args, config, mesh=None) -> tuple[EvalMode, object]:
    """(EvalMode, predictor params or None) from the parsed CLI arguments.

    On a mesh with tp > 1, sparse and oracle modes select per shard as the tensor-parallel
    decode does (ceil(k / tp) of each device's own units; `sparse_scoring` module doc) and
    the predictors are placed split by unit like the model. Settings that do not fit the
    model exit with one `error:` line.
    """
    from dejavu_jax import sharding
    shards = 1 if mesh is None else sharding.tp_size(mesh)
    if args.mode == "threshold":
        return threshold_mode(args, config, shards)
    dense_layers = (sparse.default_dense_layers(config.n_layers) if args.dense_layers is None
                    else args.dense_layers)
    if dense_layers >= config.n_layers and args.mode != "dense":
        cli.fail(f"--dense-layers {dense_layers}: the model has {config.n_layers} layers, so "
                 "none would run sparse")
    try:
        mode = make_mode(config, args.mode, args.mlp_density or 1.0, args.head_density or 1.0,
                         dense_layers, shards=shards,
                         shared_rows=getattr(args, "shared_rows", 1))
    except sharding.ShardingError as e:
        cli.fail(str(e))
    pred = (load_predictor_params(predictors_dir(args), config) if args.mode == "sparse"
            else None)
    if pred is not None and mesh is not None:
        from dejavu_jax.tp_decode import shard_predictors
        pred = shard_predictors(pred, mesh)
    return mode, pred


def threshold_mode(args, config, shards: int = 1) -> tuple[EvalMode, object]:
    """(threshold EvalMode, thresholds) of --profile, else the model's own profile; one
    `error:` line when there is none or it does not fit the model."""
    from dejavu_jax.sparsity_profile import ProfileError, default_profile_path, load_profile
    if shards > 1:
        cli.fail("the threshold mode scores on one device; drop --devices / --mesh")
    path = args.profile or default_profile_path(config)
    if path is None:
        cli.fail(f"no sparsity profile for {config.name}: make one with `./dejavu run "
                 "train.profile --model ...` or pass --profile FILE")
    try:
        profile = load_profile(path, config)
    except ProfileError as e:
        cli.fail(str(e))
    mode = make_mode(config, "threshold", sites=profile.sites)
    mode = dataclasses.replace(mode, source=str(path))
    return mode, jnp.asarray(profile.threshold_array())


def mode_params(mode: EvalMode, params):
    """`params` as `mode` scores them: with a threshold mode's profile (`mode.source`)
    its gate weights in their layers (`SparsityProfile.weighted_params`)."""
    from dejavu_jax.sparsity_profile import load_profile
    if mode.name != "threshold" or mode.source is None:
        return params
    return load_profile(mode.source).weighted_params(params)


def bytes_summary(config, mode: EvalMode, selector_params, read: float) -> dict:
    """The decoder weight bytes of a scored token: `read`, the mean fraction of the layers'
    matmul weights read (`sparse_scoring.read_fraction`), plus for the sparse mode the
    predictors' weights, which every token reads; and the fraction skipped."""
    from dejavu_jax.activation_sparsity import layer_elements
    total = layer_elements(config) * config.n_layers
    extra = 0
    if mode.name == "sparse" and selector_params is not None:
        extra = sum(x.size for x in jax.tree.leaves(selector_params) if x.ndim >= 2)
    fraction = read + extra / total
    return {"bytes_read": fraction, "bytes_skipped": 1.0 - fraction,
            "selector_bytes": extra / total}


def check_dense_prefix(dense_prefix: int, mode: str, longest: int, what: str) -> None:
    """One `error:` line when --dense-prefix covers every position of the longest
    sequence scored (`longest` inputs, `what` says whose): a sparse `mode` would then
    score every token dense."""
    if mode != "dense" and dense_prefix >= longest:
        cli.fail(f"--dense-prefix {dense_prefix} runs all {longest} positions of "
                 f"{what} dense, so --mode {mode} would score no token sparsely")


def check_ids(ids, config, what: str) -> None:
    """Token ids of the text to score inside the model's vocabulary (one `error:` line,
    naming `what`, otherwise)."""
    from dejavu_jax.inputs import check_token_ids
    try:
        check_token_ids(np.asarray(ids, np.int64), config.vocab_size, what, "[time]")
    except ValueError as e:
        cli.fail(f"{e}: the tokenizer does not fit the model")


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


def check_out_path(path: str | None) -> None:
    """One `error:` line, before anything runs, unless `path` (if given) is a file this
    process can write: not a folder, and under a folder that exists or can be made."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        cli.fail(f"--out {path}: is a folder; give a file name for the JSON result")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        cli.fail(f"--out {path}: {parent} is a file, so no folder can be made there")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        cli.fail(f"--out {path}: not writable")


def save_result(path: str | None, result: dict) -> None:
    """Write `result` as JSON to `path` (if given, its folders made) from the main process
    only."""
    if path and is_main_process():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
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


def device_free_bytes() -> int | None:
    """Bytes the local devices can still allocate (their limits less what is in use, summed:
    a sharded cache spreads over them), None where the backend keeps no memory stats (CPU)."""
    free = 0
    for dev in jax.local_devices():
        try:
            stats = dev.memory_stats()
        except Exception:  # backends without memory stats
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        free += int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free


def device_memory_bytes() -> int | None:
    """Memory one device offers: an accelerator's share of `device_free_bytes`, or the
    host's available memory on the CPU backend; None where unknown."""
    free = device_free_bytes()
    if free is not None:
        return free // jax.local_device_count()
    if jax.devices()[0].platform != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def models_too_large(names, dtype=jnp.bfloat16, shards: int = 1) -> list[str]:
    """The presets among `names` whose weights alone (random, `dtype`, split over `shards`
    devices) exceed one device's memory, each as 'NAME (X GB)': a benchmark refuses them
    up front instead of running out of memory part-way."""
    from dejavu_jax import config as config_lib
    from dejavu_jax.params import init_params, param_bytes
    limit = device_memory_bytes()
    if limit is None:
        return []
    too_large = []
    for name in names:
        config = config_lib.preset(name)
        shapes = jax.eval_shape(lambda c=config: init_params(c, jax.random.key(0), dtype))
        need = param_bytes(shapes) / shards
        if need > limit:
            too_large.append(f"{name} ({need / 1e9:.1f} GB)")
    return too_large


def refuse_models_too_large(parser, names, shards: int = 1) -> None:
    """`parser.error` (one `error:` line) naming the presets whose weights alone exceed one
    device's memory (`models_too_large`). It starts JAX's backend, which on a GPU
    preallocates memory: call it after anything that needs the accelerator to itself."""
    too_large = models_too_large(names, shards=shards)
    if too_large:
        per = "" if shards == 1 else f" per device over {shards} devices"
        parser.error(f"--models: the weights of {', '.join(too_large)}{per} alone exceed "
                     f"this {jax.default_backend()} device's "
                     f"{device_memory_bytes() / 1e9:.1f} GB; choose smaller presets")
