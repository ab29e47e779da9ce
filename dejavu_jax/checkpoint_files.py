"""Reading named tensors from Hugging Face checkpoint files, lazily and without torch.

`open_tensors(dir)` returns a TensorSource over model.safetensors, sharded safetensors
(with an index) or pytorch_model*.bin (this last one needs torch). A missing, truncated or
corrupt file raises CheckpointError naming it.

Safetensors are read with `safetensors.safe_open(...).get_slice`, which copies each
tensor out of the file when it is asked for. A numpy memmap of the raw bytes was not worth
its hand-written header parsing: on a 1.0 GB fp16 OPT checkpoint (opt-1.3b width, 8
layers, CPU, page cache warm) `load_pretrained` took 14-23 s either way, and
`load_pretrained_sharded` over 8 devices, whose callbacks each read whole tensors from
safe_open, 4.2-5.9 s against 3.9-4.9 s with the memmap's views.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # also registers bfloat16 with numpy, which safe_open needs for BF16
import numpy as np


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


def _safetensors_source(files: list[Path]) -> TensorSource:
    """Tensors of safetensors files through `safetensors.safe_open`, which checks each
    header (its length, JSON, dtypes, and offsets that cover the file exactly)."""
    from safetensors import SafetensorError, safe_open
    handles = {}
    index = {}
    for path in files:
        try:
            handles[path] = safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        for key in handles[path].keys():
            index[key] = path

    def read(key: str, path: Path) -> np.ndarray:
        try:
            return handles[path].get_slice(key)[...]
        except (SafetensorError, TypeError) as e:  # TypeError: a dtype numpy lacks
            raise CheckpointError(f"{path}: cannot read tensor {key!r} ({e})") from None

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
