"""The value types a Hugging Face ``config.json`` may hold for the keys this package reads.

`check_hf_values` raises a ValueError naming the key for a value of the wrong type (a
size that is not a whole number, a text where a number belongs, a list of lists of ids),
before the config's numbers reach code that would fail on them with a message about
Python types, or run with them.
"""

from __future__ import annotations

# sizes; those in _MAY_BE_NULL fall back to a default when null
_WHOLE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "intermediate_size", "ffn_dim",
          "max_position_embeddings", "word_embed_proj_dim", "sliding_window",
          "max_window_layers", "sliding_window_pattern")
_MAY_BE_NULL = ("num_key_value_heads", "head_dim", "word_embed_proj_dim", "sliding_window",
                "max_window_layers", "sliding_window_pattern")
_REAL = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "rope_local_base_freq",
         "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar",
         "partial_rotary_factor")
_NOT_NULL = ("rms_norm_eps", "layer_norm_eps")
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
_ROPE_REAL = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "attention_factor", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "partial_rotary_factor")
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_FLAGS = ("tie_word_embeddings", "do_layer_norm_before", "enable_bias", "attention_bias",
          "mlp_bias", "use_sliding_window", "layer_norm_elementwise_affine",
          "_remove_final_layer_norm", "use_bidirectional_attention")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def id_list(value) -> list:
    """A config's token id or list of ids as a list (empty for null)."""
    return list(value) if isinstance(value, list) else [] if value is None else [value]


def check_token_ids(key: str, value) -> None:
    """ValueError unless ``value`` is null, one whole-number id or a list of them."""
    if not all(_is_whole(i) for i in id_list(value)):
        raise ValueError(f"{key} must be a token id or a list of token ids, got {value!r}")


def check_hf_values(hf: dict) -> None:
    """ValueError naming the key for a value of a type ``config.json`` cannot hold there
    (see the module's docstring); keys that are absent are left to their defaults."""
    if not isinstance(hf, dict):
        raise ValueError(f"the config must be a JSON object, got {type(hf).__name__}")
    for key in _WHOLE:
        if key in hf and not _is_whole(hf[key]):
            if hf[key] is None and key in _MAY_BE_NULL:
                continue
            raise ValueError(f"{key} must be a whole number, got {hf[key]!r}")
    for key in _REAL:
        if key in hf and not _is_number(hf[key]):
            if hf[key] is None and key not in _NOT_NULL:
                continue
            raise ValueError(f"{key} must be a number, got {hf[key]!r}")
    for key in _FLAGS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise ValueError(f"{key} must be true or false, got {hf[key]!r}")
    for key in _IDS:
        check_token_ids(key, hf.get(key))
    for key in _ROPE_DICTS:
        _check_rope(key, hf.get(key))
    if "text_config" in hf and not isinstance(hf["text_config"], dict):
        raise ValueError(f"text_config must be a JSON object, got {hf['text_config']!r}")


def _check_rope(key: str, params) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"{key} must be a JSON object or null, got {params!r}")
    for name, value in params.items():
        if isinstance(value, dict):   # per-layer-type settings (Gemma 3's rope_parameters)
            _check_rope(f"{key}.{name}", value)
        elif name in _ROPE_REAL and value is not None and not _is_number(value):
            raise ValueError(f"{key}.{name} must be a number, got {value!r}")
    kind = params.get("rope_type", params.get("type"))
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"{key}.rope_type must be a name, got {kind!r}")
