"""The MLP blocks of dense layers that run through the kernels over stacked weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import dejavu_jax as dj
from dejavu_jax import kernels, model, sparse
from conftest import assert_finite_close


def test_in_place_dense_config_narrows_only_unset_fc2_columns():
    config = dj.preset("opt-tiny")
    scfg = sparse.sparse_config(config, 0.3, 0.5, dense_layers=1)
    got = sparse.in_place_dense_config(scfg).mlp_config
    assert got == dataclasses.replace(kernels.MLPConfig(),
                                      fc2_block_d=sparse.IN_PLACE_DENSE_FC2_BLOCK_D)
    assert scfg.mlp_config is None        # the sparse layers' config is left as it was
    warps = dataclasses.replace(scfg, mlp_config=kernels.MLPConfig(num_warps=8))
    assert sparse.in_place_dense_config(warps).mlp_config == kernels.MLPConfig(
        num_warps=8, fc2_block_d=sparse.IN_PLACE_DENSE_FC2_BLOCK_D)
    explicit = dataclasses.replace(scfg, mlp_config=kernels.MLPConfig(fc2_block_d=512))
    assert sparse.in_place_dense_config(explicit).mlp_config.fc2_block_d == 512


def test_dense_layers_in_place_get_narrow_fc2_blocks_and_the_dense_logits(monkeypatch):
    """Over stacked weights on the interpreted kernels, the dense layers' MLP calls get the
    narrow fc2 column blocks and the sparse layers' the configured ones; the all-dense step
    gives the dense model's logits."""
    config = dj.preset("opt-tiny").replace(n_layers=3)
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    seen = []
    real = sparse.kernels.sparse_mlp
    monkeypatch.setattr(sparse.kernels, "sparse_mlp", lambda *a, **kw: seen.append(
        (a[5].shape[-1], kw["config"])) or real(*a, **kw))

    scfg = sparse.sparse_config(config, 0.25, 0.5, dense_layers=1, impl="interpret")
    sets = (jnp.tile(jnp.arange(64, dtype=jnp.int32)[None], (3, 1)),
            jnp.tile(jnp.arange(2, dtype=jnp.int32)[None], (3, 1)))
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    ids = jnp.asarray([[5, 9, 14, 3]])
    state = eng.init_state(1, 16, jnp.float32)
    _, state = jax.jit(eng.prefill)((params, sets), ids, jnp.ones_like(ids), state)
    jax.jit(eng.step)((params, sets), state, jnp.asarray([42]))
    by_rows = {rows: cfg for rows, cfg in seen}
    assert by_rows[config.ffn].fc2_block_d == sparse.IN_PLACE_DENSE_FC2_BLOCK_D
    assert by_rows[64] is None

    dense_cfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=config.n_layers,
                                     impl="interpret")
    eng = sparse.sparse_engine(config, dense_cfg, sparse.fixed_selector)
    state = eng.init_state(1, 16, jnp.float32)
    d_state = model.init_state(config, 1, 16, jnp.float32)
    _, state = jax.jit(eng.prefill)((params, sets), ids, jnp.ones_like(ids), state)
    _, d_state = model.prefill(config, params, ids, jnp.ones_like(ids), d_state)
    for tok in (42, 7):
        got, state = jax.jit(eng.step)((params, sets), state, jnp.asarray([tok]))
        want, d_state = model.decode_step(config, params, d_state, jnp.asarray([tok]))
        assert np.isfinite(np.asarray(got)).all()
        assert_finite_close(got, want, atol=2e-5)
