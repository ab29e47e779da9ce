"""dejavu_jax: DejaVu contextual sparsity for LLM decoding, in JAX and Pallas.

Public API:
  load_pretrained(path) -> (config, params)
  logits(config, params, input_ids, attention_mask=None) -> float32 [B, T, V]
  init_params(config, key, dtype) / preset(name) for random-weight models
  generate_tokens(engine, params, prompts, ...) with dense_engine(config)
"""

from dejavu_jax.config import PRESETS, ModelConfig, from_hf_config, preset
from dejavu_jax.generation import Engine, GenerationResult, dense_engine, generate_tokens
from dejavu_jax.loading import load_pretrained
from dejavu_jax.model import DecodeState, decode_step, init_state, logits, prefill
from dejavu_jax.params import LayerParams, ModelParams, init_params
from dejavu_jax.sampling import SamplingConfig

__all__ = [
    "PRESETS", "ModelConfig", "from_hf_config", "preset", "Engine", "GenerationResult",
    "dense_engine", "generate_tokens", "load_pretrained", "DecodeState", "decode_step",
    "init_state", "logits", "prefill", "LayerParams", "ModelParams", "init_params",
    "SamplingConfig",
]
