"""The MLP blocks of dense layers that run through the kernels over stacked weights (their
calls in a decode step: test_sparse.py, test_stacked_dense_layers_run_in_place_...)."""

import dataclasses

import dejavu_jax as dj
from dejavu_jax import kernels, sparse


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



def test_the_dense_loop_over_stacked_weights_decodes_like_the_dense_engine():
    """The README's dense loop over stacked weights (the sparse engine, every layer dense,
    no selector) through the interpreted kernels: the dense engine's greedy ids."""
    import jax
    import jax.numpy as jnp
    config = dj.preset("opt-tiny").replace(n_layers=2, vocab_size=512)
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.3)
    scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=config.n_layers,
                                impl="interpret")
    engine = sparse.sparse_engine(config, scfg, sparse.no_selector)
    got = dj.generate_tokens(engine, (params, None), [[5, 9, 14]], max_new_tokens=4,
                             stop_ids=[])
    want = dj.generate_tokens(dj.dense_engine(config), params, [[5, 9, 14]],
                              max_new_tokens=4, stop_ids=[])
    assert got.tokens == want.tokens and len(set(want.tokens[0])) > 1
