"""Checkpoint loading: clear errors that name the file and key."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dejavu_jax as dj
from dejavu_jax.checkpoint_files import CheckpointError

HF = Path(__file__).parent / "fixtures" / "hf"


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(HF / name, dst)
    return dst


def _rewrite(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


def _reference_logits_match(directory):
    """Whether the checkpoint in ``directory`` loads to the logits transformers recorded
    beside it (``reference.npz``), within 1e-4 of their largest; they must be finite."""
    config, params = dj.load_pretrained(directory, dtype=jnp.float32, progress=False)
    ref = np.load(directory / "reference.npz")
    real = ref["attention_mask"].astype(bool)
    out = np.asarray(dj.logits(config, params, ref["input_ids"], ref["attention_mask"]))[real]
    want = ref["logits"][real]
    assert np.isfinite(out).all() and np.abs(want).max() > 1.0
    return np.abs(out - want).max() <= 1e-4 * np.abs(want).max()


def test_missing_tensor_names_file_and_key(tmp_path):
    d = _copy("opt-preln", tmp_path)
    path = _rewrite(d, lambda t: t.pop("model.decoder.layers.1.fc2.bias"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*decoder\.layers\.1\.fc2\.bias"):
        dj.load_pretrained(d, progress=False)
    assert path.exists()


def test_shape_mismatch_names_file_and_key(tmp_path):
    d = _copy("llama-gqa", tmp_path)

    def shrink(t):
        key = "model.layers.0.mlp.up_proj.weight"
        t[key] = np.ascontiguousarray(t[key][:-1])

    _rewrite(d, shrink)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        dj.load_pretrained(d, progress=False)


def test_unknown_model_type(tmp_path):
    d = _copy("opt-preln", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "bloom"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*unknown model_type 'bloom'"):
        dj.load_pretrained(d, progress=False)


def test_missing_config_and_weights(tmp_path):
    d = _copy("opt-preln", tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        dj.load_pretrained(d, progress=False)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        dj.load_pretrained(d, progress=False)
    with pytest.raises(CheckpointError, match="no such file"):
        dj.load_pretrained(tmp_path / "nowhere", progress=False)


def test_fp16_file_loads_in_requested_dtype():
    config, params = dj.load_pretrained(HF / "opt-fp16-prefix", dtype=jnp.bfloat16,
                                        progress=False)
    assert params.layers.wq.dtype == jnp.bfloat16
    assert params.lm_head is None and config.tie_embeddings
    assert params.layers.wq.shape == (config.n_layers, config.n_heads, config.head_dim,
                                      config.hidden)


def _header(meta: dict) -> bytes:
    text = json.dumps(meta).encode()
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize("damage,message", [
    (lambda data: data[:len(data) - 100], "not fully covered"),     # truncated weights
    (lambda data: data[:5], "header too small"),
    (lambda data: (1 << 40).to_bytes(8, "little") + data[8:], "header too large"),
    (lambda data: _header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})
     + bytes(8), "invalid shape, data type, or offset"),           # 4 floats in 8 bytes
    (lambda data: _header({"w": 3}), "invalid JSON in header"),
    (lambda data: np.random.default_rng(0).bytes(1 << 16), "deserializing header"),
])
def test_corrupt_safetensors_is_one_checkpoint_error(tmp_path, damage, message):
    """A truncated or corrupt weight file: a CheckpointError naming it (no MemoryError,
    OverflowError or garbage weights)."""
    d = _copy("opt-preln", tmp_path)
    path = d / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{message}"):
        dj.load_pretrained(d, progress=False)


def test_a_layer_tensor_the_model_has_no_place_for_is_refused(tmp_path):
    """A bias the model definition lacks (Llama's gate bias) would be dropped and change the
    logits: the load is refused naming it. Rotary frequency buffers are not weights and
    load as before, to the same logits."""
    d = _copy("llama-gqa", tmp_path)
    config, params = dj.load_pretrained(d, progress=False)
    ids = np.array([[3, 9, 4, 7]], np.int32)
    want = np.asarray(dj.logits(config, params, ids, np.ones_like(ids)))
    hd = config.head_dim
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                    np.ones(hd // 2, np.float32)}))
    config2, params2 = dj.load_pretrained(d, progress=False)
    got = np.asarray(dj.logits(config2, params2, ids, np.ones_like(ids)))
    assert np.isfinite(want).all() and np.array_equal(got, want)
    _rewrite(d, lambda t: t.update({"model.layers.1.mlp.gate_proj.bias":
                                    np.ones(config.ffn, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.gate_proj\.bias"):
        dj.load_pretrained(d, progress=False)
    from dejavu_jax.sharded_loading import load_pretrained_sharded
    from dejavu_jax.sharding import make_mesh
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.gate_proj\.bias"):
        load_pretrained_sharded(d, make_mesh(1))


@pytest.mark.parametrize("name,key,value", [("llama-gqa", "mlp_bias", True),
                                            ("opt-preln", "layer_norm_elementwise_affine",
                                             False)])
def test_unsupported_config_switches_are_refused(tmp_path, name, key, value):
    d = _copy(name, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=key):
        dj.load_pretrained(d, progress=False)


@pytest.mark.parametrize("window", [None, 5])
def test_mistral_sliding_window_applies_to_every_layer(window):
    """Mistral's `sliding_window` holds for every layer (no `layer_types`); None means
    full attention."""
    cfg = json.loads((HF / "llama-gqa" / "config.json").read_text())
    cfg.update(model_type="mistral", sliding_window=window)
    config = dj.config.from_hf_config(cfg)
    if window is None:
        assert config.sliding_window is None and config.sliding_layers == ()
    else:
        assert config.sliding_window == window
        assert config.sliding_layers == (True,) * config.n_layers


def _edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name,key,value", [
    ("llama-gqa", "rope_parameters", {"rope_type": "default", "rope_theta": 0.0}),
    ("llama-gqa", "rope_parameters", {"rope_type": "linear", "factor": 0.0,
                                      "rope_theta": 1e4}),
    ("llama-rope3", "rope_parameters", {"rope_type": "llama3", "factor": 0.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64,
                                        "rope_theta": 5e5}),
    ("llama-gqa", "rms_norm_eps", -1.0),
    ("llama-gqa", "num_attention_heads", 0),
    ("gemma3", "query_pre_attn_scalar", 0),
    ("gemma3", "final_logit_softcapping", 0.0),
    ("gemma2", "attn_logit_softcapping", 0.0),
], ids=["theta-0", "linear-0", "llama3-0", "eps", "heads-0", "query-scalar-0", "softcap-0",
        "attention-softcap-0"])
def test_settings_that_give_nan_or_constant_logits_are_refused(tmp_path, name, key, value):
    """A RoPE base or factor of 0, a negative norm epsilon, no heads, a query scalar or
    logit soft-cap of 0 (NaN, a crash, or every logit 0): the load is refused naming the
    key. The fixture as saved loads to Hugging Face's logits."""
    d = _copy(name, tmp_path)
    config, params = dj.load_pretrained(d, dtype=jnp.float32, progress=False)
    ref = np.load(d / "reference.npz")
    real = ref["attention_mask"].astype(bool)
    out = np.asarray(dj.logits(config, params, ref["input_ids"], ref["attention_mask"]))
    want = ref["logits"][real]
    np.testing.assert_allclose(out[real], want, atol=1e-4 * np.abs(want).max())
    _edit_config(d, **{key: value})
    field = {"rope_parameters": "rope_theta|factor", "num_attention_heads": "n_heads"}
    with pytest.raises(CheckpointError, match=field.get(key, key)):
        dj.load_pretrained(d, progress=False)


@pytest.mark.parametrize("name,layer_types", [
    ("mistral-window", ["full_attention"] * 3),
    ("llama-gqa", ["sliding_attention", "full_attention", "sliding_attention"])])
def test_layer_types_are_ignored_where_transformers_ignores_them(tmp_path, name, layer_types):
    """Mistral slides on every layer and Llama on none whatever `layer_types` says (their
    transformers models never read it): with it added, the fixture's logits are still
    Hugging Face's."""
    d = _copy(name, tmp_path)
    _edit_config(d, layer_types=layer_types,
                 **({} if name == "mistral-window" else {"sliding_window": 4}))
    config, params = dj.load_pretrained(d, dtype=jnp.float32, progress=False)
    ref = np.load(d / "reference.npz")
    real = ref["attention_mask"].astype(bool)
    out = np.asarray(dj.logits(config, params, ref["input_ids"], ref["attention_mask"]))
    want = ref["logits"][real]
    assert np.isfinite(out[real]).all()
    np.testing.assert_allclose(out[real], want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("hf", [
    dict(model_type="mistral"),
    dict(model_type="mistral", sliding_window=None),
    dict(model_type="qwen2", use_sliding_window=True, max_window_layers=2),
    dict(model_type="qwen2", use_sliding_window=True, sliding_window=7),
    dict(model_type="qwen2", sliding_window=7),
    dict(model_type="qwen3", use_sliding_window=True, max_window_layers=2),
    dict(model_type="qwen3", use_sliding_window=True, sliding_window=7),
    dict(model_type="qwen3", sliding_window=7),
    dict(model_type="phi3"),
    dict(model_type="phi3", sliding_window=7),
], ids=["mistral-default", "mistral-none", "qwen2-default", "qwen2-7", "qwen2-off",
        "qwen3-default", "qwen3-7", "qwen3-off", "phi3-default", "phi3-7"])
def test_sliding_windows_read_as_transformers_reads_them(hf):
    """Keys a config.json leaves out take transformers' defaults (Mistral's and Qwen2's
    window 4096, Qwen2's and Qwen3's max_window_layers 28): the sliding layers and window
    are those of transformers' own config class."""
    from transformers import MistralConfig, Phi3Config, Qwen2Config, Qwen3Config
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                num_key_value_heads=1, num_hidden_layers=30)
    raw = {**base, **hf}
    config = dj.config.from_hf_config(raw)
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    theirs = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
              "phi3": Phi3Config}[hf["model_type"]](**kwargs)
    types = getattr(theirs, "layer_types", None) or \
        ["sliding_attention" if theirs.sliding_window else "full_attention"] * 30
    want = tuple(t == "sliding_attention" for t in types)
    assert config.sliding_layers == (want if any(want) else ())
    assert config.sliding_window == (theirs.sliding_window if any(want) else None)


def _their_rope(entry):
    """(theta, linear factor, llama3 settings or None) of a transformers rope_parameters
    entry."""
    kind = entry.get("rope_type", "default")
    llama3 = None
    if kind == "llama3":
        llama3 = tuple(float(entry[k]) for k in ("factor", "low_freq_factor",
                                                  "high_freq_factor",
                                                  "original_max_position_embeddings"))
    return (float(entry["rope_theta"]), float(entry["factor"]) if kind == "linear" else 1.0,
            llama3)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope", [
    dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
         rope_parameters={"rope_type": "default", "rope_theta": 3e4}),
    dict(rope_scaling=LLAMA3, rope_parameters={"rope_type": "default", "rope_theta": 3e4},
         rope_theta=7e5),
    dict(rope_parameters={**LLAMA3, "rope_theta": 3e4}, rope_theta=7e5),
    dict(rope_parameters={k: v for k, v in LLAMA3.items()
                          if k != "original_max_position_embeddings"}),
], ids=["legacy", "scaling-over-parameters", "llama3-scaling", "parameters-theta",
        "llama3-no-original-positions"])
def test_llama_rope_settings_read_as_transformers_reads_them(rope):
    """`rope_scaling` and `rope_parameters` together, or a top-level `rope_theta`
    besides them: the RoPE base and scaling are those of transformers' LlamaConfig."""
    from transformers import LlamaConfig
    raw = {**json.loads((HF / "llama-gqa" / "config.json").read_text()), **rope}
    if "rope_parameters" not in rope:
        raw.pop("rope_parameters")
    config = dj.config.from_hf_config(raw)
    theirs = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert (config.rope_theta, config.rope_linear_factor, config.rope_llama3) == \
        _their_rope(theirs.rope_parameters)


@pytest.mark.parametrize("rope", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_theta=2e6,
         rope_local_base_freq=2e4),
    dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 3e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 3e4}},
         rope_scaling={"rope_type": "linear", "factor": 4.0}),
    dict(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=2e6,
         rope_local_base_freq=2e4),
    dict(rope_scaling={"type": "linear", "factor": 8.0}, rope_theta=2e6),
], ids=["flat-parameters", "scaling-over-parameters", "legacy", "legacy-type-key"])
def test_gemma3_rope_settings_read_as_transformers_reads_them(rope):
    """Gemma 3's RoPE per layer type is that of transformers' Gemma3TextConfig: a flat
    `rope_parameters` (no per-type entries) is not read, and `rope_scaling` updates the
    full-attention entry (whose type is "default" already, so an older `type` key in it is
    not read)."""
    from transformers import Gemma3TextConfig
    raw = {**json.loads((HF / "gemma3" / "config.json").read_text()), **rope}
    if "rope_parameters" not in rope:
        raw.pop("rope_parameters")
    config = dj.config.from_hf_config(raw)
    theirs = Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    full = _their_rope(theirs.rope_parameters["full_attention"])
    local = _their_rope(theirs.rope_parameters["sliding_attention"])
    assert (config.rope_theta, config.rope_linear_factor) == full[:2]
    assert (config.rope_local_theta, 1.0) == local[:2]


@pytest.mark.parametrize("key", ["sliding_window_pattern", "_sliding_window_pattern"])
def test_gemma3_sliding_pattern_read_as_transformers_reads_it(key):
    """Without `layer_types`, Gemma 3's sliding layers follow `sliding_window_pattern` as in
    transformers' Gemma3TextConfig, which does not read the saved `_sliding_window_pattern`
    (every 6th layer is global then)."""
    from transformers import Gemma3TextConfig
    raw = json.loads((HF / "gemma3" / "config.json").read_text())
    for old in ("layer_types", "_sliding_window_pattern"):
        raw.pop(old)
    raw.update({key: 2, "num_hidden_layers": 8})
    config = dj.config.from_hf_config(raw)
    theirs = Gemma3TextConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"})
    assert config.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert config.sliding_layers != (True,) * 8 and config.sliding_layers != (False,) * 8


def test_qwen2_sliding_layers_without_a_window_are_refused(tmp_path):
    """Sliding `layer_types` with `use_sliding_window` false leave transformers' Qwen2 no
    window to apply (it fails); the load is refused naming the switch."""
    d = _copy("qwen2", tmp_path)
    _edit_config(d, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                 sliding_window=4)
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        dj.load_pretrained(d, progress=False)
    _edit_config(d, use_sliding_window=True)
    config, _ = dj.load_pretrained(d, progress=False)
    assert config.sliding_layers == (False, True, True) and config.sliding_window == 4


def test_swish_is_read_as_silu(tmp_path):
    """transformers' `hidden_act: "swish"` is SiLU: the Llama fixture with its config saying
    "swish" gives the logits transformers recorded for it."""
    d = _copy("llama-gqa", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.get("hidden_act", "silu") == "silu"
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_act="swish")))
    assert _reference_logits_match(d)


def test_a_renamed_checkpoint_keeps_its_fingerprint_and_stop_ids(tmp_path):
    """The fingerprint (what profiles and predictors are checked against) does not depend
    on the folder's name; artifacts holding the older whole-config hash still fit; every
    eos id of config.json and generation_config.json stops generation."""
    import dataclasses
    import hashlib
    d = _copy("llama-gqa", tmp_path)
    moved = d.rename(tmp_path / "another-name")
    from dejavu_jax.loading import read_config
    c1, c2 = read_config(HF / "llama-gqa"), read_config(moved)
    assert c1.name != c2.name and c1.fingerprint() == c2.fingerprint()
    fields = dataclasses.asdict(c1)
    for later in ("extra_eos_token_ids", "rope_llama3", "rope_yarn", "rope_dynamic",
                  "rope_longrope", "attn_logit_softcap", "rotary_dim"):  # added since
        fields.pop(later)
    older = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    assert c1.fits_fingerprint(older) and not c2.fits_fingerprint(older)
    assert not c1.fits_fingerprint(dj.preset("llama-tiny").fingerprint())
    cfg = json.loads((moved / "config.json").read_text())
    cfg["eos_token_id"] = [2, 5]
    (moved / "config.json").write_text(json.dumps(cfg))
    (moved / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert read_config(moved).stop_token_ids == [2, 5, 7]


def test_gemma3_multimodal_config_takes_the_text_defaults_of_transformers():
    """A multimodal Gemma 3 `config.json` (gemma-3-4b-it's) lists only the text settings
    that differ from Gemma3TextConfig's defaults, and its end-of-turn id at the top level:
    the config read equals what transformers fills in."""
    from transformers import Gemma3Config
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
          "image_token_index": 262144, "mm_tokens_per_image": 256,
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                          "model_type": "gemma3_text", "num_hidden_layers": 34,
                          "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024}}
    text = Gemma3Config(text_config=dict(hf["text_config"])).text_config
    config = dj.config.from_hf_config(hf)
    assert (config.n_heads, config.n_kv_heads) == (text.num_attention_heads,
                                                    text.num_key_value_heads) == (8, 4)
    assert (config.hidden, config.ffn, config.n_layers, config.head_dim, config.vocab_size) \
        == (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.head_dim,
            text.vocab_size)
    assert config.sliding_layers == tuple(t == "sliding_attention" for t in text.layer_types)
    assert config.sliding_window == text.sliding_window == 1024
    assert config.rope_linear_factor == text.rope_parameters["full_attention"]["factor"] == 8
    assert np.isclose(config.attention_scale, text.query_pre_attn_scalar ** -0.5)
    assert config.stop_token_ids == [1, 106]


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """The Gemma 3 fixture saved as a multimodal checkpoint (text tensors under
    `model.language_model.`, vision tensors beside them, the end-of-turn id at the top
    level) gives transformers' logits of the text model and stops at both end ids."""
    src = HF / "gemma3"
    d = tmp_path / "gemma3-multimodal"
    d.mkdir()
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"] = \
        np.ones((4, 4), np.float32)
    save_file(tensors, d / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3", "eos_token_id": [1, 106],
                                               "text_config": text, "vision_config": {}}))
    ref = np.load(src / "reference.npz")
    config, params = dj.load_pretrained(d, progress=False)
    got = np.asarray(dj.logits(config, params, ref["input_ids"], ref["attention_mask"]))
    real = ref["attention_mask"].astype(bool)
    want = ref["logits"][real]
    assert np.isfinite(got).all()
    assert np.abs(got[real] - want).max() < 1e-4 * np.abs(want).max()
    assert config.stop_token_ids == [text["eos_token_id"], 106]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_absent_kv_heads_and_positions_default_as_in_transformers(model_type):
    """A config.json without num_key_value_heads, max_position_embeddings, head_dim or
    rms_norm_eps reads them as transformers' config class of that model type defaults them
    (Qwen3's head width is 128 whatever the hidden size; Phi-3's eps is 1e-5)."""
    import transformers
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "phi3": transformers.Phi3Config}[model_type]
    raw = dict(model_type=model_type, vocab_size=64, hidden_size=256, num_hidden_layers=2,
               num_attention_heads=32, intermediate_size=64)
    config = dj.config.from_hf_config(raw)
    theirs = cls(**{k: v for k, v in raw.items() if k != "model_type"})
    assert (config.n_kv_heads, config.max_positions) == \
        (theirs.num_key_value_heads, theirs.max_position_embeddings)
    assert config.head_dim == (getattr(theirs, "head_dim", None) or 256 // 32)
    assert config.norm_eps == theirs.rms_norm_eps


def test_gemma2_without_kv_heads_reads_transformers_default():
    """Gemma2Config gives 4 KV heads to a config.json that leaves the key out, whatever the
    query heads (8 here), as the checkpoint's k/v weights then have."""
    import transformers
    raw = dict(model_type="gemma2", vocab_size=64, hidden_size=128, num_hidden_layers=2,
               num_attention_heads=8, intermediate_size=64, head_dim=16)
    theirs = transformers.Gemma2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert dj.config.from_hf_config(raw).n_kv_heads == theirs.num_key_value_heads == 4


@pytest.mark.parametrize("model_type,biased", [("llama", True), ("qwen3", True),
                                                ("qwen2", True), ("mistral", False),
                                                ("phi3", False)])
def test_attention_bias_as_each_architecture_builds_it(model_type, biased):
    """attention_bias true gives q/k/v biases only where transformers' architecture builds
    them from that key (Llama, Qwen3; Qwen2 always has them): Mistral's and Phi-3's
    projections have none whatever it says, so their checkpoints load without biases."""
    raw = dict(model_type=model_type, vocab_size=64, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
               attention_bias=True)
    assert dj.config.from_hf_config(raw).attention_bias is biased


def _shard(directory, weight_map_of):
    """Split ``directory``'s model.safetensors into a.safetensors (even keys) and
    b.safetensors (odd keys), with the index ``weight_map_of({key: shard})`` writes."""
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, directory / name)
    where = {k: name for name, part in shards.items() for k in part}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(weight_map_of(where)))
    return tensors, where


def test_a_sharded_checkpoint_reads_each_tensor_from_the_file_its_index_names(tmp_path):
    """Shards with an index load to Hugging Face's logits. A zeroed copy of a tensor in
    the other shard is not read (the index names the file); a tensor in two files that
    the index does not list, or one the index puts in a file that lacks it, is refused."""
    d = _copy("llama-gqa", tmp_path)
    tensors, where = _shard(d, lambda w: {"metadata": {}, "weight_map": w})
    assert _reference_logits_match(d)
    key = "model.embed_tokens.weight"
    other = "b.safetensors" if where[key] == "a.safetensors" else "a.safetensors"
    copy = load_file(d / other)
    copy[key] = np.zeros_like(tensors[key])
    save_file(copy, d / other)
    assert _reference_logits_match(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight' is in 2 files"):
        dj.load_pretrained(d, progress=False)
    index["weight_map"][key] = other
    index["weight_map"]["model.norm.weight"] = ("b.safetensors" if where["model.norm.weight"]
                                                == "a.safetensors" else "a.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model.norm.weight' in .*does not hold it"):
        dj.load_pretrained(d, progress=False)


@pytest.mark.parametrize("index,message", [
    (lambda w: [], "JSON object with a weight_map"),
    (lambda w: {"weight_map": list(w)}, "weight_map must map"),
    (lambda w: {"weight_map": None}, "weight_map must map"),
    (lambda w: {"weight_map": {k: 3 for k in w}}, "weight_map must map"),
    (lambda w: {"weight_map": {}}, "lists no tensors"),
    (lambda w: {"weight_map": {k: f"../{v}" for k, v in w.items()}}, "is not a file of"),
    (lambda w: {"weight_map": {k: "c.safetensors" for k in w}}, "c.safetensors, which is missing"),
], ids=["array", "list", "null", "numbers", "empty", "outside", "missing"])
def test_a_malformed_shard_index_is_one_checkpoint_error(tmp_path, index, message):
    d = _copy("llama-gqa", tmp_path)
    _shard(d, index)
    with pytest.raises(CheckpointError, match=message):
        dj.load_pretrained(d, progress=False)


@pytest.mark.parametrize("name,key,value,message", [
    ("llama-gqa", "hidden_size", 32.0, "hidden_size must be a whole number"),
    ("llama-gqa", "vocab_size", None, "vocab_size must be a whole number"),
    ("llama-gqa", "num_hidden_layers", True, "num_hidden_layers must be a whole number"),
    ("llama-gqa", "rms_norm_eps", "1e-5", "rms_norm_eps must be a number"),
    ("llama-gqa", "rms_norm_eps", "null", "rms_norm_eps must be a number"),
    ("llama-gqa", "rope_theta", "10000", "rope_theta must be a number"),
    ("llama-gqa", "rope_scaling", "linear", "rope_scaling must be a JSON object"),
    ("llama-gqa", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e4},
     "linear RoPE scaling without a factor"),
    ("llama-gqa", "rope_parameters", {"rope_type": "yarn", "factor": "4", "rope_theta": 1e4},
     "rope_parameters.factor must be a number"),
    ("llama-gqa", "eos_token_id", [[2]], "eos_token_id must be a token id"),
    ("llama-gqa", "tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("mistral-window", "sliding_window", "4", "sliding_window must be a whole number"),
    ("mistral-window", "sliding_window", 4.5, "sliding_window must be a whole number"),
    ("mistral-window", "sliding_window", 0, "sliding_window must be positive"),
    ("gemma3", "text_config", "null", "text_config must be a JSON object"),
], ids=lambda v: str(v)[:24])
def test_config_values_of_the_wrong_type_are_refused_naming_the_key(tmp_path, name, key,
                                                                   value, message):
    """A config.json value of a type the key cannot hold is one CheckpointError naming the
    key (``"null"`` writes JSON null)."""
    d = _copy(name, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    if key == "text_config":
        cfg = {"model_type": "gemma3", "text_config": None}
    else:
        cfg[key] = None if value == "null" else value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        dj.load_pretrained(d, progress=False)


def test_end_ids_outside_the_vocabulary_or_an_empty_list_stop_nothing(tmp_path):
    """An empty eos list loads with no stop ids; end ids past the vocabulary (in
    config.json or generation_config.json, however large) are not stop ids, as no step
    can produce them; a generation_config.json whose ids are not ids is refused."""
    from dejavu_jax.loading import read_config
    d = _copy("llama-gqa", tmp_path)
    vocab = read_config(d).vocab_size
    _edit_config(d, eos_token_id=[])
    assert read_config(d).stop_token_ids == []
    _edit_config(d, eos_token_id=[vocab, 2])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [10 ** 30, -1, 3]}))
    assert read_config(d).stop_token_ids == [2, 3]
    config, params = dj.load_pretrained(d, dtype=jnp.float32, progress=False)
    out = dj.generate_tokens(dj.dense_engine(config), params, [[1, 4, 5]],
                             max_new_tokens=3).tokens
    assert len(out) == 1 and len(out[0]) >= 1 and all(0 <= i < vocab for i in out[0])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id must be"):
        read_config(d)
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json: unreadable"):
        read_config(d)
