"""Checkpoint loading: clear errors that name the file and key."""

import importlib.util
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


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="checks the error shown when torch is absent")
def test_pytorch_bin_without_torch_is_a_clear_error():
    with pytest.raises(CheckpointError, match="needs torch"):
        dj.load_pretrained(HF / "opt-bin", progress=False)


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
