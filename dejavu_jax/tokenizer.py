"""Tokenizer loading: Hugging Face tokenizer folders and GGUF-embedded vocabularies."""

from __future__ import annotations

import os
from pathlib import Path

from dejavu_jax.checkpoint_files import CheckpointError
from dejavu_jax.cli import first_line
from dejavu_jax.config import ModelConfig
from dejavu_jax.paths import opt_tokenizer_dir

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(directory: Path) -> bool:
    """Whether a folder holds Hugging Face tokenizer files."""
    return directory.is_dir() and any((directory / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from a folder, or from the vocabulary inside a .gguf file.
    FileNotFoundError for a folder with no tokenizer files, CheckpointError naming the
    folder or file when its tokenizer files cannot be read."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from dejavu_jax.gguf_loader import tokenizer_from_gguf
        return _readable(tokenizer_from_gguf, path)
    if not has_tokenizer(path):
        raise FileNotFoundError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer
    return _readable(lambda p: AutoTokenizer.from_pretrained(str(p)), path)


def _readable(load, path: Path):
    """load(path); any failure (a corrupt file the tokenizer libraries reject) raised as
    a CheckpointError naming `path`."""
    try:
        return load(path)
    except CheckpointError:
        raise
    except Exception as e:  # the libraries' own errors: Exception, ValueError, OSError, ...
        reason = first_line(e)
        raise CheckpointError(f"{path}: not a readable tokenizer ({type(e).__name__}: "
                              f"{reason})") from None


def _gguf_has_tokenizer(path: Path) -> bool:
    """Whether a GGUF file holds a vocabulary (a file may hold the weights alone)."""
    from dejavu_jax.gguf_loader import gguf_metadata
    return "tokenizer.ggml.model" in gguf_metadata(path)


def default_tokenizer_for(config: ModelConfig, model_path: Path | None):
    """The tokenizer that goes with a model: its own files, else OPT's shared tokenizer.

    Returns None when none can be found (callers then work on token ids only).
    """
    if model_path is not None:
        if model_path.suffix == ".gguf" and _gguf_has_tokenizer(model_path):
            return load_tokenizer(model_path)
        if has_tokenizer(model_path):
            return load_tokenizer(model_path)
    if config.family == "opt" and has_tokenizer(opt_tokenizer_dir()):
        return load_tokenizer(opt_tokenizer_dir())
    return None


def leading_special_ids(tok) -> list[int]:
    """The ids the tokenizer puts before any text by default (Gemma's <bos>; none for
    most): a model trained with them is scored with them, as lm-eval scores Gemma."""
    plain = tok("a", add_special_tokens=False)["input_ids"]
    full = tok("a")["input_ids"]
    n = len(full) - len(plain)
    return list(full[:n]) if n > 0 and full[n:] == plain else []
