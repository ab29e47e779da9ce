"""Model configuration: one frozen dataclass for the OPT and Llama families.

A config is hashable, so jitted functions take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

FAMILIES = ("opt", "llama")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer.

    family: "opt" (learned positions, LayerNorm, ReLU MLP, biases) or
      "llama" (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention).
    hidden: residual width d.  ffn: MLP width F.  head_dim * n_heads need not
      equal hidden for llama-family models.
    embed_dim: width of the token embedding; OPT's word_embed_proj_dim. When it
      differs from hidden, project_in/project_out map between them.
    """

    family: str
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    max_positions: int
    embed_dim: int
    norm_eps: float
    pre_norm: bool = True
    final_norm: bool = True
    activation: str = "relu"
    gated_mlp: bool = False
    attention_bias: bool = True
    mlp_bias: bool = True
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | None = 2
    pad_token_id: int | None = 1
    name: str = "custom"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; supported: {FAMILIES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ("relu", "silu", "gelu"):
            raise ValueError(f"unsupported activation {self.activation!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def has_projections(self) -> bool:
        """Whether the embedding width differs from the residual width."""
        return self.embed_dim != self.hidden

    def fingerprint(self) -> str:
        """A short stable hash of the config, for manifests of derived artifacts."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def from_hf_config(hf: dict, name: str = "custom") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict (OPT or Llama)."""
    model_type = hf.get("model_type")
    if model_type == "opt":
        return _opt_from_hf(hf, name)
    if model_type in ("llama", "mistral", "qwen2"):
        return _llama_from_hf(hf, name)
    raise ValueError(
        f"unknown model_type {model_type!r} in config.json (model {name!r}); "
        "supported: 'opt', 'llama'")


def _opt_from_hf(hf: dict, name: str) -> ModelConfig:
    act = hf.get("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise ValueError(f"OPT activation_function {act!r} is not supported (model {name!r})")
    hidden = hf["hidden_size"]
    n_heads = hf["num_attention_heads"]
    if hidden % n_heads:
        raise ValueError(f"hidden_size {hidden} not divisible by num_attention_heads {n_heads}")
    pre_norm = hf.get("do_layer_norm_before", True)
    return ModelConfig(
        family="opt",
        vocab_size=hf["vocab_size"],
        hidden=hidden,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=hidden // n_heads,
        ffn=hf["ffn_dim"],
        max_positions=hf.get("max_position_embeddings", 2048),
        embed_dim=hf.get("word_embed_proj_dim", hidden) or hidden,
        norm_eps=1e-5,
        pre_norm=pre_norm,
        final_norm=pre_norm and not hf.get("_remove_final_layer_norm", False),
        activation=act,
        gated_mlp=False,
        attention_bias=hf.get("enable_bias", True),
        mlp_bias=hf.get("enable_bias", True),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=hf.get("eos_token_id", 2),
        pad_token_id=hf.get("pad_token_id", 1),
        name=name,
    )


def _llama_from_hf(hf: dict, name: str) -> ModelConfig:
    rope_scaling = hf.get("rope_scaling") or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (model {name!r})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Llama hidden_act {act!r} is not supported (model {name!r})")
    hidden = hf["hidden_size"]
    n_heads = hf["num_attention_heads"]
    rope_params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    return ModelConfig(
        family="llama",
        vocab_size=hf["vocab_size"],
        hidden=hidden,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hidden // n_heads,
        ffn=hf["intermediate_size"],
        max_positions=hf.get("max_position_embeddings", 2048),
        embed_dim=hidden,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        pre_norm=True,
        final_norm=True,
        activation="silu",
        gated_mlp=True,
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        rope_theta=float(theta),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=hf.get("pad_token_id"),
        name=name,
    )


def _opt_preset(name, hidden, n_layers, n_heads, ffn=None, embed_dim=None, pre_norm=True):
    return ModelConfig(
        family="opt", vocab_size=50272, hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_heads, head_dim=hidden // n_heads, ffn=ffn or 4 * hidden,
        max_positions=2048, embed_dim=embed_dim or hidden, norm_eps=1e-5,
        pre_norm=pre_norm, final_norm=pre_norm, name=name)


PRESETS: dict[str, ModelConfig] = {
    "opt-tiny": ModelConfig(
        family="opt", vocab_size=50272, hidden=64, n_layers=4, n_heads=4, n_kv_heads=4,
        head_dim=16, ffn=256, max_positions=2048, embed_dim=64, norm_eps=1e-5,
        name="opt-tiny"),
    "opt-125m": _opt_preset("opt-125m", 768, 12, 12),
    "opt-350m": _opt_preset("opt-350m", 1024, 24, 16, embed_dim=512, pre_norm=False),
    "opt-1.3b": _opt_preset("opt-1.3b", 2048, 24, 32),
    "opt-2.7b": _opt_preset("opt-2.7b", 2560, 32, 32),
    "opt-6.7b": _opt_preset("opt-6.7b", 4096, 32, 32),
    "opt-13b": _opt_preset("opt-13b", 5120, 40, 40),
    "opt-30b": _opt_preset("opt-30b", 7168, 48, 56),
    "opt-66b": _opt_preset("opt-66b", 9216, 64, 72),
    "opt-175b": _opt_preset("opt-175b", 12288, 96, 96),
    "llama-tiny": ModelConfig(
        family="llama", vocab_size=49152, hidden=64, n_layers=4, n_heads=4, n_kv_heads=2,
        head_dim=16, ffn=160, max_positions=2048, embed_dim=64, norm_eps=1e-5,
        activation="silu", gated_mlp=True, attention_bias=False, mlp_bias=False,
        tie_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        name="llama-tiny"),
    "smollm2-135m": ModelConfig(
        family="llama", vocab_size=49152, hidden=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, ffn=1536, max_positions=8192, embed_dim=576, norm_eps=1e-5,
        activation="silu", gated_mlp=True, attention_bias=False, mlp_bias=False,
        rope_theta=100000.0, tie_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=None, name="smollm2-135m"),
}


def preset(name: str) -> ModelConfig:
    """The shape preset called `name` (see PRESETS); raises with the list when unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
