"""Reading named tensors from Hugging Face checkpoint files, lazily and without torch.

`open_tensors(dir)` returns a TensorSource over model.safetensors, sharded safetensors
(with an index) or pytorch_model*.bin (torch's zip format). A missing, truncated or
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


def _safetensors_source(files: list[Path], weight_map: dict[str, Path] | None = None
                        ) -> TensorSource:
    """Tensors of safetensors files through `safetensors.safe_open`, which checks each
    header (its length, JSON, dtypes, and offsets that cover the file exactly); a sharded
    checkpoint's tensors from the files its index names (:func:`_follow_index`)."""
    from safetensors import SafetensorError, safe_open
    handles = {}
    found: dict[str, list[Path]] = {}
    for path in files:
        try:
            handles[path] = safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        for key in handles[path].keys():
            found.setdefault(key, []).append(path)
    index = _follow_index(found, weight_map, files[0].parent)

    def read(key: str, path: Path) -> np.ndarray:
        try:
            return handles[path].get_slice(key)[...]
        except (SafetensorError, TypeError) as e:  # TypeError: a dtype numpy lacks
            raise CheckpointError(f"{path}: cannot read tensor {key!r} ({e})") from None

    return TensorSource(index, read)


def _torch_source(files: list[Path], weight_map: dict[str, Path] | None = None
                  ) -> TensorSource:
    """Tensors of torch.save'd files (pytorch_model*.bin), read without torch
    (:mod:`dejavu_jax.torch_checkpoint`); a sharded checkpoint's from its index."""
    from dejavu_jax.torch_checkpoint import TorchCheckpointError, read_state_dict
    tensors = {}
    found: dict[str, list[Path]] = {}
    for path in files:
        try:
            tensors[path] = read_state_dict(path)
        except (TorchCheckpointError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read pytorch checkpoint ({e})") from None
        for key in tensors[path]:
            found.setdefault(key, []).append(path)
    index = _follow_index(found, weight_map, files[0].parent)
    return TensorSource(index, lambda key, path: tensors[path][key])


def _shard_index(directory: Path, index_name: str) -> dict[str, Path]:
    """{tensor name: shard file} of a sharded checkpoint's index (its ``weight_map``);
    CheckpointError for an index that is unreadable, maps a name to anything but a file
    name inside the directory, or names a missing shard."""
    index_path = directory / index_name
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{index_path}: unreadable shard index ({e})") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        raise CheckpointError(f"{index_path}: a shard index is a JSON object with a "
                              f"weight_map")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to shard "
                              f"file names")
    if not weight_map:
        raise CheckpointError(f"{index_path}: weight_map lists no tensors")
    shards = {}
    for name in set(weight_map.values()):
        path = directory / name
        if Path(name).is_absolute() or path.resolve().parent != directory.resolve():
            raise CheckpointError(f"{index_path}: shard {name!r} is not a file of "
                                  f"{directory}")
        if not path.is_file():
            raise CheckpointError(f"{index_path}: lists shard {name}, which is missing")
        shards[name] = path
    return {key: shards[name] for key, name in weight_map.items()}


def _follow_index(found: dict[str, list[Path]], weight_map: dict[str, Path] | None,
                  where: Path) -> dict[str, Path]:
    """{tensor name: file} from the names each file holds: the index's file for a name it
    lists (CheckpointError when that file lacks it), else the one file holding it
    (CheckpointError when several do and the index names none of them)."""
    weight_map = weight_map or {}
    index = {}
    for key, paths in found.items():
        if key in weight_map:
            continue
        if len(paths) > 1:
            raise CheckpointError(f"{where}: tensor {key!r} is in {len(paths)} files "
                                  f"({', '.join(p.name for p in paths)})")
        index[key] = paths[0]
    for key, path in weight_map.items():
        if path not in found.get(key, []):
            raise CheckpointError(f"{where}: the index puts tensor {key!r} in {path.name}, "
                                  f"which does not hold it")
        index[key] = path
    return index


def open_tensors(directory: Path) -> TensorSource:
    """A TensorSource over the weight files of a Hugging Face checkpoint directory."""
    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return _safetensors_source([directory / "model.safetensors"])
    if (directory / "model.safetensors.index.json").exists():
        shards = _shard_index(directory, "model.safetensors.index.json")
        return _safetensors_source(sorted(set(shards.values())), shards)
    if (directory / "pytorch_model.bin").exists():
        return _torch_source([directory / "pytorch_model.bin"])
    if (directory / "pytorch_model.bin.index.json").exists():
        shards = _shard_index(directory, "pytorch_model.bin.index.json")
        return _torch_source(sorted(set(shards.values())), shards)
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise CheckpointError(
        f"{directory}: no weights found (looked for model.safetensors, "
        f"model.safetensors.index.json, pytorch_model.bin[.index.json]); directory has: "
        f"{found}")


class DictSource(TensorSource):
    """A TensorSource over an in-memory dict, labelled with the file it came from."""

    def __init__(self, tensors: dict[str, np.ndarray], origin: Path):
        super().__init__({k: Path(origin) for k in tensors}, lambda k, _: tensors[k])
