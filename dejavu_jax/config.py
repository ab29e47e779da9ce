"""Model configuration: one frozen dataclass for the OPT, Llama, Qwen2 and Gemma 3 families.

A config is hashable, so jitted functions take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from dejavu_jax.hf_values import check_hf_values, id_list

FAMILIES = ("opt", "llama", "qwen2", "gemma", "gemma3")
ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer.

    family: "opt" (learned positions, LayerNorm, ReLU MLP, biases), or a rotary family
      with RMSNorm and a gated MLP: "llama" (SwiGLU, grouped-query attention; also Mistral,
      Phi-3, and Qwen3 with q/k norms), "qwen2" (Llama with q/k/v biases), "gemma" (Gemma
      1: Llama's layout, GeGLU, norms multiplying by 1 + w, a scaled embedding) or "gemma3"
      (GeGLU, post-norms, sliding-window layers; Gemma 3 with q/k norms, Gemma 2 with
      soft-capped attention logits instead). The family picks the
      checkpoint's tensor names; the switches below pick the math, so every family runs
      the same model code.
    hidden: residual width d.  ffn: MLP width F.  head_dim * n_heads need not
      equal hidden for rotary models.
    embed_dim: width of the token embedding; OPT's word_embed_proj_dim. When it
      differs from hidden, project_in/project_out map between them.
    activation: "relu", "silu", "gelu" (exact erf) or "gelu_tanh" (tanh approximation).
    attention_bias: q/k/v (and, unless attention_out_bias says otherwise, output)
      projection biases. attention_out_bias: the output projection's bias (None: as
      attention_bias).
    qk_norm: RMSNorm over each head's query and key (weights shared by the heads), after
      the projection and before RoPE.
    post_norms: RMSNorm of each sublayer's output before the residual add (Gemma's
      post-attention and post-feedforward norms).
    embed_scale: token embeddings are multiplied by it, in the embedding's dtype.
    query_scale: the attention logits' scale (None: head_dim ** -0.5).
    sliding_window: tokens a sliding layer attends to, the current one included;
      sliding_layers: one flag per layer (empty when no layer slides).
    rope_theta: RoPE base of full-attention layers; rope_local_theta: of sliding layers
      (None: rope_theta). rope_linear_factor: full-attention layers divide positions by it.
    rope_llama3: Llama 3's frequency-dependent RoPE scaling (factor, low_freq_factor,
      high_freq_factor, original_max_position_embeddings), or None.
    rope_yarn: YaRN RoPE scaling (factor, attention_factor, beta_fast, beta_slow,
      original_max_position_embeddings, truncate as 1.0 or 0.0), or None: the frequencies
      blend interpolated and original ones by dimension, and the rotary tables are scaled
      by attention_factor.
    rope_dynamic: dynamic NTK RoPE, whose frequencies are the default ones up to
      max_positions (as transformers computes them there) and change past them; positions
      past max_positions are refused.
    rope_longrope: LongRoPE (Phi-3's 128k models) as (attention_factor,
      original_max_position_embeddings, one short factor per frequency..., one long factor
      per frequency...), or None: each frequency is divided by its short factor, or by its
      long one for a sequence longer than the original context, and the rotary tables are
      scaled by attention_factor, as transformers computes them (`generate_tokens`
      recomputes the cache where a sequence crosses the original context).
    final_logit_softcap: logits become cap * tanh(logits / cap) when set.
    attn_logit_softcap: the attention logits (after the query scale) likewise, before the
      softmax (Gemma 2).
    rotary_dim: the head dimensions RoPE rotates (Phi-3's partial_rotary_factor), or None
      for all of them. The others pass unrotated; in our weights each query and key head is
      laid out as (first rotary half, first pass half, second rotary half, second pass
      half), `ops.rotary_order`, so that rotating halves of the whole head rotates the
      rotary pairs only.
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
    attention_out_bias: bool | None = None
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float | None = None
    query_scale: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    rope_linear_factor: float = 1.0
    final_logit_softcap: float | None = None
    extra_eos_token_ids: tuple[int, ...] = ()   # further ids that end a sequence
    rope_llama3: tuple[float, float, float, float] | None = None
    rope_yarn: tuple[float, float, float, float, float, float] | None = None
    rope_dynamic: bool = False
    rope_longrope: tuple[float, ...] | None = None
    attn_logit_softcap: float | None = None
    rotary_dim: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; supported: {FAMILIES}")
        for field in _POSITIVE_SIZES:
            value = getattr(self, field)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"{field} must be a positive whole number, got {value!r}")
        _check_numbers(self)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}; "
                             f"supported: {ACTIVATIONS}")
        object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
        object.__setattr__(self, "extra_eos_token_ids",
                           tuple(int(i) for i in self.extra_eos_token_ids))
        if self.rope_llama3 is not None:
            object.__setattr__(self, "rope_llama3", tuple(float(v) for v in self.rope_llama3))
        if self.rope_yarn is not None:
            object.__setattr__(self, "rope_yarn", tuple(float(v) for v in self.rope_yarn))
        if self.rope_longrope is not None:
            object.__setattr__(self, "rope_longrope",
                               tuple(float(v) for v in self.rope_longrope))
            if len(self.rope_longrope) != 2 + self.rotated_dims:
                raise ValueError(f"LongRoPE needs one short and one long factor per frequency "
                                 f"({self.rotated_dims // 2} each), got "
                                 f"{len(self.rope_longrope) - 2} factors")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} flags for "
                             f"{self.n_layers} layers")
        if any(self.sliding_layers) and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding_layers needs a positive sliding_window")
        if self.family == "opt" and (self.qk_norm or self.post_norms or self.sliding_layers):
            raise ValueError("OPT models have no q/k norms, post-norms or sliding layers")

    @property
    def rotary(self) -> bool:
        """Whether positions enter through RoPE (every family but OPT)."""
        return self.family != "opt"

    @property
    def rotated_dims(self) -> int:
        """The head dimensions RoPE rotates: `rotary_dim`, else the whole head."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def layer_norm(self) -> bool:
        """LayerNorm with a bias (OPT), else RMSNorm."""
        return self.family == "opt"

    @property
    def out_bias(self) -> bool:
        """Whether the attention's output projection has a bias."""
        return self.attention_bias if self.attention_out_bias is None else \
            self.attention_out_bias

    @property
    def attention_scale(self) -> float:
        """The factor on attention logits q.k."""
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

    @property
    def has_sliding_layers(self) -> bool:
        """Whether some layer attends over a sliding window only."""
        return any(self.sliding_layers)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def has_projections(self) -> bool:
        """Whether the embedding width differs from the residual width."""
        return self.embed_dim != self.hidden

    @property
    def padding_id(self) -> int:
        """The id that fills left padding: pad_token_id when it lies inside the vocabulary
        (a config may name one past the embedding, or none), else 0. Padding is masked, but
        an id outside the embedding would give NaN rows that reach the masked products."""
        pad = self.pad_token_id
        return pad if pad is not None and 0 <= pad < self.vocab_size else 0

    @property
    def stop_token_ids(self) -> list[int]:
        """Every id that ends a sequence: the eos id and the config's further ones, less
        those outside the vocabulary (which no step can produce)."""
        ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + [
            i for i in self.extra_eos_token_ids if i != self.eos_token_id]
        return [i for i in ids if 0 <= i < self.vocab_size]

    def fingerprint(self) -> str:
        """A short stable hash of what the model computes (not its name, which is the
        checkpoint's folder or file name, nor its special token ids), for manifests of
        derived artifacts: a copied or renamed checkpoint keeps its profiles and
        predictors."""
        fields = _fields_of_older_configs(self)
        for key in _NOT_FINGERPRINTED:
            fields.pop(key, None)
        return _hash(fields)

    def fits_fingerprint(self, fingerprint: str | None) -> bool:
        """Whether an artifact's stored fingerprint is this config's: `fingerprint()`, or
        the whole-config hash (name and token ids included) that older artifacts hold."""
        fields = _fields_of_older_configs(self)
        fields.pop("extra_eos_token_ids")
        return fingerprint in (self.fingerprint(), _hash(fields))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


_POSITIVE_SIZES = ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                   "ffn", "max_positions", "embed_dim")


def _check_numbers(config: "ModelConfig") -> None:
    """ValueError for a setting that would give NaN or constant logits (a RoPE base or
    scaling factor <= 0, an odd rotary head_dim, a negative norm epsilon, a query scale or
    soft-cap <= 0), naming the config.json key in parentheses where it differs."""
    positive = {"query_scale (query_pre_attn_scalar)": config.query_scale,
                "final_logit_softcap (final_logit_softcapping)": config.final_logit_softcap,
                "attn_logit_softcap (attn_logit_softcapping)": config.attn_logit_softcap}
    if config.rotary:
        positive.update({"rope_theta": config.rope_theta,
                         "rope_local_theta (rope_local_base_freq)": config.rope_local_theta,
                         "rope_linear_factor (rope factor)": config.rope_linear_factor})
        if config.rope_llama3 is not None:
            positive["llama3 RoPE factor"] = config.rope_llama3[0]
            positive["llama3 RoPE original_max_position_embeddings"] = config.rope_llama3[3]
        if config.rope_yarn is not None:
            for i, key in enumerate(("factor", "attention_factor", "beta_fast", "beta_slow",
                                     "original_max_position_embeddings")):
                positive[f"yarn RoPE {key}"] = config.rope_yarn[i]
        if config.rope_longrope is not None:
            attention, original, *factors = config.rope_longrope
            positive["longrope attention_factor"] = attention
            positive["longrope original_max_position_embeddings"] = original
            half = len(factors) // 2
            for i, value in enumerate(factors):
                which = "short" if i < half else "long"
                positive[f"longrope {which}_factor[{i % half}]"] = value
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got "
                             f"{config.head_dim}")
        rotary = config.rotary_dim
        if rotary is not None and (isinstance(rotary, bool) or int(rotary) != rotary
                                   or not 0 < rotary <= config.head_dim or rotary % 2):
            raise ValueError(f"rotary_dim (head_dim x partial_rotary_factor) must be an even "
                             f"number in (0, {config.head_dim}], got {rotary!r}")
    for what, value in positive.items():
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{what} must be positive and finite, got {value!r}")
    if not 0 <= config.norm_eps < float("inf"):
        raise ValueError(f"norm_eps (rms_norm_eps) must be >= 0, got {config.norm_eps!r}")


_NOT_FINGERPRINTED = ("name", "bos_token_id", "eos_token_id", "pad_token_id",
                      "extra_eos_token_ids")


def _fields_of_older_configs(config: "ModelConfig") -> dict:
    """The config's fields, less the later ones at their defaults (so that a config that
    does not use them keeps the fingerprint it had before they existed)."""
    fields = dataclasses.asdict(config)
    for later in ("rope_llama3", "rope_yarn", "rope_longrope", "attn_logit_softcap",
                  "rotary_dim"):
        if fields[later] is None:
            fields.pop(later)
    if not fields["rope_dynamic"]:
        fields.pop("rope_dynamic")
    return fields


def _hash(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def from_hf_config(hf: dict, name: str = "custom") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict (OPT, Llama, Mistral,
    Qwen2, Qwen3, Phi-3, Gemma, Gemma 2 or Gemma 3; for the multimodal `gemma3` its
    `text_config`)."""
    check_hf_values(hf)
    model_type = hf.get("model_type")
    if model_type == "opt":
        return _opt_from_hf(hf, name)
    if model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        return _llama_from_hf(hf, name)
    if model_type == "gemma3":  # its special ids may sit at the top level only
        text = {**{k: hf[k] for k in ("bos_token_id", "pad_token_id") if k in hf},
                **hf.get("text_config", {}), "model_type": "gemma3_text"}
        check_hf_values(text)
        eos = id_list(text.get("eos_token_id")) + id_list(hf.get("eos_token_id"))
        if eos:  # the text model's end ids and the top level's (an end-of-turn id)
            text["eos_token_id"] = list(dict.fromkeys(eos))
        return _gemma3_from_hf(text, name)
    if model_type == "gemma3_text":
        return _gemma3_from_hf(hf, name)
    if model_type == "gemma2":
        return _gemma2_from_hf(hf, name)
    if model_type == "gemma":
        return _gemma_from_hf(hf, name)
    raise ValueError(
        f"unknown model_type {model_type!r} in config.json (model {name!r}); "
        "supported: 'opt', 'llama', 'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma', "
        "'gemma2', 'gemma3_text', 'gemma3'")


def _rope_kind(params: dict | None) -> tuple[str, dict]:
    """(RoPE type, its settings) of a RoPE parameters dict (`type` is the older key)."""
    params = params or {}
    return params.get("rope_type", params.get("type")) or "default", params


def _rope(params: dict | None, legacy_theta, default_theta: float, name: str,
          llama3: bool = False) -> tuple[float, float]:
    """(theta, linear factor) of a RoPE parameters dict, whose missing theta is the
    top-level `rope_theta` (else `default_theta`); default and linear RoPE, and with
    `llama3` Llama 3's, YaRN (whose settings `_rope_llama3` and `_rope_yarn` read) and
    dynamic NTK (`_rope_dynamic`)."""
    kind, settings = _rope_kind(params)
    known = ("default", "linear") + (("llama3", "yarn", "dynamic") if llama3 else ())
    if kind not in known:
        raise ValueError(f"rope type {kind!r} is not supported (model {name!r}); "
                         f"supported: {', '.join(known)}")
    theta = settings.get("rope_theta",
                         legacy_theta if legacy_theta is not None else default_theta)
    if kind == "linear" and settings.get("factor") is None:
        raise ValueError(f"linear RoPE scaling without a factor (model {name!r})")
    factor = settings["factor"] if kind == "linear" else 1.0
    return float(theta), float(factor)


def _rope_llama3(params: dict | None, max_positions) -> tuple[float, ...] | None:
    """Llama 3's RoPE settings (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings, by default `max_positions` as in transformers), or
    None for another RoPE type."""
    kind, settings = _rope_kind(params)
    if kind != "llama3":
        return None
    settings = {"original_max_position_embeddings": max_positions, **settings}
    keys = ("factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")
    missing = [k for k in keys if k not in settings]
    if missing:
        raise ValueError(f"llama3 RoPE scaling without {missing}")
    if not settings["high_freq_factor"] > settings["low_freq_factor"] > 0:
        raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor > 0")
    return tuple(float(settings[k]) for k in keys)


def _rope_dynamic(params: dict | None) -> bool:
    """Whether the RoPE is dynamic NTK scaling; ValueError without a factor of at least 1,
    as transformers refuses it."""
    kind, settings = _rope_kind(params)
    if kind != "dynamic":
        return False
    factor = settings.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"dynamic RoPE scaling needs a factor >= 1, got {factor!r}")
    return True


def _rope_longrope(params: dict, hf: dict, max_positions: int, rotary_dims: int,
                   name: str) -> tuple[float, ...]:
    """Phi-3's LongRoPE settings as transformers reads them (`ModelConfig.rope_longrope`):
    the original context is the config's top-level original_max_position_embeddings
    (Phi3Config's default 4096), a missing factor the ratio of the two context lengths,
    and a missing attention_factor sqrt(1 + ln(factor) / ln(original)) (1 for a factor
    <= 1)."""
    original = hf.get("original_max_position_embeddings", 4096)
    lists = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != rotary_dims // 2 or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ValueError(f"longrope RoPE scaling needs {key}, a list of "
                             f"{rotary_dims // 2} numbers (model {name!r}), got {values!r}")
        lists[key] = [float(v) for v in values]
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return (float(attention), float(original), *lists["short_factor"], *lists["long_factor"])


def _rope_yarn(params: dict | None, max_positions) -> tuple[float, ...] | None:
    """YaRN's RoPE settings as transformers reads them (`ModelConfig.rope_yarn`), or None
    for another RoPE type: original_max_position_embeddings defaults to `max_positions`,
    a missing factor to their ratio, beta_fast and beta_slow to 32 and 1, truncate to on,
    and attention_factor to 0.1 ln(factor) + 1 (with mscale and mscale_all_dim, the ratio
    of their two such terms; 1 for a factor <= 1)."""
    kind, settings = _rope_kind(params)
    if kind != "yarn":
        return None
    original = settings.get("original_max_position_embeddings") or max_positions
    factor = settings.get("factor")
    if factor is None:
        if not original:
            raise ValueError("yarn RoPE scaling without a factor or context lengths")
        factor = max_positions / original

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = settings.get("attention_factor")
    if attention is None:
        mscale, mscale_all = settings.get("mscale"), settings.get("mscale_all_dim")
        attention = (mscale_of(factor, mscale) / mscale_of(factor, mscale_all)
                     if mscale and mscale_all else mscale_of(factor))
    return (float(factor), float(attention), float(settings.get("beta_fast") or 32),
            float(settings.get("beta_slow") or 1), float(original or 0),
            1.0 if settings.get("truncate", True) else 0.0)


# (num_key_value_heads, max_position_embeddings) of a config.json without them, as
# transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config and Phi3Config default
# them (None: the query heads)
LLAMA_FAMILY_DEFAULTS = {"llama": (None, 2048), "mistral": (8, 131_072), "qwen2": (32, 32_768),
                         "qwen3": (32, 32_768), "phi3": (None, 4096)}
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json leaves it out


def _sliding_layers(hf: dict, n_layers: int, pattern: int | None = None) -> tuple[bool, ...]:
    """Per-layer sliding flags as transformers reads them: a Llama has none; a Mistral or a
    Phi-3 slides on every layer when it has a `sliding_window` (Mistral's 4096 when the key
    is absent), whatever `layer_types` says; Qwen2, Qwen3 and Gemma 3 follow `layer_types`,
    else Gemma 3 slides on every layer but each `pattern`-th, and Qwen2 and Qwen3 with
    `use_sliding_window` from `max_window_layers` on."""
    model_type = hf.get("model_type")
    if model_type == "llama":
        return ()
    if model_type in ("mistral", "phi3"):
        return (True,) * n_layers if _window(hf) else ()
    types = hf.get("layer_types")
    if types:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported")
        return tuple(t == "sliding_attention" for t in types)
    if pattern:
        return tuple(bool((i + 1) % pattern) for i in range(n_layers))
    if model_type in ("qwen2", "qwen3") and _window(hf):
        start = hf.get("max_window_layers", 28)
        return tuple(i >= start for i in range(n_layers))
    return ()


def _window(hf: dict) -> int | None:
    """The sliding window of a Mistral, Qwen2, Qwen3 or Phi-3 config as transformers reads
    it: Mistral's default 4096 when the key is absent; for Qwen2 and Qwen3, None unless
    `use_sliding_window`; for Phi-3, None when absent."""
    if hf.get("model_type") in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        return None
    window = hf.get("sliding_window", None if hf.get("model_type") == "phi3" else 4096)
    if window is not None and window < 1:   # Phi3Config's default is none, Mistral's 4096
        raise ValueError(f"sliding_window must be positive or null, got {window}")
    return window


def _first(value):
    """The first id of an id or a list of ids (config eos lists; None for an empty one)."""
    ids = id_list(value)
    return ids[0] if ids else None


def _rest(value) -> tuple[int, ...]:
    """The ids after the first of a list of ids (config eos lists)."""
    return tuple(id_list(value)[1:])


def _opt_from_hf(hf: dict, name: str) -> ModelConfig:
    act = hf.get("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise ValueError(f"OPT activation_function {act!r} is not supported (model {name!r})")
    hidden = hf["hidden_size"]
    n_heads = hf["num_attention_heads"]
    if hidden % n_heads:
        raise ValueError(f"hidden_size {hidden} not divisible by num_attention_heads {n_heads}")
    if not hf.get("layer_norm_elementwise_affine", True):
        raise ValueError(f"OPT without layer_norm_elementwise_affine is not supported "
                         f"(model {name!r})")
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
        eos_token_id=_first(hf.get("eos_token_id", 2)),
        extra_eos_token_ids=_rest(hf.get("eos_token_id", 2)),
        pad_token_id=hf.get("pad_token_id", 1),
        name=name,
    )


def _llama_from_hf(hf: dict, name: str) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' "swish" is SiLU
        raise ValueError(f"{hf['model_type']} hidden_act {act!r} is not supported "
                         f"(model {name!r})")
    hidden = hf["hidden_size"]
    n_heads = hf["num_attention_heads"]
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")  # as transformers reads them
    kv_default, positions_default = LLAMA_FAMILY_DEFAULTS[hf["model_type"]]
    max_positions = hf.get("max_position_embeddings", positions_default)
    head_dim = hf.get("head_dim") or hidden // n_heads
    partial = (rope or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary_dim = None
    if partial not in (None, 1, 1.0):
        if hf["model_type"] != "phi3":   # transformers' other Llama-family models ignore it
            raise ValueError(f"partial_rotary_factor {partial!r} (RoPE on part of each head) "
                             f"is supported for phi3 only (model {name!r})")
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) \
                or not 0 < partial < 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial!r} "
                             f"(model {name!r})")
        # rounded down as transformers does (a GGUF's ratio of whole numbers: back to them)
        rotary_dim = int(head_dim * partial + 1e-9)
    longrope = None
    if hf["model_type"] == "phi3":
        kind = _rope_kind(rope)[0]
        if kind not in ("default", "longrope", "su", "yarn"):
            raise ValueError(f"Phi-3 rope type {kind!r} is not supported (model {name!r}); "
                             "supported: default, longrope (also read from 'su' and 'yarn')")
        if kind != "default":   # Phi3Config reads "su" and "yarn" as its longrope
            longrope = _rope_longrope(rope, hf, max_positions, rotary_dim or head_dim, name)
            rope = {k: v for k, v in rope.items() if k not in ("rope_type", "type")}
    theta, factor = _rope(rope, hf.get("rope_theta"), 10000.0, name, llama3=True)
    llama3 = _rope_llama3(rope, max_positions)
    yarn = _rope_yarn(rope, max_positions)
    qwen2 = hf["model_type"] == "qwen2"
    qwen3 = hf["model_type"] == "qwen3"  # Llama's layout with RMSNorm on each head's q and k
    if hf.get("mlp_bias"):
        raise ValueError(f"mlp_bias (biases on the gate, up and down projections) is not "
                         f"supported (model {name!r})")
    n_layers = hf["num_hidden_layers"]
    sliding = _sliding_layers(hf, n_layers)
    if any(sliding) and _window(hf) is None:
        raise ValueError(f"layer_types has sliding layers but the config has no sliding window "
                         f"(use_sliding_window false or sliding_window null; model {name!r})")
    return ModelConfig(
        family="qwen2" if qwen2 else "llama",
        vocab_size=hf["vocab_size"],
        hidden=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", kv_default) or n_heads,
        head_dim=hf.get("head_dim") or (QWEN3_HEAD_DIM if qwen3 else hidden // n_heads),
        ffn=hf["intermediate_size"],
        max_positions=max_positions,
        embed_dim=hidden,
        norm_eps=hf.get("rms_norm_eps", 1e-5 if hf["model_type"] == "phi3" else 1e-6),
        pre_norm=True,
        final_norm=True,
        activation="silu",
        gated_mlp=True,
        # Mistral's and Phi-3's projections have no biases whatever attention_bias says
        attention_bias=qwen2 or (hf["model_type"] in ("llama", "qwen3")
                                 and bool(hf.get("attention_bias", False))),
        attention_out_bias=False if qwen2 else None,
        mlp_bias=False,
        qk_norm=qwen3,
        rope_theta=theta,
        rope_linear_factor=factor,
        rope_llama3=llama3,
        rope_yarn=yarn,
        rope_dynamic=_rope_dynamic(rope),
        rope_longrope=longrope,
        rotary_dim=rotary_dim,
        sliding_window=_window(hf) if any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_first(hf.get("eos_token_id")),
        extra_eos_token_ids=_rest(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        name=name,
    )


# Gemma3TextConfig's defaults for the shapes, which multimodal checkpoints may leave out
# (gemma-3-4b's text_config lists neither its heads nor its KV heads)
_GEMMA3_TEXT_DEFAULTS = {"hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8,
                         "num_key_value_heads": 4}


def _gemma3_from_hf(hf: dict, name: str) -> ModelConfig:
    hf = {**_GEMMA3_TEXT_DEFAULTS, **hf}
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3 hidden_activation {act!r} is not supported (model {name!r})")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention is not supported (model {name!r})")
    n_layers = hf["num_hidden_layers"]
    # per layer type, as transformers reads them: `rope_scaling` updates the full-attention
    # entry, and a flat `rope_parameters` (no per-type entries) is not read
    params = hf.get("rope_parameters") or {}
    full = {**(params.get("full_attention") or {"rope_type": "default"}),
            **(hf.get("rope_scaling") or {})}
    theta, factor = _rope(full, hf.get("rope_theta"), 1_000_000.0, name)
    local_theta, local_factor = _rope(params.get("sliding_attention"),
                                      hf.get("rope_local_base_freq"), 10_000.0, name)
    if local_factor != 1.0:
        raise ValueError(f"scaled RoPE on sliding layers is not supported (model {name!r})")
    pattern = hf.get("sliding_window_pattern", 6)  # transformers does not read the "_" key
    sliding = _sliding_layers(hf, n_layers, pattern)
    return ModelConfig(
        family="gemma3",
        **_gemma_fields(hf, name, {"vocab_size": 262_208,
                                   "max_position_embeddings": 131_072}),
        rope_theta=theta,
        rope_linear_factor=factor,
        rope_local_theta=local_theta,
        qk_norm=True,
        post_norms=True,
        query_scale=_query_scale(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=hf.get("sliding_window", 4096) if any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
    )


# Gemma's GELU is the tanh approximation; its first releases' config.json says "gelu",
# which transformers (since 5.2x) and llama.cpp read as that approximation too
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")


def _gemma_from_hf(hf: dict, name: str) -> ModelConfig:
    """Gemma (1): Llama's layout and names with GeGLU, RMSNorms multiplying by 1 + w and
    the embedding scaled by sqrt(hidden); no windows, post-norms or soft-caps."""
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _GEMMA_ACTIVATIONS:
        raise ValueError(f"gemma hidden_act {act!r} is not supported (model {name!r}); "
                         f"supported: {', '.join(_GEMMA_ACTIVATIONS)}")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention is not supported (model {name!r})")
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    theta, factor = _rope(rope, hf.get("rope_theta"), 10_000.0, name)
    return ModelConfig(
        family="gemma",
        **_gemma_fields(hf, name, {"vocab_size": 256_000, "hidden_size": 3072,
                                   "num_hidden_layers": 28, "num_attention_heads": 16,
                                   "intermediate_size": 24576,
                                   "max_position_embeddings": 8192}),
        rope_theta=theta,
        rope_linear_factor=factor,
    )


def _gemma2_from_hf(hf: dict, name: str) -> ModelConfig:
    """Gemma 2: Gemma 3's layout without q/k norms, one RoPE for every layer, sliding
    windows on the even layers, and soft-capped attention and final logits."""
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma2 hidden_activation {act!r} is not supported (model {name!r})")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention is not supported (model {name!r})")
    n_layers = hf.get("num_hidden_layers", GEMMA2_DEFAULTS["num_hidden_layers"])
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    theta, factor = _rope(rope, hf.get("rope_theta"), 10_000.0, name)
    sliding = _sliding_layers(hf, n_layers, pattern=2)
    window = hf.get("sliding_window", 4096)
    if any(sliding) and window is None:
        raise ValueError(f"gemma2 has sliding layers but no sliding_window (model {name!r})")
    return ModelConfig(
        family="gemma3",
        **_gemma_fields(hf, name, GEMMA2_DEFAULTS),
        rope_theta=theta,
        rope_linear_factor=factor,
        post_norms=True,
        query_scale=_query_scale(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=window if any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
        final_logit_softcap=hf.get("final_logit_softcapping", 30.0),
        attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0),
    )


GEMMA2_DEFAULTS = {"vocab_size": 256_000, "hidden_size": 2304, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4,
                   "intermediate_size": 9216, "max_position_embeddings": 8192}  # Gemma2Config's


def _gemma_fields(hf: dict, name: str, defaults: dict) -> dict:
    """The ModelConfig fields every Gemma reads alike (shapes, GeGLU, the scaled
    embedding, tying, special ids), `defaults` filling the shapes a config.json leaves out
    as that version's transformers config class does."""
    hf = {**defaults, **hf}
    hidden, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden=hidden, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim", 256), ffn=hf["intermediate_size"],
        max_positions=hf["max_position_embeddings"], embed_dim=hidden,
        norm_eps=hf.get("rms_norm_eps", 1e-6), activation="gelu_tanh", gated_mlp=True,
        attention_bias=hf.get("attention_bias", False), mlp_bias=False,
        embed_scale=hidden ** 0.5, tie_embeddings=hf.get("tie_word_embeddings", True),
        bos_token_id=hf.get("bos_token_id", 2), eos_token_id=_first(hf.get("eos_token_id", 1)),
        extra_eos_token_ids=_rest(hf.get("eos_token_id", 1)),
        pad_token_id=hf.get("pad_token_id", 0), name=name)


def _query_scale(scalar) -> float:
    """Gemma's attention scale query_pre_attn_scalar ** -0.5."""
    if not isinstance(scalar, (int, float)) or not 0 < scalar < float("inf"):
        raise ValueError(f"query_pre_attn_scalar must be positive, got {scalar!r}")
    return scalar ** -0.5


def _qwen2_preset(name, hidden, n_layers, n_heads, n_kv_heads, ffn, vocab=151936,
                  tie=True):
    return _llama_from_hf(dict(
        model_type="qwen2", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, intermediate_size=ffn,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=tie, bos_token_id=151643, eos_token_id=151645,
        pad_token_id=151643), name)


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
    "qwen2.5-0.5b": _qwen2_preset("qwen2.5-0.5b", 896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": _qwen2_preset("qwen2.5-1.5b", 1536, 28, 12, 2, 8960),
    "qwen2.5-7b": _qwen2_preset("qwen2.5-7b", 3584, 28, 28, 4, 18944, vocab=152064,
                                tie=False),
    "gemma3-270m": _gemma3_from_hf(dict(
        vocab_size=262144, hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, intermediate_size=2048,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0), "gemma3-270m"),
    "llama3-8b": _llama_from_hf(dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500_000.0,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001), "llama3-8b"),
    "qwen3-8b": _llama_from_hf(dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645), "qwen3-8b"),
}


def preset(name: str) -> ModelConfig:
    """The shape preset called `name` (see PRESETS); raises with the list when unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
