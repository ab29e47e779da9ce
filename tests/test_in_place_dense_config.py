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

