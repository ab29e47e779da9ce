"""Where the project finds its offline data and caches."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """The shared data folder: $DEJAVU_DATA, else ../shared/data beside the repository."""
    env = os.environ.get("DEJAVU_DATA")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "data").resolve()


def cache_root() -> Path:
    """Downloads and derived artifacts: $DEJAVU_CACHE, else ~/.cache/dejavu_jax."""
    env = os.environ.get("DEJAVU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dejavu_jax"


def opt_tokenizer_dir() -> Path:
    """The offline OPT tokenizer (Hugging Face format) in the data folder."""
    return data_root() / "tokenizers" / "opt"
