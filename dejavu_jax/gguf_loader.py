"""Read GGUF files (llama, qwen2, qwen3, phi3, gemma, gemma2, gemma3) as Hugging Face
configs and tensors.

`open_gguf(path)` returns `(hf_config, tensors)`: a dict shaped like the Hugging Face
`config.json` of the architecture (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`Gemma2ForCausalLM`, ...), and a `TensorSource` whose tensors are named and laid out as in
that model's `state_dict()` (`[out_features, in_features]` for linear weights). A tensor is
dequantised to float32 (through `gguf.quants.dequantize`, in row chunks) only when it is
read, so a loader can place each one into its final array before reading the next.
`load_gguf(path)` reads every tensor into a dict at once.

What llama.cpp's converter changed is undone, so the weights equal the checkpoint's:
  - llama: the rows of q_proj / k_proj are permuted per head (the two rotary halves
    interleaved, for RoPE on adjacent pairs); they are un-permuted for HF's `rotate_half`.
    Qwen2 and Gemma use rotate-half RoPE in llama.cpp too and are stored as they are.
  - gemma, gemma2, gemma3: every RMSNorm weight w is stored as 1 + w (Gemma's norms multiply by
    1 + w); 1 is subtracted again.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from dejavu_jax.checkpoint_files import CheckpointError
from dejavu_jax.paths import cache_root

__all__ = [
    "GGUFLoadError",
    "open_gguf",
    "load_gguf",
    "gguf_config",
    "gguf_metadata",
    "unpermute_qk",
    "permute_qk",
    "tokenizer_from_gguf",
    "fetch_smollm2",
    "smollm2_cache_path",
    "default_cache_dir",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3")
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
DEQUANT_CHUNK_VALUES = 1 << 24  # values dequantised per call (gguf's temporaries scale with it)

# GGUF per-layer tensor stem -> HF per-layer parameter name.
_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {
    "llama": _LLAMA_LAYER_NAMES,
    "qwen2": _LLAMA_LAYER_NAMES,
    "qwen3": {**_LLAMA_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm",
              "attn_k_norm": "self_attn.k_norm"},
    # Phi-3's fused q/k/v and gate/up (ffn_up holds both), split by `fused_tensors`
    "phi3": {**_LLAMA_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
             "ffn_up": "mlp.gate_up_proj"},
    "gemma": _LLAMA_LAYER_NAMES,
    "gemma2": {
        **_LLAMA_LAYER_NAMES,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_NAMES["gemma3"] = {**_LAYER_NAMES["gemma2"], "attn_q_norm": "self_attn.q_norm",
                          "attn_k_norm": "self_attn.k_norm"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"),
                     "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                     "qwen3": ("Qwen3ForCausalLM", "qwen3"),
                     "phi3": ("Phi3ForCausalLM", "phi3"),
                     "gemma": ("GemmaForCausalLM", "gemma"),
                     "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                     "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # llama.cpp's fixed base of Gemma 3's sliding layers
GEMMA3_SLIDING_PATTERN = 6          # every 6th Gemma 3 layer attends globally


class GGUFLoadError(CheckpointError):
    """A GGUF file is missing, malformed, or uses something this loader does not support."""


def _reader(path):
    """Open `path` with `gguf.GGUFReader`, with a clear error if it is absent or unreadable.

    Parsing the SmolLM2 file takes seconds (its 49k-entry vocabulary), and the config, the
    tokenizer and the weights each need it: the last reader is kept for the same file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _cached_reader(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: Path, size: int, mtime_ns: int):
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises assorted errors on truncation
        raise GGUFLoadError(f"{path}: truncated or corrupt GGUF file ({exc})") from None


def _field_value(field):
    """The Python value of a `ReaderField` (scalar, string, or list)."""
    return field.contents()


def gguf_metadata(path, skip_arrays=True) -> dict:
    """All key/value metadata of a GGUF file as plain Python values.

    With `skip_arrays`, long arrays (the tokenizer vocab/merges) are replaced by their length.
    """
    from gguf import GGUFValueType

    reader = _reader(path)
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if skip_arrays and field.types and field.types[0] == GGUFValueType.ARRAY:
            out[key] = len(field.data)
        else:
            out[key] = _field_value(field)
    return out


def _end_ids(reader):
    """The eos id, or a list of it and the file's end-of-turn / end-of-message ids where
    they differ from it (as a HF config's eos list)."""
    ids = [_get(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids = [i for n, i in enumerate(ids) if i is not None and i not in ids[:n]]
    return ids[0] if len(ids) == 1 else (ids or None)


def _get(reader, key, default=None, required=False, path=None):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise GGUFLoadError(f"{path}: required metadata key {key!r} is missing")
        return default
    return _field_value(field)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Apply llama.cpp's converter permutation to HF q/k rows (`[n_head*hd, ...]`).

    Within each head, row `j` of the first half goes to `2j` and of the second half to `2j+1`.
    """
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF q/k rows back to Hugging Face order."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor, path) -> np.ndarray:
    """Float32 array in numpy (row-major, HF) shape for one `ReaderTensor`, dequantised a
    chunk of rows at a time into one output array."""
    from gguf import quants

    qname = tensor.tensor_type.name
    if qname not in SUPPORTED_QUANT_TYPES:
        raise GGUFLoadError(
            f"{path}: tensor {tensor.name!r} has quantization type {qname}, "
            f"which is not supported (supported: {', '.join(SUPPORTED_QUANT_TYPES)})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    out = np.empty((rows.shape[0], int(np.prod(shape)) // rows.shape[0]), np.float32)
    step = max(1, DEQUANT_CHUNK_VALUES // max(1, out.shape[1]))
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = quants.dequantize(rows[start:start + step],
                                                    tensor.tensor_type)
    return out.reshape(shape)


def _hf_name(gguf_name: str, arch: str, path) -> str:
    """The HF parameter name for a GGUF tensor name of architecture `arch`."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise GGUFLoadError(f"{path}: unexpected tensor name {gguf_name!r}")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    layer_names = _LAYER_NAMES[arch]
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}.{suffix}"
    raise GGUFLoadError(f"{path}: tensor {gguf_name!r} has no {arch} mapping "
                        "(unsupported feature?)")


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.999999974752427e-07): the number the converter was given."""
    return float(str(np.float32(value)))


def _optional_f32(value) -> float | None:
    return None if value is None else _f32(value)


def _architecture(reader, path) -> str:
    arch = _get(reader, "general.architecture", required=True, path=path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFLoadError(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def _rope_scaling(reader, arch, path) -> dict | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*`: none, linear or YaRN. llama.cpp's
    YaRN is transformers': the same ramp between the betas' turn counts (rounded outward)
    over the original context length, and the attention factor 0.1 ln(factor) + 1, which a
    file's `attn_factor` or `yarn_log_multiplier` would change (refused)."""
    kind = _get(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _optional_f32(_get(reader, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise GGUFLoadError(f"{path}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not "
                            "supported (supported: none, linear, yarn)")
    for key, neutral in (("attn_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = _get(reader, f"{arch}.rope.scaling.{key}")
        if value is not None and _f32(value) != neutral:
            raise GGUFLoadError(f"{path}: YaRN with {arch}.rope.scaling.{key} = {_f32(value)} "
                                "is not supported")
    scaling = {"rope_type": "yarn", "factor": factor}
    original = _get(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for beta in ("beta_fast", "beta_slow"):
        value = _get(reader, f"{arch}.rope.scaling.yarn_{beta}")
        if value is not None:
            scaling[beta] = _f32(value)
    return scaling


def _phi3_longrope(reader, path) -> dict:
    """Phi-3's LongRoPE as HF config keys: the per-frequency factors from the
    `rope_factors_short` / `_long` tensors, the original context and the attention factor
    that llama.cpp's converter wrote (without one, transformers' default)."""
    factors = {}
    for which in ("short", "long"):
        tensor = next((t for t in reader.tensors if t.name == f"rope_factors_{which}.weight"),
                      None)
        if tensor is None:
            raise GGUFLoadError(f"{path}: rope_factors_{which}.weight is missing beside the "
                                "other LongRoPE factors")
        factors[f"{which}_factor"] = [_f32(v) for v in _dequantize(tensor, path).reshape(-1)]
    scaling = {"rope_type": "longrope", **factors}
    attention = _get(reader, "phi3.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = _f32(attention)
    original = _get(reader, "phi3.rope.scaling.original_context_length", 4096)
    return {"rope_scaling": scaling, "original_max_position_embeddings": int(original)}


def _hf_config(reader, path) -> dict:
    """A HF `config.json`-style dict of the file's architecture from the GGUF metadata."""
    arch = _architecture(reader, path)

    def meta(key, default=None, required=False):
        return _get(reader, f"{arch}.{key}", default, required, path)

    hidden = int(meta("embedding_length", required=True))
    n_head = int(meta("attention.head_count", required=True))
    n_kv = int(meta("attention.head_count_kv", n_head))
    n_layers = int(meta("block_count", required=True))
    key_length = int(meta("attention.key_length", 0) or 0)
    rope_dims = int(meta("rope.dimension_count", 0) or 0)
    head_dim = key_length or max(rope_dims, hidden // n_head)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    if vocab is None:
        vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    architecture, model_type = _HF_ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length", required=True)),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, path),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _get(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _end_ids(reader),
        "pad_token_id": _get(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch in ("gemma2", "gemma3"):
        window = meta("attention.sliding_window")
        pattern = meta("attention.sliding_window_pattern",
                       2 if arch == "gemma2" else GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, list):  # one flag per layer: True where the layer slides
            layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                           for i in range(n_layers)]
        # llama.cpp scales queries by head_dim^-0.5, except for the 27B models of Gemma 2
        # and 3 (hidden / heads)
        scalar = hidden // n_head if (n_layers, hidden) in ((46, 4608), (62, 5376)) \
            else head_dim
        config.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar,
            "sliding_window": int(window) if window else None,
            "layer_types": layer_types if window else None,
            "final_logit_softcapping": _optional_f32(meta("final_logit_softcapping")),
            "attn_logit_softcapping": _optional_f32(meta("attn_logit_softcapping")),
        })
        if arch == "gemma3":
            config["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_THETA
    elif arch == "gemma":   # llama.cpp's GELU is the tanh approximation
        config.update({"hidden_act": "gelu_pytorch_tanh",
                       "attention_bias": any(n.endswith("attn_q.bias") for n in names)})
    else:
        if arch == "phi3":
            if any(n.startswith("rope_factors_") for n in names):
                config.update(_phi3_longrope(reader, path))
            if 0 < rope_dims < head_dim:   # RoPE on part of each head (Phi-4-mini)
                config["partial_rotary_factor"] = rope_dims / head_dim
            window = meta("attention.sliding_window")
            config["sliding_window"] = int(window) if window else None
        config.update({
            "hidden_act": "silu",
            "attention_bias": any(n.endswith("attn_q.bias") for n in names),
            "mlp_bias": any(n.endswith(("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"))
                           for n in names),
        })
    return config


def open_gguf(path):
    """`(hf_config, TensorSource)` of a GGUF file, tensors dequantised when read (see the
    module docstring). Checks every tensor's name and type before returning."""
    from dejavu_jax.checkpoint_files import TensorSource

    reader = _reader(path)
    config = _hf_config(reader, path)
    arch = _architecture(reader, path)
    tensors = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_QUANT_TYPES:
            _dequantize(tensor, path)  # raises the unsupported-type error
        if arch == "phi3" and tensor.name.startswith("rope_factors_"):
            continue  # read into the config (LongRoPE)
        tensors[_hf_name(tensor.name, arch, path)] = tensor
    if "model.embed_tokens.weight" not in tensors:
        raise GGUFLoadError(f"{path}: no token_embd.weight tensor")

    def read(name, _file):
        w = _dequantize(tensors[name], path)
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            w -= 1.0
        return w

    return config, TensorSource({name: Path(path) for name in tensors}, read)


def gguf_config(path) -> dict:
    """The Hugging Face style config dict of a GGUF file (as `load_gguf` returns), from its
    metadata alone: no tensor is dequantised."""
    return _hf_config(_reader(path), path)


def load_gguf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """`(hf_config, state_dict)` of a GGUF file with every tensor dequantised to float32,
    in the Hugging Face naming and layout of its architecture (see `open_gguf`).
    `lm_head.weight` is present only when the file stores a separate `output.weight`
    (otherwise `hf_config["tie_word_embeddings"]` is True)."""
    config, tensors = open_gguf(path)
    return config, {name: tensors.get(name) for name in tensors.keys()}


# --------------------------------------------------------------------------- tokenizer
# transformers can build a tokenizer from a GGUF, but only with torch installed (it reads the
# file through its torch GGUF integration), and its Gemma conversion drops the BOS token and
# splits words into short pieces (transformers 5.17); so the tokenizer is built here with
# `tokenizers` from the file's own vocabulary.

# Qwen2's split before byte-level BPE (as in its tokenizer.json)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's: as Qwen2's, but digits in runs of up to three
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")  # llama.cpp's names for it
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6  # llama.cpp token types


def _pre_tokenizer(pre: str | None):
    """A `tokenizers` pre-tokenizer for a GGUF `tokenizer.ggml.pre` name (GPT-2 BPE family)."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM/SmolLM2: every digit on its own, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2" or pre in _LLAMA3_NAMES:
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    raise GGUFLoadError(f"tokenizer pre-tokenizer {pre!r} is not supported "
                        f"(supported: smollm, qwen2, {', '.join(_LLAMA3_NAMES)}, gpt2, default)")


def _byte_level_bpe(reader, path, tokens, vocab):
    """GPT-2-style byte-level BPE from `tokenizer.ggml.merges` (SmolLM2, Qwen2)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    merges = _get(reader, "tokenizer.ggml.merges", required=True, path=path)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    pre = _get(reader, "tokenizer.ggml.pre", path=path)
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_bpe(reader, path, tokens, vocab, types):
    """SentencePiece BPE from the tokens' scores (llama.cpp's "llama" model; Gemma): a pair
    merges when both halves and their concatenation are pieces, the concatenation's score
    ranking the merge; unknown bytes fall back to <0xNN> pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _get(reader, "tokenizer.ggml.scores", required=True, path=path)
    ranked = []
    for piece, idx in vocab.items():
        if types[idx] in (_CONTROL, _USER_DEFINED, _BYTE):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[idx], idx, left, right))
    ranked.sort()
    unk = _get(reader, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked],
                               byte_fallback=True, fuse_unk=True,
                               unk_token=tokens[unk] if unk is not None else None))
    steps = [normalizers.Replace(" ", "\u2581")]
    if _get(reader, "tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok


def tokenizer_from_gguf(path):
    """A `transformers.PreTrainedTokenizerFast` built from the vocabulary inside a GGUF.

    `tokenizer.ggml.model` "gpt2": byte-level BPE from the file's merges (with the
    pre-tokenizer its `tokenizer.ggml.pre` names); "llama": SentencePiece BPE from the
    pieces' scores. Control tokens (type 3) are added as special tokens and user-defined
    ones (type 4) as tokens never split; the special-token ids, `add_bos_token` and
    `tokenizer.chat_template` come from the file.
    """
    from tokenizers import AddedToken, processors
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its note that torch is absent
    from transformers import PreTrainedTokenizerFast

    reader = _reader(path)
    model = _get(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise GGUFLoadError(f"{path}: tokenizer model {model!r} is not supported "
                            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    tokens = _get(reader, "tokenizer.ggml.tokens", required=True, path=path)
    types = _get(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFLoadError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    tok = (_byte_level_bpe(reader, path, tokens, vocab) if model == "gpt2"
           else _sentencepiece_bpe(reader, path, tokens, vocab, types))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    if model == "llama":
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def special(key):
        idx = _get(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = special("bos_token_id")
    # unset, llama.cpp prepends BOS for SentencePiece vocabularies and not for byte-level BPE
    if _get(reader, "tokenizer.ggml.add_bos_token", model == "llama") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    kwargs = dict(bos_token=bos, eos_token=special("eos_token_id"),
                  unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    template = _get(reader, "tokenizer.chat_template")
    if template is not None:
        fast.chat_template = template
    return fast


# --------------------------------------------------------------------------- SmolLM2 fetch

def default_cache_dir() -> Path:
    """`$DEJAVU_CACHE`, else `~/.cache/dejavu_jax` (see `dejavu_jax.paths.cache_root`)."""
    return cache_root()


def smollm2_cache_path(cache_dir=None) -> Path:
    """Where `fetch_smollm2` puts (or finds) the SmolLM2-135M-Instruct Q4_1 GGUF. Downloads nothing."""
    from dejavu_jax.models_registry import model_source
    return model_source("smollm2-135m").cache_path(cache_dir)


def fetch_smollm2(cache_dir=None) -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, fetched first when not cached
    (`dejavu_jax.fetch_model.fetch("smollm2-135m")`)."""
    from dejavu_jax.fetch_model import fetch
    return fetch("smollm2-135m", cache_dir)
