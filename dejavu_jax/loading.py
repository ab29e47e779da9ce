"""Loading Hugging Face (and GGUF) checkpoints into ModelParams.

Maps HF tensor names onto the stacked, sparse-friendly layouts of `params.py`:
q/k/v weights split per head, out-projection and fc2 stored transposed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dejavu_jax.checkpoint_files import CheckpointError, DictSource, TensorSource, open_tensors
from dejavu_jax.config import ModelConfig, from_hf_config
from dejavu_jax.params import LayerParams, ModelParams, layer_shapes, model_shapes

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _same(a, c):
    return a


def _per_head_rows(a, c):
    """[n*hd, d] (or bias [n*hd]) -> [n, hd, d] ([n, hd])."""
    return a.reshape(-1, c.head_dim, *a.shape[1:])


def _per_head_columns(a, c):
    """out_proj weight [d, H*hd] -> [d, H, hd] (a free reshape)."""
    return a.reshape(a.shape[0], -1, c.head_dim)


def _transposed(a, c):
    return a.T


OPT_TOP = {
    "embed": ("decoder.embed_tokens.weight", _same),
    "pos_embed": ("decoder.embed_positions.weight", _same),
    "project_in": ("decoder.project_in.weight", _same),
    "project_out": ("decoder.project_out.weight", _same),
    "final_norm_scale": ("decoder.final_layer_norm.weight", _same),
    "final_norm_bias": ("decoder.final_layer_norm.bias", _same),
    "lm_head": ("lm_head.weight", _same),
}
OPT_LAYER = {
    "attn_norm_scale": ("self_attn_layer_norm.weight", _same),
    "attn_norm_bias": ("self_attn_layer_norm.bias", _same),
    "wq": ("self_attn.q_proj.weight", _per_head_rows),
    "bq": ("self_attn.q_proj.bias", _per_head_rows),
    "wk": ("self_attn.k_proj.weight", _per_head_rows),
    "bk": ("self_attn.k_proj.bias", _per_head_rows),
    "wv": ("self_attn.v_proj.weight", _per_head_rows),
    "bv": ("self_attn.v_proj.bias", _per_head_rows),
    "wo": ("self_attn.out_proj.weight", _per_head_columns),
    "bo": ("self_attn.out_proj.bias", _same),
    "mlp_norm_scale": ("final_layer_norm.weight", _same),
    "mlp_norm_bias": ("final_layer_norm.bias", _same),
    "w_in": ("fc1.weight", _same),
    "b_in": ("fc1.bias", _same),
    "w_out_t": ("fc2.weight", _transposed),
    "b_out": ("fc2.bias", _same),
}
LLAMA_TOP = {
    "embed": ("model.embed_tokens.weight", _same),
    "final_norm_scale": ("model.norm.weight", _same),
    "lm_head": ("lm_head.weight", _same),
}
LLAMA_LAYER = {
    "attn_norm_scale": ("input_layernorm.weight", _same),
    "wq": ("self_attn.q_proj.weight", _per_head_rows),
    "bq": ("self_attn.q_proj.bias", _per_head_rows),
    "wk": ("self_attn.k_proj.weight", _per_head_rows),
    "bk": ("self_attn.k_proj.bias", _per_head_rows),
    "wv": ("self_attn.v_proj.weight", _per_head_rows),
    "bv": ("self_attn.v_proj.bias", _per_head_rows),
    "wo": ("self_attn.o_proj.weight", _per_head_columns),
    "bo": ("self_attn.o_proj.bias", _same),
    "mlp_norm_scale": ("post_attention_layernorm.weight", _same),
    "w_in": ("mlp.up_proj.weight", _same),
    "w_gate": ("mlp.gate_proj.weight", _same),
    "w_out_t": ("mlp.down_proj.weight", _transposed),
    "b_in": ("mlp.up_proj.bias", _same),
    "b_out": ("mlp.down_proj.bias", _same),
}
LAYER_PREFIX = {"opt": "decoder.layers.{i}.", "llama": "model.layers.{i}."}


def _canonical_opt_names(source: TensorSource) -> dict[str, str]:
    """Map canonical `decoder.*` / `lm_head.*` names to the file's own key names."""
    names = {}
    for key in source.keys():
        canon = key[len("model."):] if key.startswith("model.") else key
        names[canon] = key
    return names


def _numpy_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def params_from_tensors(config: ModelConfig, source: TensorSource, dtype=jnp.float32,
                        progress: bool = True) -> ModelParams:
    """Build ModelParams from HF-named tensors, checking every name and shape.

    Raises CheckpointError naming the file and key for a missing tensor or a shape
    mismatch.
    """
    if config.family == "opt":
        names = _canonical_opt_names(source)
        top_spec, layer_spec = OPT_TOP, OPT_LAYER
    else:
        names = {k: k for k in source.keys()}
        top_spec, layer_spec = LLAMA_TOP, LLAMA_LAYER
    np_dtype = _numpy_dtype(dtype)
    origin = next(iter(source.keys()), None)
    origin_file = source.file_of(origin) if origin else "<empty checkpoint>"

    def fetch(canon: str, transform: Transform, want: tuple[int, ...]) -> np.ndarray:
        key = names.get(canon)
        if key is None:
            raise CheckpointError(f"{origin_file}: missing tensor {canon!r} for "
                                  f"{config.family} model {config.name!r}")
        arr = transform(np.asarray(source.get(key)), config)
        if tuple(arr.shape) != tuple(want):
            raise CheckpointError(
                f"{source.file_of(key)}: tensor {key!r} has shape {tuple(source.get(key).shape)},"
                f" which does not fit the config (expected {want} after layout change)")
        return arr.astype(np_dtype)

    top = {}
    for name, shape in model_shapes(config).items():
        if shape is None:
            top[name] = None
            continue
        canon, transform = top_spec[name]
        top[name] = jnp.asarray(fetch(canon, transform, shape))

    layers = {}
    prefix = LAYER_PREFIX[config.family]
    specs = [(n, s) for n, s in layer_shapes(config).items()]
    bar = tqdm(total=len(specs), desc=f"loading {config.name}", disable=not progress,
               unit="tensor")
    for name, shape in specs:
        bar.update()
        if shape is None:
            layers[name] = None
            continue
        suffix, transform = layer_spec[name]
        per_layer = [fetch(prefix.format(i=i) + suffix, transform, shape[1:])
                     for i in range(config.n_layers)]
        layers[name] = jnp.asarray(np.stack(per_layer))
    bar.close()
    return ModelParams(layers=LayerParams(**layers), **top)


def _resolve_directory(path_or_id: str | os.PathLike) -> Path:
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_id)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(
                text, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt",
                                      "tokenizer*", "vocab*", "merges*"]))
        except Exception as e:  # network errors come in many types
            raise CheckpointError(
                f"{text!r} is not a local path, and downloading it from the Hugging Face hub "
                f"failed: {type(e).__name__}: {e}") from None
    raise CheckpointError(f"{text}: no such file or directory")


def default_dtype():
    """float32 on CPU (exact, and fast there), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def open_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, TensorSource]:
    """(config, tensors) of a HF directory (config.json + weights), a hub id, or a .gguf file.

    Nothing is loaded yet: tensors are read (memory-mapped where possible) on demand.
    """
    location = _resolve_directory(path)
    if location.is_file() and location.suffix == ".gguf":
        from dejavu_jax.gguf_loader import load_gguf
        hf_config, tensors = load_gguf(location)
        try:
            return from_hf_config(hf_config, name=location.stem), DictSource(tensors, location)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{location}: {e}") from None
    if location.is_file():
        raise CheckpointError(f"{location}: expected a checkpoint directory or a .gguf file")
    config_path = location / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: invalid JSON ({e})") from None
    try:
        config = from_hf_config(hf_config, name=location.name)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{config_path}: {e}") from None
    return config, open_tensors(location)


def load_pretrained(path: str | os.PathLike, dtype=None,
                    progress: bool = True) -> tuple[ModelConfig, ModelParams]:
    """Load a checkpoint: a HF directory (config.json + weights), a hub id, or a .gguf file.

    Returns (config, params). `dtype` defaults to float32 on CPU and bfloat16 on GPU.
    """
    config, tensors = open_checkpoint(path)
    return config, params_from_tensors(config, tensors, dtype or default_dtype(), progress)
