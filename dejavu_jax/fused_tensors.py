"""Checkpoints that store a layer's q/k/v or gate/up projections as one tensor (Phi-3's
`qkv_proj` and `gate_up_proj`): their rows, split into the per-projection names the
loaders read (`self_attn.q_proj.weight` ..., `mlp.gate_proj.weight`, `mlp.up_proj.weight`).

A split tensor is read whole when one of its parts is asked for, and the part's rows
copied out; the other names of a checkpoint pass through unchanged.
"""
from __future__ import annotations

import numpy as np

from dejavu_jax.checkpoint_files import CheckpointError, TensorSource
from dejavu_jax.config import ModelConfig

QKV = "self_attn.qkv_proj.weight"
GATE_UP = "mlp.gate_up_proj.weight"


def _parts(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """{fused suffix: [(part suffix, rows), ...]} in the fused tensor's row order."""
    hd = config.head_dim
    return {QKV: [("self_attn.q_proj.weight", config.n_heads * hd),
                  ("self_attn.k_proj.weight", config.n_kv_heads * hd),
                  ("self_attn.v_proj.weight", config.n_kv_heads * hd)],
            GATE_UP: [("mlp.gate_proj.weight", config.ffn), ("mlp.up_proj.weight", config.ffn)]}


def split_fused_projections(config: ModelConfig, source: TensorSource) -> TensorSource:
    """`source` with each fused q/k/v and gate/up tensor replaced by its parts (unchanged
    when it holds none). CheckpointError, naming the file, when a fused tensor's rows are
    not the sum of its parts' (another model's tensor)."""
    fused = {key: suffix for key in source.keys() for suffix in _parts(config)
             if key.endswith("." + suffix)}
    if not fused:
        return source
    index, origin = {}, {}
    for key in source.keys():
        if key not in fused:
            index[key] = source.file_of(key)
            continue
        stem = key[:-len(fused[key])]
        start = 0
        for part, rows in _parts(config)[fused[key]]:
            index[stem + part] = source.file_of(key)
            origin[stem + part] = (key, start, start + rows)
            start += rows

    def read(name: str, _path) -> np.ndarray:
        if name not in origin:
            return source.get(name)
        key, start, stop = origin[name]
        whole = source.get(key)
        if whole.ndim != 2 or whole.shape[0] != _total_rows(config, fused[key]):
            raise CheckpointError(
                f"{source.file_of(key)}: {key} has shape {tuple(whole.shape)}, expected "
                f"{_total_rows(config, fused[key])} rows (the config's "
                f"{'q, k and v' if fused[key] == QKV else 'gate and up'} projections)")
        return np.ascontiguousarray(whole[start:stop])

    return TensorSource(index, read)


def _total_rows(config: ModelConfig, suffix: str) -> int:
    return sum(rows for _, rows in _parts(config)[suffix])
