"""Fused q/k/v and gate/up tensors (Phi-3's) split into the per-projection names."""

from pathlib import Path

import numpy as np
import pytest

from dejavu_jax.checkpoint_files import CheckpointError, TensorSource
from dejavu_jax.config import from_hf_config
from dejavu_jax.fused_tensors import split_fused_projections

PHI3 = dict(model_type="phi3", vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def _source(tensors):
    return TensorSource({k: Path("m.safetensors") for k in tensors},
                        lambda key, _path: tensors[key])


def test_parts_are_the_fused_rows_in_order():
    config = from_hf_config(PHI3)
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((4 * 8 + 2 * 2 * 8, 32)).astype(np.float32)
    gate_up = rng.standard_normal((2 * 48, 32)).astype(np.float32)
    norm = rng.standard_normal(32).astype(np.float32)
    split = split_fused_projections(config, _source({
        "model.layers.0.self_attn.qkv_proj.weight": qkv,
        "model.layers.0.mlp.gate_up_proj.weight": gate_up,
        "model.layers.0.input_layernorm.weight": norm}))
    stem = "model.layers.0."
    assert sorted(split.keys()) == sorted(stem + k for k in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight"))
    np.testing.assert_array_equal(split.get(stem + "self_attn.q_proj.weight"), qkv[:32])
    np.testing.assert_array_equal(split.get(stem + "self_attn.k_proj.weight"), qkv[32:48])
    np.testing.assert_array_equal(split.get(stem + "self_attn.v_proj.weight"), qkv[48:])
    np.testing.assert_array_equal(split.get(stem + "mlp.gate_proj.weight"), gate_up[:48])
    np.testing.assert_array_equal(split.get(stem + "mlp.up_proj.weight"), gate_up[48:])
    np.testing.assert_array_equal(split.get(stem + "input_layernorm.weight"), norm)


def test_a_checkpoint_without_fused_tensors_passes_through():
    config = from_hf_config(PHI3)
    source = _source({"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 32))})
    assert split_fused_projections(config, source) is source


def test_a_fused_tensor_of_other_rows_is_refused():
    config = from_hf_config(PHI3)
    split = split_fused_projections(config, _source({
        "model.layers.0.mlp.gate_up_proj.weight": np.zeros((2 * 40, 32), np.float32)}))
    with pytest.raises(CheckpointError, match="expected 96 rows"):
        split.get("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("rope", [{"type": "su"}, {"type": "yarn", "factor": 2.0}])
def test_phi3_longrope_without_short_factors_is_refused(rope):
    """Phi3Config reads "su" and "yarn" as its longrope, which needs its short factors."""
    with pytest.raises(ValueError, match="longrope RoPE scaling needs short_factor"):
        from_hf_config({**PHI3, "rope_scaling": rope})

