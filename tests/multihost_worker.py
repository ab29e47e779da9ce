"""One process of the two-process tensor-parallel check in test_sharding.py.

  python tests/multihost_worker.py PROCESS_ID N_PROCESSES PORT CHECKPOINT OUT.npy

Each process has 2 fake CPU devices; jax.distributed joins them into one mesh
(tp = all devices), the checkpoint is loaded straight into the shards (each process
reads only its own devices' slices), and process 0 saves the prefill and first-step
logits gathered from all processes.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

pid, n, port, checkpoint, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                 sys.argv[4], sys.argv[5])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                           process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from dejavu_jax import sharding, tp_decode  # noqa: E402
from dejavu_jax.sharded_loading import load_pretrained_sharded  # noqa: E402

assert jax.device_count() == 2 * n and jax.local_device_count() == 2
mesh = sharding.make_mesh(tp=jax.device_count())
config, params = load_pretrained_sharded(checkpoint, mesh, jnp.float32)
assert not params.layers.w_in.is_fully_addressable
engine = tp_decode.tp_dense_engine(config, mesh)
ids = jnp.asarray([[5, 9, 14, 3]])
state = engine.init_state(1, 16, jnp.float32)
first, state = jax.jit(engine.prefill)(params, ids, jnp.ones_like(ids), state)
second, state = jax.jit(engine.step)(params, state, jnp.asarray([7]))
logits = multihost_utils.process_allgather((first, second), tiled=True)
if pid == 0:
    np.save(out, np.stack([np.asarray(a) for a in logits]))
