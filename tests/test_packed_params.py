"""Packed small per-layer arrays: fewer buffers, the same decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax.generation import dense_engine
from dejavu_jax.packed_params import pack_small, unpack_small
from dejavu_jax.params import fuse_qkv, unstack_layers


@pytest.mark.parametrize("name", ["opt-tiny", "llama-tiny"])
def test_packed_params_decode_the_same_logits_from_fewer_buffers(name):
    """A jitted step of the packed params (unpacked inside) gives the per-layer params'
    logits exactly, from fewer buffers: only the arrays above the size limit stay per
    layer."""
    config = dj.preset(name)
    params = unstack_layers(fuse_qkv(dj.init_params(config, jax.random.key(0), jnp.float32)))
    limit = 4 * config.hidden * 4      # a few rows of floats: norms and biases, no matrix
    packed = pack_small(params, max_bytes=limit)
    per_layer = [a for a in jax.tree.leaves(params.layers)]
    kept = [a for a in jax.tree.leaves(packed[0].layers)]
    assert all(a.size * a.dtype.itemsize > limit for a in kept)
    assert len(kept) + config.n_layers * len(packed[1]) == len(per_layer)
    assert len(jax.tree.leaves(packed)) < len(jax.tree.leaves(params)) - config.n_layers
    engine = dense_engine(config)
    ids = jnp.asarray([[5, 9, 13, 2]], jnp.int32)
    outputs = []
    for run_params, unpack in ((params, lambda p: p), (packed, unpack_small)):
        state = engine.init_state(1, 16, jnp.float32, per_layer=True)
        prefill = jax.jit(lambda p, s: engine.prefill(unpack(p), ids, jnp.ones_like(ids), s))
        step = jax.jit(lambda p, s, t: engine.step(unpack(p), s, t))
        logits, state = prefill(run_params, state)
        tokens = jnp.argmax(logits, -1).astype(jnp.int32)
        steps = [logits]
        for _ in range(3):
            logits, state = step(run_params, state, tokens)
            tokens = jnp.argmax(logits, -1).astype(jnp.int32)
            steps.append(logits)
        outputs.append(np.stack([np.asarray(s) for s in steps]))
    assert np.isfinite(outputs[0]).all()
    np.testing.assert_array_equal(outputs[1], outputs[0])
    with pytest.raises(ValueError, match="per-layer"):
        pack_small(fuse_qkv(dj.init_params(config, jax.random.key(0), jnp.float32)))
