"""The torch-free reader of torch.save checkpoints against the tensors torch wrote
(tests/fixtures/make_torch_checkpoints.py)."""
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dejavu_jax.torch_checkpoint import TorchCheckpointError, read_state_dict

FIXTURES = Path(__file__).parent / "fixtures" / "torch"
NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
                "bfloat16": ml_dtypes.bfloat16, "int64": np.int64, "int32": np.int32,
                "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


def test_every_dtype_view_and_parameter_equals_what_torch_saved():
    want = np.load(FIXTURES / "tensors.npz")
    dtypes = dict(want["__dtypes__"])
    got = read_state_dict(FIXTURES / "tensors.bin")
    assert list(got) == [k for k in want.files if k != "__dtypes__"]
    for name, array in got.items():
        assert array.dtype == NUMPY_DTYPES[dtypes[name]], name
        assert array.shape == want[name].shape, name
        np.testing.assert_array_equal(array.astype(want[name].dtype), want[name], err_msg=name)
    assert got["transposed"].strides == (4, 20)             # torch's stride (1, 5), in bytes
    np.testing.assert_array_equal(got["rows"], got["base"][2:5])
    assert not got["base"].flags.writeable


def test_a_legacy_file_is_refused_with_its_cause():
    with pytest.raises(TorchCheckpointError, match="torch < 1.6"):
        read_state_dict(FIXTURES / "legacy.bin")


def test_a_pickle_of_other_objects_is_refused():
    with pytest.raises(TorchCheckpointError, match="collections.Counter"):
        read_state_dict(FIXTURES / "not-tensors.bin")


@pytest.mark.parametrize("keep", [0.5, 0.97])
def test_a_truncated_file_is_refused(tmp_path, keep):
    data = (FIXTURES / "tensors.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(TorchCheckpointError):
        read_state_dict(tmp_path / "cut.bin")


def test_a_storage_of_the_wrong_size_is_refused(tmp_path):
    """The archive's entry for a storage must hold exactly its elements' bytes."""
    import zipfile
    src = zipfile.ZipFile(FIXTURES / "tensors.bin")
    with zipfile.ZipFile(tmp_path / "short.bin", "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            if "/data/" in info.filename and info.filename.endswith("/0"):
                data = data[:-2]
            out.writestr(info.filename, data)
    with pytest.raises(TorchCheckpointError, match="holds"):
        read_state_dict(tmp_path / "short.bin")


def test_a_checkpoint_directory_of_a_legacy_file_names_it(tmp_path):
    import dejavu_jax as dj
    from dejavu_jax.checkpoint_files import CheckpointError
    hf = Path(__file__).parent / "fixtures" / "hf" / "opt-bin"
    shutil.copy(hf / "config.json", tmp_path / "config.json")
    shutil.copy(FIXTURES / "legacy.bin", tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*torch < 1.6"):
        dj.load_pretrained(tmp_path, progress=False)


def test_a_sharded_checkpoint_reads_each_tensor_from_its_shard():
    """pytorch_model.bin.index.json and its two shards, through `open_tensors`."""
    from dejavu_jax.checkpoint_files import open_tensors
    want = np.load(FIXTURES / "tensors.npz")
    source = open_tensors(FIXTURES / "sharded")
    assert sorted(source.keys()) == sorted(k for k in want.files if k != "__dtypes__")
    assert {source.file_of(k).name for k in source.keys()} == {
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"}
    for name in source.keys():
        np.testing.assert_array_equal(source.get(name).astype(want[name].dtype), want[name])
