"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


FLOAT32_MAX = float(np.finfo(np.float32).max)   # the logits are divided in float32


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature must be >= 0 and finite in float32 (at most "
                             f"{FLOAT32_MAX:.4g}), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Pick one token per row from fp32 logits [B, V]; returns int32 [B]."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32)
    # the best logit at 0 before scaling and kept there: a tiny temperature gives -inf,
    # never inf - inf, and one flushed to 0 never 0 / 0
    centered = logits - logits.max(axis=-1, keepdims=True)
    logits = jnp.where(centered == 0, 0.0, centered / cfg.temperature)
    if cfg.top_k:
        kth = jax.lax.top_k(logits, min(cfg.top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # the most likely token is always kept: a top_p that float32 rounds to 0 keeps it
        # alone, as any top_p below its probability does
        first = jnp.arange(logits.shape[-1]) == 0
        sorted_logits = jnp.where((mass_before < cfg.top_p) | first, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
