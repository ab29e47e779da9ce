"""Loading Hugging Face (and GGUF) checkpoints into ModelParams.

Maps HF tensor names onto the stacked, sparse-friendly layouts of `params.py`:
q/k/v weights split per head, out-projection and fc2 stored transposed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dejavu_jax import ops
from dejavu_jax.checkpoint_files import CheckpointError, TensorSource, open_tensors
from dejavu_jax.cli import first_line
from dejavu_jax.config import ModelConfig, from_hf_config
from dejavu_jax.fused_tensors import split_fused_projections
from dejavu_jax.hf_values import check_token_ids, id_list
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
    "q_norm_scale": ("self_attn.q_norm.weight", _same),   # Qwen3's (config.qk_norm)
    "k_norm_scale": ("self_attn.k_norm.weight", _same),
}


def _gemma_norm(a, c):
    """Gemma's RMSNorm multiplies by 1 + w; our norms take the factor itself."""
    return a.astype(np.float32) + 1.0


GEMMA3_TOP = {**LLAMA_TOP, "final_norm_scale": ("model.norm.weight", _gemma_norm)}
GEMMA3_LAYER = {
    **LLAMA_LAYER,
    "attn_norm_scale": ("input_layernorm.weight", _gemma_norm),
    "post_attn_norm_scale": ("post_attention_layernorm.weight", _gemma_norm),
    "mlp_norm_scale": ("pre_feedforward_layernorm.weight", _gemma_norm),
    "post_mlp_norm_scale": ("post_feedforward_layernorm.weight", _gemma_norm),
    "q_norm_scale": ("self_attn.q_norm.weight", _gemma_norm),
    "k_norm_scale": ("self_attn.k_norm.weight", _gemma_norm),
}
GEMMA_LAYER = {**LLAMA_LAYER,
               "attn_norm_scale": ("input_layernorm.weight", _gemma_norm),
               "mlp_norm_scale": ("post_attention_layernorm.weight", _gemma_norm)}
LAYER_PREFIX = {"opt": "decoder.layers.{i}.", "llama": "model.layers.{i}.",
                "qwen2": "model.layers.{i}.", "gemma": "model.layers.{i}.",
                "gemma3": "model.layers.{i}."}
# Hugging Face names of a family's tensors, by ModelParams / LayerParams leaf
NAME_SPECS = {"opt": (OPT_TOP, OPT_LAYER), "llama": (LLAMA_TOP, LLAMA_LAYER),
              "qwen2": (LLAMA_TOP, LLAMA_LAYER), "gemma": (GEMMA3_TOP, GEMMA_LAYER),
              "gemma3": (GEMMA3_TOP, GEMMA3_LAYER)}
# a multimodal Gemma 3 checkpoint's text tensors sit under one of these prefixes
_GEMMA3_TEXT_PREFIXES = (("model.language_model.", "model."),
                         ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."))


def _canonical_opt_names(source: TensorSource) -> dict[str, str]:
    """Map canonical `decoder.*` / `lm_head.*` names to the file's own key names."""
    names = {}
    for key in source.keys():
        canon = key[len("model."):] if key.startswith("model.") else key
        names[canon] = key
    return names


def canonical_names(config: ModelConfig, source: TensorSource) -> dict[str, str]:
    """Map the names `NAME_SPECS` uses to the file's own key names."""
    if config.family == "opt":
        return _canonical_opt_names(source)
    names = {k: k for k in source.keys()}
    if config.family == "gemma3":
        for key in source.keys():
            for prefix, canon in _GEMMA3_TEXT_PREFIXES:
                if key.startswith(prefix):
                    names[canon + key[len(prefix):]] = key
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
    names = canonical_names(config, source)
    top_spec, layer_spec = NAME_SPECS[config.family]
    np_dtype = _numpy_dtype(dtype)
    origin = next(iter(source.keys()), None)
    origin_file = source.file_of(origin) if origin else "<empty checkpoint>"

    refuse_unused_layer_tensors(config, names, origin_file)

    def fetch(canon: str, transform: Transform, want: tuple[int, ...]) -> np.ndarray:
        key = names.get(canon)
        if key is None:
            raise CheckpointError(f"{origin_file}: missing tensor {canon!r} for "
                                  f"{config.family} model {config.name!r}")
        raw = np.asarray(source.get(key))
        arr = transform(raw, config)
        if tuple(arr.shape) != tuple(want):
            raise CheckpointError(
                f"{source.file_of(key)}: tensor {key!r} has shape {tuple(raw.shape)},"
                f" which does not fit the config (expected {want} after layout change)")
        return arr.astype(np_dtype, copy=False)

    top = {}
    for name, shape in model_shapes(config).items():
        if shape is None:
            top[name] = None
            continue
        canon, transform = top_spec[name]
        top[name] = jax.device_put(fetch(canon, transform, shape))

    layers = {}
    prefix = LAYER_PREFIX[config.family]
    specs = [(n, s) for n, s in layer_shapes(config).items()]
    with tqdm(total=len(specs), desc=f"loading {config.name}", disable=not progress,
              unit="tensor") as bar:  # closed before an error is reported
        for name, shape in specs:
            bar.update()
            if shape is None:
                layers[name] = None
                continue
            suffix, transform = layer_spec[name]
            stacked = np.empty(shape, np_dtype)  # filled by layer: one host copy at most
            for i in range(config.n_layers):
                stacked[i] = in_rotary_order(config, name,
                                             fetch(prefix.format(i=i) + suffix, transform,
                                                   shape[1:]))
            layers[name] = jax.device_put(stacked)
            del stacked
    return ModelParams(layers=LayerParams(**layers), **top)


# the head-dimension axis of one layer's tensors that RoPE rotates
_ROTATED_HEAD_AXIS = {"wq": 1, "bq": 1, "wk": 1, "bk": 1, "q_norm_scale": 0,
                      "k_norm_scale": 0}


def in_rotary_order(config: ModelConfig, name: str, tensor: np.ndarray) -> np.ndarray:
    """One layer's `name` tensor with each query and key head in `ops.rotary_order` for a
    model whose RoPE rotates part of each head (`ModelConfig.rotary_dim`); else as given."""
    if config.rotary_dim is None or config.rotary_dim == config.head_dim \
            or name not in _ROTATED_HEAD_AXIS:
        return tensor
    order = ops.rotary_order(config.head_dim, config.rotary_dim)
    return np.take(tensor, order, axis=_ROTATED_HEAD_AXIS[name])


# per-layer tensors a checkpoint may hold that the math does not read
_IGNORED_LAYER_SUFFIXES = ("rotary_emb.inv_freq",)


def refuse_unused_layer_tensors(config: ModelConfig, names: dict[str, str],
                                origin_file: str) -> None:
    """Raise CheckpointError when the checkpoint's decoder layers hold tensors the config
    gives no place (a bias or norm this model definition lacks): loading without them would
    give other logits than the checkpoint's own model. `names`: `canonical_names`."""
    prefix = LAYER_PREFIX[config.family]
    layer_spec = NAME_SPECS[config.family][1]
    used = {prefix.format(i=i) + layer_spec[name][0]
            for name, shape in layer_shapes(config).items() if shape is not None
            for i in range(config.n_layers)}
    pattern = re.compile(re.escape(prefix).replace(r"\{i\}", r"\d+"))
    unused = sorted(c for c in names if pattern.match(c) and c not in used
                    and not c.endswith(_IGNORED_LAYER_SUFFIXES))
    if unused:
        shown = ", ".join(repr(names[c]) for c in unused[:3])
        raise CheckpointError(
            f"{origin_file}: {len(unused)} layer tensors that a {config.family} model with "
            f"this config does not use ({shown}{', ...' if len(unused) > 3 else ''}): "
            "the checkpoint holds parts this model definition lacks")


def hub_id(path_or_id: str | os.PathLike) -> str | None:
    """The text as a Hugging Face hub id ('org/name') when it names no local file or
    folder and has that form, else None."""
    text = str(path_or_id)
    if Path(text).expanduser().exists():
        return None
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return text
    return None


def _resolve_directory(path_or_id: str | os.PathLike) -> Path:
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    from dejavu_jax.fetch_model import resolve_model
    if (resolved := resolve_model(str(path_or_id))) != str(path_or_id):
        return Path(resolved)  # a registered model name: its cached file
    text = hub_id(path_or_id)
    if text is not None:
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(
                text, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt",
                                      "tokenizer*", "vocab*", "merges*"]))
        except Exception as e:  # network errors come in many types, and many lines
            reason = first_line(e)
            raise CheckpointError(
                f"{text!r} is not a local path, and downloading it from the Hugging Face hub "
                f"failed: {type(e).__name__}: {reason}") from None
    raise CheckpointError(f"{path_or_id}: no such file or directory")


def default_dtype():
    """float32 on CPU (exact, and fast there), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _hf_directory_config(location: Path) -> ModelConfig:
    config_path = location / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    config = _config_from(hf_config, location.name, config_path)
    return _with_generation_end_ids(config, location / "generation_config.json")


def _with_generation_end_ids(config: ModelConfig, path: Path) -> ModelConfig:
    """`config` with the end-of-sequence ids of the checkpoint's generation_config.json
    (instruct models list their end-of-turn id there) among its stop ids; CheckpointError
    for a file that is not a JSON object or whose ids are not ids."""
    if not path.exists():
        return config
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    ids = settings.get("eos_token_id")
    try:
        check_token_ids("eos_token_id", ids)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    extra = [i for i in dict.fromkeys(id_list(ids)) if i not in config.stop_token_ids]
    if not extra:
        return config
    if config.eos_token_id is None:
        return config.replace(eos_token_id=extra[0], extra_eos_token_ids=tuple(extra[1:]))
    return config.replace(extra_eos_token_ids=config.extra_eos_token_ids + tuple(extra))


def _config_from(hf_config: dict, name: str, origin: Path) -> ModelConfig:
    try:
        return from_hf_config(hf_config, name=name)
    except (ValueError, KeyError, TypeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{origin}: {what}") from None


def _is_gguf(location: Path) -> bool:
    return location.is_file() and location.suffix == ".gguf"


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint (a HF directory, a hub id or a .gguf file), read
    without its weights: from config.json, or from the GGUF metadata.

    Raises CheckpointError naming the file for anything missing or unreadable.
    """
    location = _resolve_directory(path)
    if _is_gguf(location):
        from dejavu_jax.gguf_loader import gguf_config
        return _config_from(gguf_config(location), location.stem, location)
    if location.is_file():
        raise CheckpointError(f"{location}: expected a checkpoint directory or a .gguf file")
    return _hf_directory_config(location)


def open_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, TensorSource]:
    """(config, tensors) of a HF directory (config.json + weights), a hub id, or a .gguf file.

    Nothing is loaded yet: tensors are read on demand (memory-mapped where possible; GGUF
    tensors are dequantised when read). Raises CheckpointError naming the file for anything
    missing or unreadable.
    """
    location = _resolve_directory(path)
    if _is_gguf(location):
        from dejavu_jax.gguf_loader import open_gguf
        hf_config, tensors = open_gguf(location)
        config = _config_from(hf_config, location.stem, location)
        return config, split_fused_projections(config, tensors)
    config = read_config(location)
    return config, split_fused_projections(config, open_tensors(location))


def load_pretrained(path: str | os.PathLike, dtype=None,
                    progress: bool = True) -> tuple[ModelConfig, ModelParams]:
    """Load a checkpoint: a HF directory (config.json + weights), a hub id, or a .gguf file.

    Returns (config, params). `dtype` defaults to float32 on CPU and bfloat16 on GPU.
    """
    config, tensors = open_checkpoint(path)
    return config, params_from_tensors(config, tensors, dtype or default_dtype(), progress)
