"""Where the project finds its offline data and caches."""

from __future__ import annotations

import os
import socket
import urllib.parse
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """The offline data folder: $DEJAVU_DATA, else ../shared/data beside the repository
    (its layout: tokenizers/opt/, eval/wikitext-2/, eval/tasks/, corpus/)."""
    env = os.environ.get("DEJAVU_DATA")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "data").resolve()


def cache_root() -> Path:
    """Downloads and derived artifacts: $DEJAVU_CACHE, else ~/.cache/dejavu_jax."""
    env = os.environ.get("DEJAVU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dejavu_jax"


def opt_tokenizer_dir() -> Path:
    """The offline OPT tokenizer (Hugging Face format) in the data folder."""
    return data_root() / "tokenizers" / "opt"


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set (the libraries then read their
    caches only)."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (`HF_ENDPOINT`, default huggingface.co) accepts a
    connection within `timeout` seconds; False at once when HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE is set. Spares a machine without network the libraries' retries."""
    if hub_offline():
        return False
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout).close()
        return True
    except (OSError, ValueError):
        return False


class MissingDataError(FileNotFoundError):
    """An offline data file is absent; the message says where it was looked for and how to
    provide it."""


def data_file(relative: str, what: str, hint: str = "") -> Path:
    """data_root() / relative when it exists, else MissingDataError naming `what`, the path
    and the DEJAVU_DATA layout that provides it (then `hint`, e.g. another way out)."""
    path = data_root() / relative
    if path.exists():
        return path
    where = ("DEJAVU_DATA=" + os.environ["DEJAVU_DATA"] if "DEJAVU_DATA" in os.environ
             else "the default data folder")
    raise MissingDataError(f"{what} not found: no {path} ({where}); set DEJAVU_DATA=DIR to "
                           f"a folder holding {relative} (layout: eval/README.md){hint}")
