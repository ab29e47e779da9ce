"""PyTorch's checkpoint files (`torch.save`, the zip format of torch >= 1.6) read without
torch: the tensors of a pytorch_model.bin as read-only numpy views of the file.

The archive holds a pickle (`<name>/data.pkl`) of the state dict, whose tensors refer by
key to raw storages (`<name>/data/<key>`, stored uncompressed). The pickle is read by an
unpickler that builds only what a state dict needs (ordered dicts, tensors, parameters,
storage types) and refuses any other global, as `torch.load(weights_only=True)` does; each
storage is a slice of one memory map of the file, so nothing is read until used.
"""

from __future__ import annotations

import collections
import io
import mmap
import pickle
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

STORAGE_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class TorchCheckpointError(ValueError):
    """A file is not a readable torch zip checkpoint of tensors."""


class _StorageType:
    def __init__(self, name: str):
        self.dtype = np.dtype(STORAGE_DTYPES[name])


def _rebuild_tensor(storage, offset, size, stride, *_):
    size, stride = tuple(size), tuple(stride)
    if any(n < 0 for n in size) or any(s < 0 for s in stride) or offset < 0:
        raise TorchCheckpointError(f"a tensor with size {size}, stride {stride} and offset "
                                   f"{offset}")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    if last >= storage.size:
        raise TorchCheckpointError(f"a tensor of size {size} (stride {stride}, offset "
                                   f"{offset}) reaches past its storage of {storage.size}")
    if not all(size):
        return np.zeros(size, storage.dtype)
    item = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], size,
                                           tuple(s * item for s in stride), writeable=False)


def _rebuild_parameter(data, *_):
    return data


_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): tuple,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage):
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def find_class(self, module, name):
        if (module, name) not in _GLOBALS:
            raise TorchCheckpointError(f"it pickles {module}.{name}, which a state dict of "
                                       f"tensors does not hold")
        return _GLOBALS[(module, name)]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise TorchCheckpointError(f"an unknown persistent id {pid!r:.80}")
        return self._storage(str(pid[2]), pid[1].dtype, int(pid[4]))


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """{name: read-only numpy array} of a torch zip checkpoint, each a view of a memory
    map of the file (bfloat16 as ml_dtypes.bfloat16). TorchCheckpointError for a file
    that is not such a checkpoint (a legacy torch < 1.6 file, a truncated archive, a
    pickle of anything but tensors)."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise TorchCheckpointError(f"not a torch zip checkpoint ({e}); files written by "
                                   f"torch < 1.6 must be re-saved") from None
    with archive, open(path, "rb") as f:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise TorchCheckpointError(f"expected one <name>/data.pkl in the archive, found "
                                       f"{len(pickles)}")
        root = pickles[0][:-len("data.pkl")]
        order = root + "byteorder"
        if order in archive.namelist() and archive.read(order).strip() != b"little":
            raise TorchCheckpointError("a big-endian checkpoint")
        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) \
            if path.stat().st_size else memoryview(b"")
        storages: dict[str, np.ndarray] = {}

        def storage(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
            if key not in storages:
                storages[key] = _storage_array(archive, view, root + "data/" + key, dtype,
                                               numel)
            return storages[key]

        try:
            state = _Unpickler(archive.read(pickles[0]), storage).load()
        except TorchCheckpointError:
            raise
        except Exception as e:  # a damaged pickle raises many types
            raise TorchCheckpointError(f"unreadable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()):
        raise TorchCheckpointError("the pickle is not a dict of named tensors")
    return dict(state)


def _storage_array(archive: zipfile.ZipFile, view: memoryview, name: str, dtype: np.dtype,
                   numel: int) -> np.ndarray:
    """A storage's elements: a view of the mapped file (torch stores them uncompressed)."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise TorchCheckpointError(f"the storage {name} is missing") from None
    if info.file_size != numel * dtype.itemsize:
        raise TorchCheckpointError(f"the storage {name} holds {info.file_size} bytes, not "
                                   f"{numel} x {dtype.itemsize}")
    if info.compress_type != zipfile.ZIP_STORED:
        return np.frombuffer(archive.read(name), dtype)
    header = bytes(view[info.header_offset:info.header_offset + 30])
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise TorchCheckpointError(f"the storage {name} has no local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > len(view):
        raise TorchCheckpointError(f"the storage {name} runs past the end of the file")
    return np.frombuffer(view[start:start + info.file_size], dtype)
