"""Command-line glue for tensor-parallel generation: `--devices N` / `--mesh tp=N`.

`python -m dejavu_jax.generate --preset opt-30b --devices 2 ...` loads (or initialises)
the weights straight into their shards and decodes with the engines of
`dejavu_jax.tp_decode`. Several hosts: call `jax.distributed.initialize()` first (see
README, "Multi-GPU"); `--devices` then counts devices over all hosts.
"""

from __future__ import annotations

import argparse
import os

import jax

from dejavu_jax import cli, sharding, tp_decode


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --devices and --mesh to a CLI parser."""
    g = parser.add_argument_group("multi-device (tensor parallel)")
    g.add_argument("--devices", type=cli.positive_int,
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
    for key, env in (("num_processes", "DEJAVU_NUM_PROCESSES"),
                     ("process_id", "DEJAVU_PROCESS_ID")):
        if env in os.environ:
            try:
                kw[key] = int(os.environ[env])
            except ValueError:
                cli.fail(f"{env}={os.environ[env]!r} is not an integer")
    try:
        jax.distributed.initialize(**kw)
    except ValueError as e:  # no coordinator given nor detected
        cli.fail(f"--distributed: {cli.first_line(e)} (set JAX_COORDINATOR_ADDRESS, "
                 "DEJAVU_NUM_PROCESSES and DEJAVU_PROCESS_ID, or run under Slurm or Open MPI)")


def mesh_from_args(args) -> "jax.sharding.Mesh | None":
    """The mesh the CLI options ask for, or None for one device (a malformed mesh, or one
    larger than the devices present, exits with one `error:` line)."""
    if getattr(args, "distributed", False):
        initialize_distributed()
    if not (args.mesh or args.devices):
        return None
    if args.mesh and args.devices:
        cli.fail("give --devices or --mesh, not both")
    try:
        sizes = sharding.parse_mesh(args.mesh) if args.mesh else {"data": 1, "tp": args.devices}
        return sharding.make_mesh(**sizes)
    except ValueError as e:
        cli.fail(str(e))


def load_params(source, config, dtype, seed: int, mesh):
    """The weights of checkpoint `source` (None: random weights of `config`, drawn with
    `seed`), each created or read straight into its shard on `mesh`. Raises
    sharding.ShardingError when the mesh does not divide the heads and neurons."""
    if source is None:
        return sharding.init_params_sharded(config, jax.random.key(seed), dtype, mesh)
    from dejavu_jax.sharded_loading import load_pretrained_sharded
    return load_pretrained_sharded(source, mesh, dtype)[1]


def build_engine(config, params, scfg, predictors, select_method: str, mesh):
    """(engine, engine params) on `mesh`: the dense engine when `scfg` is None, else the
    sparse one with decode-form `predictors` (None: the oracle, `scfg.oracle`) selecting by
    `select_method` (one of `sparse.SELECT_METHODS`)."""
    from dejavu_jax import sparse
    if scfg is None:
        return tp_decode.tp_dense_engine(config, mesh), params
    if scfg.oracle:
        select = sparse.no_selector
    else:
        select = sparse.predictor_selector(config.group_size, method=select_method)
        predictors = tp_decode.shard_predictors(predictors, mesh)
    return tp_decode.tp_sparse_engine(config, scfg, select, mesh), (params, predictors)
