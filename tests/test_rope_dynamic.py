"""Dynamic NTK RoPE: the default frequencies up to max_position_embeddings, as
transformers computes them there (its `dynamic_rope_update` rescales only once a sequence
passes them), and a clear error past them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import model
from dejavu_jax.config import from_hf_config

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=16, rope_theta=10000.0)


def dynamic(**rope):
    return from_hf_config({**LLAMA, "rope_scaling": {"rope_type": "dynamic", **rope}})


def test_dynamic_rope_is_read_and_its_factor_checked():
    config = dynamic(factor=2.0)
    assert config.rope_dynamic and config.rope_linear_factor == 1.0
    assert config.rope_llama3 is None and config.rope_yarn is None
    assert from_hf_config({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 4}}
                          ).rope_dynamic   # the older key
    assert not from_hf_config(LLAMA).rope_dynamic
    assert config.fingerprint() != from_hf_config(LLAMA).fingerprint()
    for bad in ({}, {"factor": 0.5}):
        with pytest.raises(ValueError, match="dynamic RoPE scaling needs a factor"):
            dynamic(**bad)
    with pytest.raises(ValueError, match=r"rope_\w+\.factor must be a number, got '2'"):
        dynamic(factor="2")


def test_within_its_positions_dynamic_rope_gives_the_default_ropes_logits():
    config = dynamic(factor=2.0)
    default = from_hf_config(LLAMA)
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    got = np.asarray(dj.logits(config, params, ids))
    want = np.asarray(dj.logits(default, params, ids))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_positions_past_the_limit_are_refused():
    config = dynamic(factor=2.0)
    default = from_hf_config(LLAMA)
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.2)
    long = jnp.ones((1, 17), jnp.int32)
    with pytest.raises(ValueError, match="17 tokens exceed the model's 16 positions"):
        dj.logits(config, params, long)
    assert np.isfinite(np.asarray(dj.logits(default, params, long))).all()

    ids = jnp.ones((1, 16), jnp.int32)
    state = model.init_state(config, 1, 32, jnp.float32)
    _, state = model.prefill(config, params, ids, jnp.ones_like(ids), state)
    with pytest.raises(ValueError, match="dynamic RoPE"):
        model.decode_step(config, params, state, jnp.asarray([3]))
    with pytest.raises(ValueError, match="exceeds the model's 16 positions"):
        dj.generate_tokens(dj.dense_engine(config), params, [[1, 2, 3]], max_new_tokens=14)


def test_a_dynamic_rope_checkpoint_gives_hugging_faces_logits(tmp_path):
    """The llama-gqa fixture with dynamic scaling (factor 2) in its config.json: its 16
    positions lie within the 128 of max_position_embeddings, where transformers 5.17 gives
    exactly its default-RoPE logits (the fixture's reference), and so does this model."""
    import json
    import shutil
    from pathlib import Path
    src = Path(__file__).parent / "fixtures" / "hf" / "llama-gqa"
    d = tmp_path / "llama-dynamic"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0,
                              "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (d / "config.json").write_text(json.dumps(cfg))
    config, params = dj.load_pretrained(d, dtype=jnp.float32, progress=False)
    assert config.rope_dynamic and config.max_positions == 128
    ref = np.load(d / "reference.npz")
    out = np.asarray(dj.logits(config, params, ref["input_ids"], ref["attention_mask"]))
    real = ref["attention_mask"].astype(bool)
    want = ref["logits"][real]
    assert np.isfinite(out[real]).all()
    assert np.abs(out[real] - want).max() <= 1e-4 * np.abs(want).max()
