"""Command-line glue for tensor-parallel generation: `--devices N` / `--mesh tp=N`.

`python -m dejavu_jax.generate --preset opt-30b --devices 2 ...` loads (or initialises)
the weights straight into their shards and decodes with the engines of
`dejavu_jax.tp_decode`. Several hosts: call `jax.distributed.initialize()` first (see
README, "Multi-GPU"); `--devices` then counts devices over all hosts.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from dejavu_jax import sharding, tp_decode


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --devices and --mesh to a CLI parser."""
    g = parser.add_argument_group("multi-device (tensor parallel)")
    g.add_argument("--devices", type=int,
                   help="split heads and neurons over N devices (shorthand for --mesh tp=N)")
    g.add_argument("--mesh", help="device mesh, e.g. 'tp=2' or 'data=2,tp=4' (batch on data)")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (one process per host). "
                        "Slurm / Open MPI are detected; otherwise set JAX_COORDINATOR_ADDRESS, "
                        "DEJAVU_NUM_PROCESSES and DEJAVU_PROCESS_ID")


def initialize_distributed() -> None:
    """`jax.distributed.initialize()`, with the process count and id taken from
    DEJAVU_NUM_PROCESSES / DEJAVU_PROCESS_ID when set (jax itself reads
    JAX_COORDINATOR_ADDRESS, and detects Slurm, Open MPI and TPU pods)."""
    kw = {}
    if "DEJAVU_NUM_PROCESSES" in os.environ:
        kw["num_processes"] = int(os.environ["DEJAVU_NUM_PROCESSES"])
    if "DEJAVU_PROCESS_ID" in os.environ:
        kw["process_id"] = int(os.environ["DEJAVU_PROCESS_ID"])
    jax.distributed.initialize(**kw)


def mesh_from_args(args) -> "jax.sharding.Mesh | None":
    """The mesh the CLI options ask for, or None for one device."""
    if getattr(args, "distributed", False):
        initialize_distributed()
    if not (args.mesh or args.devices):
        return None
    if args.mesh and args.devices:
        raise SystemExit("error: give --devices or --mesh, not both")
    try:
        sizes = sharding.parse_mesh(args.mesh) if args.mesh else {"data": 1, "tp": args.devices}
        return sharding.make_mesh(**sizes)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def load_model(args, mesh):
    """(config, params, model_path or None, label), like `generate.load_model`, with every
    weight created or read straight into its shard on `mesh`."""
    from pathlib import Path

    from dejavu_jax import config as config_lib
    from dejavu_jax.generate import DTYPES
    from dejavu_jax.loading import default_dtype
    from dejavu_jax.sharded_loading import load_pretrained_sharded
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype()
    where = f"on mesh {dict(mesh.shape)}"
    try:
        if args.model:
            config, params = load_pretrained_sharded(args.model, mesh, dtype)
            path = Path(args.model).expanduser()
            return config, params, path if path.exists() else None, f"{args.model} {where}"
        if args.preset:
            config = config_lib.preset(args.preset)
            params = sharding.init_params_sharded(config, jax.random.key(args.seed), dtype, mesh)
            return config, params, None, f"{args.preset} [random weights] {where}"
        from dejavu_jax.gguf_loader import fetch_smollm2, smollm2_cache_path
        if not smollm2_cache_path().is_file():
            print("fetching SmolLM2-135M-Instruct (98 MB, once) ...", file=sys.stderr)
        path = fetch_smollm2()
        config, params = load_pretrained_sharded(path, mesh, dtype)
    except sharding.ShardingError as e:
        raise SystemExit(f"error: {e}")
    return config, params, path, f"SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) {where}"


def build_engine(args, config, params, mesh):
    """(engine, engine params, SparseConfig or None) on `mesh`, for the same options as
    `generate.build_engine` (dense, --sparse with predictors, --oracle)."""
    from dejavu_jax import generate, sparse
    _, engine_params, scfg = generate.build_engine(args, config, params)
    if scfg is None:
        return tp_decode.tp_dense_engine(config, mesh), params, None
    predictors = engine_params[1]
    if args.oracle:
        select = sparse.no_selector
    else:
        select = sparse.predictor_selector(config.group_size, method=args.select)
        predictors = tp_decode.shard_predictors(predictors, mesh)
    return tp_decode.tp_sparse_engine(config, scfg, select, mesh), (params, predictors), scfg
