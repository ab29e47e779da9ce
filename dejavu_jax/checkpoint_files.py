"""Reading named tensors from Hugging Face checkpoint files, lazily and without torch.

`open_tensors(dir)` returns a TensorSource over model.safetensors, sharded safetensors
(with an index) or pytorch_model*.bin (this last one needs torch).
"""

from __future__ import annotations

import json
import struct as pystruct
from pathlib import Path

import ml_dtypes
import numpy as np

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not match the model."""


class TensorSource:
    """Named tensors spread over one or more files: `keys()`, `get(key)`, `file_of(key)`."""

    def __init__(self, index: dict[str, Path], reader):
        self._index = index
        self._reader = reader

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def file_of(self, key: str) -> Path:
        """The file that holds tensor `key`."""
        return self._index[key]

    def get(self, key: str) -> np.ndarray:
        """Tensor `key` as a numpy array (memory-mapped where the format allows)."""
        return self._reader(key, self._index[key])


def _safetensors_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = pystruct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _safetensors_source(files: list[Path]) -> TensorSource:
    headers = {}
    index = {}
    for path in files:
        header, offset = _safetensors_header(path)
        headers[path] = (header, offset)
        for key in header:
            index[key] = path

    def read(key: str, path: Path) -> np.ndarray:
        header, offset = headers[path]
        meta = header[key]
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        count = int(np.prod(meta["shape"])) if meta["shape"] else 1
        if end - start != count * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{path}: tensor {key!r} byte size does not match its shape")
        arr = np.memmap(path, dtype=dtype, mode="r", offset=offset + start, shape=(count,))
        return arr.reshape(meta["shape"])

    return TensorSource(index, read)


def _torch_source(files: list[Path]) -> TensorSource:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{files[0]}: reading pytorch_model.bin needs torch, which is not installed. "
            "Install torch, or convert the checkpoint to safetensors.") from None
    tensors = {}
    index = {}
    for path in files:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for corrupt files
            raise CheckpointError(f"{path}: cannot read pytorch checkpoint ({e})") from None
        for key, t in sd.items():
            tensors[key] = t
            index[key] = path

    def read(key: str, path: Path) -> np.ndarray:
        t = tensors[key]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    return TensorSource(index, read)


def _sharded_files(directory: Path, index_name: str) -> list[Path]:
    index_path = directory / index_name
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index_path}: unreadable shard index ({e})") from None
    files = sorted({directory / name for name in weight_map.values()})
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{index_path}: lists shard {f.name}, which is missing")
    return files


def open_tensors(directory: Path) -> TensorSource:
    """A TensorSource over the weight files of a Hugging Face checkpoint directory."""
    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return _safetensors_source([directory / "model.safetensors"])
    if (directory / "model.safetensors.index.json").exists():
        return _safetensors_source(_sharded_files(directory, "model.safetensors.index.json"))
    if (directory / "pytorch_model.bin").exists():
        return _torch_source([directory / "pytorch_model.bin"])
    if (directory / "pytorch_model.bin.index.json").exists():
        return _torch_source(_sharded_files(directory, "pytorch_model.bin.index.json"))
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise CheckpointError(
        f"{directory}: no weights found (looked for model.safetensors, "
        f"model.safetensors.index.json, pytorch_model.bin[.index.json]); directory has: "
        f"{found}")


class DictSource(TensorSource):
    """A TensorSource over an in-memory dict, labelled with the file it came from."""

    def __init__(self, tensors: dict[str, np.ndarray], origin: Path):
        super().__init__({k: Path(origin) for k in tensors}, lambda k, _: tensors[k])
