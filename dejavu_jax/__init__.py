"""dejavu_jax: DejaVu contextual sparsity for LLM decoding, in JAX and Pallas.

Public API:
  load_pretrained(path) -> (config, params)
  logits(config, params, input_ids, attention_mask=None) -> float32 [B, T, V]
  init_params(config, key, dtype) / preset(name) for random-weight models
  generate_tokens(engine, params, prompts, ...) with dense_engine(config)
"""

import os as _os

# In a checkout, the top-level kernels/, train/ and eval/ folders are this package's
# subpackages (an install maps them with setuptools' package-dir): adding the checkout's
# root to the package path lets `python -m dejavu_jax...` run from it with no install.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_root, sub, "__init__.py"))
       for sub in ("kernels", "train", "eval")):
    __path__.append(_root)

from dejavu_jax.config import PRESETS, ModelConfig, from_hf_config, preset
from dejavu_jax.generation import Engine, GenerationResult, dense_engine, generate_tokens
from dejavu_jax.loading import load_pretrained
from dejavu_jax.model import DecodeState, decode_step, init_state, logits, prefill
from dejavu_jax.params import LayerParams, ModelParams, decode_layout, init_params
from dejavu_jax.sampling import SamplingConfig

__all__ = [
    "PRESETS", "ModelConfig", "from_hf_config", "preset", "Engine", "GenerationResult",
    "dense_engine", "generate_tokens", "load_pretrained", "DecodeState", "decode_step",
    "init_state", "logits", "prefill", "LayerParams", "ModelParams", "decode_layout",
    "init_params",
    "SamplingConfig",
]
