"""Text corpus -> fixed-length token windows, deterministic for a given seed.

Each file is cut at line boundaries into chunks long enough for one window; the chunks
of all files are shuffled together (so a short run still samples every file) and each
is tokenised into one window: an optional BOS token followed by the chunk's first
tokens. Chunks too short for a window are skipped. A chunk far longer than one window
(a long line) gives more windows: its text past the first window's generous share is cut
at spaces into further pieces, which follow all the chunks, shuffled among themselves.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from dejavu_jax.cli import first_line
from dejavu_jax.paths import data_root, hub_offline, hub_reachable

CHARS_PER_TOKEN = 6  # generous: English BPE averages about 4 characters per token


class CorpusError(RuntimeError):
    """The corpus is missing, unreadable or holds no usable text."""


def default_corpus() -> list[str]:
    """The shared corpus glob: <data root>/corpus/*.txt."""
    return [str(data_root() / "corpus" / "*.txt")]


def resolve_files(patterns: list[str]) -> list[Path]:
    """Expand files, folders (their *.txt) and globs into a sorted, de-duplicated list."""
    files: list[Path] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            matches = sorted(p.glob("*.txt"))
        elif p.exists():
            matches = [p]
        else:
            matches = sorted(Path(m) for m in glob.glob(str(p)))
        if not matches:
            raise CorpusError(f"corpus {pattern!r}: no such file, or no files match")
        files.extend(matches)
    return sorted(dict.fromkeys(f.resolve() for f in files))


def read_text(path: Path) -> str:
    """A corpus file's text (UTF-8); CorpusError naming the file when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"corpus file {path}: cannot read it as UTF-8 text ({e})") from None


def chunks(text: str, min_chars: int) -> list[str]:
    """Consecutive pieces of `text`, cut at line ends, each at least min_chars long."""
    out, buf, size = [], [], 0
    for line in text.splitlines(keepends=True):
        buf.append(line)
        size += len(line)
        if size >= min_chars:
            out.append("".join(buf))
            buf, size = [], 0
    return out


def overflow(chunk: str, min_chars: int) -> list[str]:
    """The pieces of `chunk` past its first 2 * min_chars characters (which its own window
    reads from), cut after whitespace, each at least min_chars long and not blank."""
    out, start = [], 2 * min_chars
    while len(chunk) - start >= min_chars:
        end = start + min_chars
        while end < len(chunk) and not chunk[end - 1].isspace():
            end += 1
        if chunk[start:end].strip():
            out.append(chunk[start:end])
        start = end
    return out


def corpus_chunks(files: list[Path], window: int) -> list[str]:
    """All chunks of all files; raises CorpusError when the corpus has no usable text."""
    if not files:
        raise CorpusError("the corpus file list is empty")
    out = []
    for f in files:
        text = read_text(f)
        out.extend(c for c in chunks(text, window * CHARS_PER_TOKEN) if c.strip())
    if not out:
        total = sum(os.path.getsize(f) for f in files)
        raise CorpusError(f"corpus ({len(files)} files, {total} bytes) has no chunk long "
                          f"enough for a {window}-token window: {', '.join(map(str, files))}")
    return out


def token_windows(tokenizer, files: list[Path], window: int, seed: int,
                  bos_id: int | None, batch: int = 32) -> Iterator[np.ndarray]:
    """Yield int32 windows [window] in a seeded order until the corpus runs out.

    With bos_id, each window is [bos] + window-1 corpus tokens.
    """
    texts = corpus_chunks(files, window)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    extra = [p for t in texts for p in overflow(t, window * CHARS_PER_TOKEN)]
    picks = [texts[i] for i in order] + [extra[i] for i in rng.permutation(len(extra))]
    body = window - (bos_id is not None)
    for start in range(0, len(picks), batch):
        picked = picks[start:start + batch]
        encoded = tokenizer(picked, add_special_tokens=False)["input_ids"]
        for ids in encoded:
            if len(ids) < body:
                continue
            ids = ids[:body] if bos_id is None else [bos_id] + ids[:body]
            yield np.asarray(ids, np.int32)


def describe_files(files: list[Path]) -> list[dict]:
    """Name and size of each corpus file, for manifests."""
    return [{"path": str(f), "bytes": os.path.getsize(f)} for f in files]


def dataset_to_file(spec: str, max_chars: int = 50_000_000) -> Path:
    """Text of a Hugging Face dataset, written once to a cached .txt file for collection.

    spec is NAME, NAME:CONFIG or NAME:CONFIG:SPLIT (split defaults to "train"; the text
    column is "text"). Needs the `datasets` package and a reachable hub (or its cache).
    """
    from dejavu_jax.paths import cache_root
    name, config, split = (spec.split(":") + [None, None])[:3]
    target = cache_root() / "corpora" / (spec.replace("/", "__").replace(":", "--") + ".txt")
    if target.is_file():
        return target
    if not hub_offline() and not hub_reachable():  # offline: the datasets cache only
        raise CorpusError(f"dataset {spec!r}: the Hugging Face hub is not reachable (pass "
                          "--corpus FILE)")
    try:
        import datasets
        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except ImportError:
        raise CorpusError("reading a Hugging Face dataset needs the `datasets` package") from None
    except Exception as e:  # hub and dataset errors come in many types
        reason = first_line(e)
        raise CorpusError(f"dataset {spec!r}: cannot load it ({type(e).__name__}: "
                          f"{reason})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_suffix(".part")
    written = 0
    with open(part, "w", encoding="utf-8") as f:
        for row in ds:
            text = row.get("text")
            if text is None:
                raise CorpusError(f"dataset {spec!r} has no 'text' column: {sorted(row)}")
            f.write(text.rstrip("\n") + "\n")
            written += len(text)
            if written >= max_chars:
                break
    if written == 0:
        raise CorpusError(f"dataset {spec!r} yielded no text")
    part.replace(target)
    return target
