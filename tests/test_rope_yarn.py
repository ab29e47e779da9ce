"""YaRN RoPE settings read from config.json, and YaRN's frequencies against numpy.

The Hugging Face parity of a YaRN checkpoint (factor 4, beta 16 / 2, untruncated ramp) is
in test_model.py (the llama-yarn fixture); these cases cover the settings that fixture
leaves at one value."""

import math

import numpy as np
import pytest

from dejavu_jax import ops
from dejavu_jax.config import from_hf_config

QWEN = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=160,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32768, rope_theta=1e6)


def qwen_with(rope_scaling, **top):
    return from_hf_config({**QWEN, **top, "rope_scaling": rope_scaling})


def test_the_older_rope_scaling_form_as_qwen_documents_it():
    config = qwen_with({"type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 32768})
    assert config.rope_theta == 1e6 and config.rope_linear_factor == 1.0
    factor, attention, beta_fast, beta_slow, original, truncate = config.rope_yarn
    assert (factor, beta_fast, beta_slow, original, truncate) == (4.0, 32.0, 1.0, 32768.0, 1.0)
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_mscale_and_a_missing_factor():
    config = qwen_with({"rope_type": "yarn", "original_max_position_embeddings": 4096,
                        "mscale": 0.707, "mscale_all_dim": 1.0})
    factor, attention = config.rope_yarn[:2]
    assert factor == 32768 / 4096
    assert attention == pytest.approx((0.1 * 0.707 * math.log(8) + 1) / (0.1 * math.log(8) + 1))
    assert qwen_with({"rope_type": "yarn", "factor": 2.0,
                      "attention_factor": 0.5}).rope_yarn[1] == 0.5


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_against_numpy(truncate):
    """theta 1e4, head_dim 32, factor 8 over an original 64 positions: with the default
    betas the ramp runs from index -1.99 (0 once clamped) to 4.03 (5 truncated), so the
    truncated and untruncated ramps differ."""
    head_dim, theta, factor, original = 32, 1e4, 8.0, 64.0
    base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    got = np.asarray(ops.yarn_inverse_frequencies(base.astype(np.float32), head_dim, theta,
                                                  factor, 32.0, 1.0, original,
                                                  1.0 if truncate else 0.0))
    turns_index = lambda r: head_dim * np.log(original / (r * 2 * np.pi)) / (2 * np.log(theta))
    low, high = turns_index(32.0), turns_index(1.0)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
    want = base * (1 - ramp) + base / factor * ramp
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] == pytest.approx(base[0]) and got[-1] == pytest.approx(base[-1] / factor)


def test_yarn_tables_carry_the_attention_factor():
    yarn = (4.0, 1.25, 32.0, 1.0, 64.0, 1.0)
    positions = np.arange(5)
    cos, sin = ops.rope_tables(positions, 16, 1e4, yarn=yarn)
    np.testing.assert_allclose(np.asarray(cos[0]), 1.25, rtol=1e-6)  # angle 0 at position 0
    np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, 1.25 ** 2,
                               rtol=1e-5)


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 64},
     "yarn RoPE factor must be positive"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope type 'longrope' is not supported"),
])
def test_unsupported_or_bad_settings_are_refused(scaling, words):
    with pytest.raises(ValueError, match=words):
        qwen_with(scaling)
